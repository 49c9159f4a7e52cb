"""`strata engine [engine flags]` (also `strata --flag ...`): one engine process serving the
OpenAI-compatible API on --host/--port."""

from __future__ import annotations

import argparse

from strata.engine.options import EngineOptions, add_engine_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)


def options_from_namespace(args: argparse.Namespace) -> EngineOptions:
    """EngineOptions with `given_flags` recovered from the values that differ from the defaults
    (the dispatcher parsed the flags; start-up warnings need to know which were given)."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(defaults)
    default_ns = defaults.parse_args([])
    given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
             if hasattr(default_ns, k) and getattr(default_ns, k) != v]
    return EngineOptions.from_namespace(args, given)


def run(args: argparse.Namespace) -> int:
    from strata.server.engine_process import run_engine

    return run_engine(options_from_namespace(args))
