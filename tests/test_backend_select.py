"""`--device auto|cpu|cuda`: auto takes the GPU only where the CUDA kernels run (sm_80 and newer,
CuPy there), says why when a GPU is there but cannot run them, and `--device cuda` on such a
machine is one line (exit 2), not a kernel build failing in the first window."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import strata.backend.select as select
from strata.errors import StrataError

ROOT = Path(__file__).resolve().parents[1]
OLD_GPU = select.CudaProblem(select.capability_problem(75, "Tesla T4"), gpu=True)


@pytest.mark.parametrize("cc,ok", [(75, False), (70, False), (80, True), (86, True), (89, True), (90, True),
                                   (120, True)])
def test_the_kernels_floor_is_sm_80(cc, ok):
    problem = select.capability_problem(cc, "GPU X")
    assert (problem is None) == ok
    if not ok:
        assert problem == (f"GPU X is sm_{cc}; Strata's CUDA kernels need sm_80 or newer "
                           "(Ampere, Ada, Hopper, Blackwell)")


def test_auto_on_an_old_gpu_runs_on_the_cpu_and_says_why(monkeypatch):
    monkeypatch.setattr(select, "cuda_problem", lambda: OLD_GPU)
    lines: list[str] = []
    assert select.make_backend("auto", log=lines.append).name == "cpu"
    assert lines == [f"strata: --device auto: {OLD_GPU.why}; running on the CPU"]


def test_auto_without_a_gpu_runs_on_the_cpu_quietly(monkeypatch):
    none = select.CudaProblem("no CUDA device (CuPy sees no GPU)", gpu=False)
    monkeypatch.setattr(select, "cuda_problem", lambda: none)
    lines: list[str] = []
    assert select.make_backend("auto", log=lines.append).name == "cpu"
    assert lines == []


def test_cuda_on_an_old_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(select, "cuda_problem", lambda: OLD_GPU)
    with pytest.raises(StrataError, match=r"^--device cuda: Tesla T4 is sm_75; Strata's CUDA kernels need sm_80"):
        select.make_backend("cuda")


def test_cuda_where_it_cannot_run_exits_2_with_one_line():
    """A real child process: on this machine either CUDA runs (then nothing to check here) or the
    command names why in one line."""
    problem = select.cuda_problem()
    if problem is None:
        pytest.skip("the CUDA backend runs on this machine")
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--device", "cuda", "--prompt", "hi"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"strata: --device cuda: {problem.why}"]


def test_a_gpu_that_runs_the_kernels_is_taken():
    pytest.importorskip("cupy")
    if select.cuda_problem() is not None:
        pytest.skip(select.cuda_problem().why)
    assert select.make_backend("auto").name == "cuda"
    assert select.make_backend("cuda").name == "cuda"
