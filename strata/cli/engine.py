"""`strata engine [engine flags]` (also `strata --flag ...`): one engine process serving the
OpenAI-compatible API on --host/--port."""

from __future__ import annotations

import argparse

from strata.engine.options import EngineOptions, add_engine_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)


def options_from_namespace(args: argparse.Namespace) -> EngineOptions:
    """EngineOptions with `given_flags` as the parser recorded them: a flag given with its
    default value (`--spec 0`) counts as given (start-up warnings and the MTP default need it)."""
    return EngineOptions.from_namespace(args)


def run(args: argparse.Namespace) -> int:
    from strata.server.engine_process import run_engine

    return run_engine(options_from_namespace(args))
