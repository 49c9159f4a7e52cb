"""Drive mutants through worker processes with a time bound each; collect outcomes by kind.

A worker that dies (a crash, the memory cap) or goes silent past the time bound (a hang) is
killed, the mutant is recorded with that outcome, and a fresh worker takes the next mutant.

By hand: `python -m tests.fuzz.harness --mutants 3000 [--seed 1] [--workers 2] [--only I]`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tests.fuzz.mutate import Mutant, Seed, make_mutant, write_seed_packs

REPO = Path(__file__).resolve().parents[2]
MUTANT_SECONDS = 20.0  # one load + one token of a ~100 KiB pack takes ~10-50 ms; anything near this is a hang
START_SECONDS = 60.0
GOOD = ("loaded", "refused")


@dataclass
class Result:
    mutant: Mutant
    outcome: str  # loaded | refused | bug | crash | hang
    message: str = ""


class Worker:
    """One child running tests.fuzz.worker; restarted after a crash or a hang."""

    def __init__(self, command: list[str] | None = None) -> None:
        self.command = command or [sys.executable, "-m", "tests.fuzz.worker"]
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()

    def _start(self) -> None:
        self.proc = subprocess.Popen(self.command, cwd=REPO, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, encoding="utf-8")
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc, self.lines), daemon=True).start()
        ready = self.lines.get(timeout=START_SECONDS)
        if ready is None:
            raise RuntimeError("the fuzz worker did not start")

    @staticmethod
    def _pump(proc: subprocess.Popen, lines: queue.Queue) -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # end of output: the worker died

    def run(self, mutant: Mutant, timeout: float) -> Result:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write(f"{mutant.path}\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=timeout)
        except (BrokenPipeError, OSError):
            line = None
        except queue.Empty:
            self.stop()
            return Result(mutant, "hang", f"no answer in {timeout:.0f} s")
        if line is None:
            code = self.proc.wait()
            self.proc = None
            return Result(mutant, "crash", f"the worker died (exit code {code})")
        reply = json.loads(line)
        return Result(mutant, reply["outcome"], reply.get("message", ""))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.outcome not in GOOD or
                (r.outcome == "refused" and "\n" in r.message)]

    def counts(self) -> Counter:
        return Counter(r.outcome for r in self.results)

    def by_kind(self) -> dict[str, Counter]:
        table: dict[str, Counter] = defaultdict(Counter)
        for r in self.results:
            table[r.mutant.kind][r.outcome] += 1
        return dict(table)

    def summary(self) -> str:
        lines = [f"{len(self.results)} mutants in {self.seconds:.1f} s: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(self.counts().items()))]
        for kind, c in self.by_kind().items():
            lines.append(f"  {kind:<20} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        for r in self.failures[:30]:
            lines.append(f"FAIL {r.mutant}: {r.outcome}: {r.message.strip()[-1500:]}")
        return "\n".join(lines)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:  # Windows: a map the worker still holds keeps the file; the folder goes later
        pass


def campaign(n_mutants: int, seed: int = 0, workers: int = 2, only: list[int] | None = None,
             work_dir: Path | None = None, timeout: float = MUTANT_SECONDS) -> Report:
    """Make mutants 0..n-1 (or just `only`) of the four seed packs and run them all."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        tmp_path = Path(tmp)
        seeds = {arch: Seed.open(arch, path) for arch, path in write_seed_packs(tmp_path / "seeds").items()}
        mutants_dir = tmp_path / "mutants"
        mutants_dir.mkdir()
        todo: queue.Queue = queue.Queue()
        for i in only if only is not None else range(n_mutants):
            todo.put(i)
        report = Report()
        lock = threading.Lock()

        def drive() -> None:
            worker = Worker()
            try:
                while True:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    mutant = make_mutant(i, seed, seeds, mutants_dir)
                    result = worker.run(mutant, timeout)
                    with lock:
                        report.results.append(result)
                    if result.outcome in GOOD:  # failures stay until the end, for a look by hand
                        _remove(mutant.path)
            finally:
                worker.stop()

        threads = [threading.Thread(target=drive) for _ in range(max(1, workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report.results.sort(key=lambda r: r.mutant.index)
    report.seconds = time.perf_counter() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz.harness", description=__doc__)
    p.add_argument("--mutants", type=int, default=int(os.environ.get("STRATA_FUZZ_MUTANTS", 340)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--only", type=int, action="append", help="run just this mutant index (repeatable)")
    args = p.parse_args(argv)
    report = campaign(args.mutants, args.seed, args.workers, args.only)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
