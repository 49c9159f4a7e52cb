"""`strata <command> ...`: find the command's module in a table, parse its flags, run it.

Each command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`.
A module missing from this build is reported, not crashed on. `strata --flag ...` (first
argument a flag) is shorthand for `strata engine --flag ...`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from strata import __version__
from strata.errors import StrataError

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("strata.cli.generate", "generate text from a prompt"),
    "tokenize": ("strata.cli.tokenize", "show a prompt's token ids"),
    "inspect": ("strata.cli.inspect", "list a pack's tensors, types and metadata"),
    "kernels": ("strata.cli.kernels", "show which kernels serve each type"),
    "probe": ("strata.cli.probe", "report which tensors run native, generic or not at all, and batch-MTP per slot"),
    "pack": ("strata.cli.pack", "build packs (synthetic test models)"),
    "serve": ("strata.cli.serve", "run the OpenAI-compatible HTTP server"),
    "engine": ("strata.cli.engine", "run the engine process"),
    "mtp": ("strata.cli.mtp", "multi-token-prediction drafts"),
    "experts": ("strata.cli.experts", "record an expert routing profile (--expert-profile)"),
    "pull": ("strata.cli.pull", "fetch the default model into the cache folder (done on first use too)"),
}
DEFAULT_COMMAND = "engine"


class CommandParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one StrataError line (exit 2) instead of usage spam."""

    def error(self, message: str):  # argparse hook
        raise StrataError(f"{self.prog}: {message}")


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: strata <command> [flags]   (strata --flag ... is strata engine --flag ...)", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n`strata <command> --help` shows a command's flags.")
    return "\n".join(lines)


def _load(command: str):
    module_name = COMMANDS[command][0]
    if importlib.util.find_spec(module_name) is None:
        raise StrataError(f"command {command} is not available in this build")
    return importlib.import_module(module_name)


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"strata {__version__}")
        return 0
    if argv[0].startswith("-"):
        command, rest = DEFAULT_COMMAND, argv
    else:
        command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        raise StrataError(f"unknown command {command!r} (commands: {', '.join(COMMANDS)})")
    module = _load(command)
    parser = CommandParser(prog=f"strata {command}", description=COMMANDS[command][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    try:
        return _dispatch(sys.argv[1:] if argv is None else list(argv))
    except StrataError as e:
        print(f"strata: {e.message}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `strata inspect ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
