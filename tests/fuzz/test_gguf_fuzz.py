"""Mutated GGUF packs of every architecture: each one loads and generates a token, or is refused
with one StrataError line. Never a traceback, a failed first window, a crash, a hang or a memory
blow-up (those are caught in the worker processes and reported with the mutant's description).

CI runs DEFAULT_MUTANTS with a fixed seed in a few seconds; STRATA_FUZZ_MUTANTS=5000 (and
STRATA_FUZZ_SEED) run a larger campaign with the same test.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from strata.errors import StrataError
from strata.gguf.constants import ValueType as V
from strata.gguf.reader import GGUFFile
from strata.gguf.writer import GGUFWriter
from tests.fuzz.harness import REPO, Worker, campaign
from tests.fuzz.mutate import ARCHS, KINDS, Mutant, Seed, make_mutant, write_seed_packs

DEFAULT_MUTANTS = 17 * 30  # 30 of each kind, spread over the architectures
N_MUTANTS = int(os.environ.get("STRATA_FUZZ_MUTANTS", DEFAULT_MUTANTS))
SEED = int(os.environ.get("STRATA_FUZZ_SEED", 0))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, Seed]:
    paths = write_seed_packs(tmp_path_factory.mktemp("seeds"))
    return {arch: Seed.open(arch, path) for arch, path in paths.items()}


def test_seed_packs_load_and_generate(seeds):
    """The unmutated packs pass through the same worker: so a refusal below is the mutation's."""
    worker = Worker()
    try:
        for arch, seed in seeds.items():
            result = worker.run(Mutant(-1, "none", arch, "the seed pack", seed.path), timeout=60)
            assert result.outcome == "loaded", (arch, result.message)
    finally:
        worker.stop()


# A stand-in worker speaking the same protocol, to show the harness tells each bad end apart.
_FAKE_WORKER = """
import json, os, sys, time
print(json.dumps({"outcome": "ready"}), flush=True)
for line in sys.stdin:
    name = line.strip()
    if name == "hang":
        time.sleep(60)
    if name == "crash":
        os._exit(7)
    reply = {"outcome": "bug", "message": "Traceback"} if name == "bug" else {"outcome": "loaded"}
    print(json.dumps(reply), flush=True)
"""


def test_harness_reports_hangs_crashes_and_tracebacks():
    worker = Worker([sys.executable, "-c", _FAKE_WORKER])
    try:
        names = ["ok", "hang", "ok", "crash", "bug", "ok"]
        # the hang sleeps 60 s: 2 s tell it; the others answer at once, given as long as a loaded
        # machine may take to schedule them
        got = [worker.run(Mutant(i, "k", "llama", n, Path(n)), timeout=2 if n == "hang" else 60).outcome
               for i, n in enumerate(names)]
    finally:
        worker.stop()
    assert got == ["loaded", "hang", "loaded", "crash", "bug", "loaded"]  # a fresh worker after each bad end


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_AS is Linux/Unix only; the time bound still holds")
def test_worker_memory_bound_holds():
    code = "from tests.fuzz.worker import limit_memory; limit_memory(); bytearray(8 << 30)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "MemoryError" in proc.stderr


def test_mutants_load_or_refuse_on_one_line():
    report = campaign(N_MUTANTS, seed=SEED, workers=2)
    print("\n" + report.summary())
    assert len(report.results) == N_MUTANTS
    assert not report.failures, report.summary()
    by_kind = report.by_kind()
    assert set(by_kind) == set(KINDS)  # every kind ran, on every architecture
    assert {r.mutant.arch for r in report.results} == set(ARCHS)
    counts = report.counts()
    assert counts["loaded"] > 0 and counts["refused"] > 0


