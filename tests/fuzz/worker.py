"""A child process that lists each mutant as `strata inspect` does, then loads it the way
`strata generate --device cpu --max-tokens 1` does.

Protocol: one mutant path per line on stdin; one JSON line per mutant on the original stdout:
  {"outcome": "loaded"}                   the engine loaded it and generated a token
  {"outcome": "refused", "message": ...}  a StrataError (the user's one line)
  {"outcome": "bug", "message": ...}      anything else: a traceback, a failed first window, or
                                          `strata inspect` failing on it
Engine output and stray prints go to stderr so they cannot corrupt the protocol. On Linux the
address space is capped (RLIMIT_AS) so a mutant that asks for too much memory fails here, in
this process, instead of taking the machine down; elsewhere that bound is skipped.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import traceback

MEMORY_LIMIT_ENV = "STRATA_FUZZ_MEMORY_MB"
DEFAULT_MEMORY_MB = 2048  # a worker peaks near 400 MiB of address space on these packs


def limit_memory() -> None:
    try:
        import resource
    except ImportError:  # Windows: no RLIMIT_AS; the parent's time bound still holds
        return
    limit = int(os.environ.get(MEMORY_LIMIT_ENV, DEFAULT_MEMORY_MB)) << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def load_and_generate(path: str) -> dict:
    from strata.engine.core import EngineCore
    from strata.engine.options import EngineOptions
    from strata.protocol import FinishEvent, GenerationRequest, SamplingParams
    from strata.errors import StrataError

    core = None
    try:
        core = EngineCore.load(EngineOptions(pack=path, device="cpu"), log=lambda line: None)
        text = core.chat.render([{"role": "user", "content": "hi"}])
        ids = core.tokenizer.encode(text, add_special=True)
        handle = core.submit(GenerationRequest(ids, SamplingParams(max_tokens=1)))
        core.scheduler.run_until_idle()
        while not isinstance(ev := handle.events.get(timeout=60), FinishEvent):
            pass
        if ev.reason == "error":  # the pack loaded but its first window failed: a load check is missing
            return {"outcome": "bug", "message": f"first window failed ({ev.code}): {ev.error}"}
        return {"outcome": "loaded"}
    except StrataError as e:
        return {"outcome": "refused", "message": e.message}
    except BaseException:  # noqa: BLE001 - everything else is what the fuzzer is looking for
        return {"outcome": "bug", "message": traceback.format_exc(limit=-6)}
    finally:
        if core is not None and getattr(core, "pack", None) is not None:
            core.pack.close()


def inspect_problem(path: str) -> str | None:
    """`strata inspect PATH` in this process, its output into a strict UTF-8 stream (what a UTF-8
    terminal takes): None when it exits 0 or 2, else what went wrong."""
    from strata.cli.main import main as cli

    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli(["inspect", path])
            out.flush()
    except BaseException:  # noqa: BLE001
        return "strata inspect: " + traceback.format_exc(limit=-6)
    return None if code in (0, 2) else f"strata inspect: exit code {code}"


def run_mutant(path: str) -> dict:
    problem = inspect_problem(path)
    return {"outcome": "bug", "message": problem} if problem else load_and_generate(path)


def main() -> int:
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    limit_memory()
    importlib.import_module("strata.engine.core")  # imported once, before the first mutant's clock starts

    print(json.dumps({"outcome": "ready"}), file=proto, flush=True)
    for line in sys.stdin:
        path = line.strip()
        if path:
            print(json.dumps(run_mutant(path)), file=proto, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
