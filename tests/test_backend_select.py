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


QWEN4EXP = ROOT / "tests" / "data" / "qwen4exp" / "qwen4exp-tiny-f16.gguf"


@pytest.mark.parametrize("problem", [None, OLD_GPU], ids=["gpu-that-runs-cuda", "old-gpu"])
def test_an_architecture_without_cuda_layers_runs_on_the_cpu_under_auto(monkeypatch, problem):
    """qwen4exp declares devices=("cpu",): auto takes the CPU and says why only where the GPU would
    otherwise have been taken; cpu is untouched; cuda is one line whatever the machine has."""
    monkeypatch.setattr(select, "cuda_problem", lambda: problem)
    lines: list[str] = []
    assert select.device_for_model("auto", "qwen4exp", ("cpu",), lines.append) == "cpu"
    assert lines == ([] if problem else
                     ["strata: --device auto: qwen4exp runs on the CPU backend only in this build (its CUDA "
                      "layers are not built yet); running on the CPU"])
    assert select.device_for_model("cpu", "qwen4exp", ("cpu",), lines.append) == "cpu"
    assert select.device_for_model("auto", "llama", ("cpu", "cuda"), lines.append) == "auto"
    with pytest.raises(StrataError, match=r"^--device cuda: qwen4exp runs on the CPU backend only"):
        select.device_for_model("cuda", "qwen4exp", ("cpu",), lines.append)


def test_cuda_for_a_cpu_only_architecture_exits_2_with_one_line():
    """A real child process on the oracle's tiny qwen4exp file: refused before any backend is made."""
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--pack", str(QWEN4EXP), "--device",
                        "cuda", "--prompt", "hi", "--max-tokens", "2"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "strata: --device cuda: qwen4exp runs on the CPU backend only in this build (its CUDA layers are not "
        "built yet); use --device cpu"]


def test_probe_of_a_cpu_only_architecture_names_the_engine_s_backend():
    """strata probe shows the table of the backend the engine would take: --device cuda is the
    engine's one line, auto the CPU's table."""
    cmd = [sys.executable, "-m", "strata.cli.main", "probe", "--pack", str(QWEN4EXP)]
    r = subprocess.run(cmd + ["--device", "cuda"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[0].startswith("strata: --device cuda: qwen4exp runs on the CPU backend only")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "; backend cpu;" in r.stdout.splitlines()[0]