def _every_type_file(path: Path) -> bytes:
    """A small file with a value of every metadata type and three tensors."""
    w = GGUFWriter(path)
    for i, vt in enumerate((V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.FLOAT32, V.BOOL,
                            V.UINT64, V.INT64, V.FLOAT64)):
        w.add_metadata(f"k.{vt.name.lower()}", 1, vt)
    w.add_metadata("k.string", "text")
    w.add_metadata("k.strings", ["a", "bc", ""])
    w.add_metadata("k.ints", [1, 2, 3])
    w.add_tensor("a.weight", 0, (8, 2), np.ones(16, np.float32))
    w.add_tensor("b.weight", 0, (8,), np.ones(8, np.float32))
    w.add_tensor("c.weight", 1, (4,), np.ones(4, np.float16))
    return w.write().read_bytes()


def test_truncated_at_every_position(tmp_path):
    data = _every_type_file(tmp_path / "full.gguf")
    with GGUFFile(tmp_path / "full.gguf") as full:
        data_end = max(t.offset + t.nbytes for t in full.tensors.values())
    cut = tmp_path / "cut.gguf"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        if n >= data_end:  # only the last tensor's padding is gone: nothing is missing
            GGUFFile(cut).close()
            continue
        with pytest.raises(StrataError) as err:
            GGUFFile(cut)
        assert "\n" not in err.value.message and str(cut) in err.value.message, (n, err.value.message)


@pytest.mark.parametrize("field,at", [("tensor count", 8), ("metadata count", 16)])
@pytest.mark.parametrize("value", [2**64 - 1, 2**40, 10**6])
def test_huge_counts_refused_before_any_loop(tmp_path, field, at, value):
    path = tmp_path / "huge.gguf"
    data = bytearray(_every_type_file(path))
    struct.pack_into("<Q", data, at, value)
    path.write_bytes(bytes(data))
    with pytest.raises(StrataError, match=f"{field} {value} is more than a file of {len(data)} bytes holds"):
        GGUFFile(path)


# A sample through the real CLI as child processes: one mutant of each kind (`generate`), a few
# (`inspect`). `generate` turns a failed first window into exit 2 too, which is why the campaign
# above, not this sample, is the test that tells a load check from a late failure.
CLI_SAMPLE = list(range(len(KINDS)))
INSPECT_SAMPLE = [0, 4, 5, 10, 11, 14]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=120)


@pytest.fixture(scope="module")
def cli_mutants(seeds, tmp_path_factory) -> list[Mutant]:
    """The unmutated packs (each must exit 0) and one mutant of each kind."""
    out = tmp_path_factory.mktemp("cli-mutants")
    unmutated = [Mutant(-1, "none", arch, "the seed pack", seed.path) for arch, seed in seeds.items()]
    return unmutated + [make_mutant(i, SEED, seeds, out) for i in CLI_SAMPLE]


# what the engine logs while loading; on exit 2 every other line is the one error line
LOG_LINE = re.compile(r"strata: (pack .+: \S+, \d+ layers, \d+ tensors, |loading \d+ layers on )")


def _check_cli(mutant: Mutant, proc: subprocess.CompletedProcess) -> None:
    said = f"{mutant}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.returncode in (0, 2), said
    assert "Traceback" not in proc.stderr + proc.stdout, said
    if proc.returncode == 2:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if not LOG_LINE.match(ln)]
        assert len(errors) == 1 and errors[0] == lines[-1] and errors[0].startswith("strata: "), said


def test_cli_generate_sample(cli_mutants):
    args = lambda m: ("generate", "--pack", str(m.path), "--device", "cpu", "--max-tokens", "1",  # noqa: E731
                      "--prompt", "hi")
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda m: _cli(*args(m)), cli_mutants))
    for mutant, proc in zip(cli_mutants, procs):
        _check_cli(mutant, proc)
        if mutant.kind == "none":
            assert proc.returncode == 0, proc.stderr


def test_cli_inspect_sample(cli_mutants):
    sample = [m for m in cli_mutants if m.index in INSPECT_SAMPLE]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda m: _cli("inspect", str(m.path)), sample))
    for mutant, proc in zip(sample, procs):
        _check_cli(mutant, proc)
