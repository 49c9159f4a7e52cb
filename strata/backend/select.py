"""Pick the compute backend for `--device auto|cpu|cuda`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from strata.backend.base import Backend
from strata.errors import StrataError

# The CUDA kernels' floor: cp.async and int8 mma.sync (m16n8k32) are Ampere's (sm_80) and later
MIN_COMPUTE_CAPABILITY = 80


def capability_problem(cc: int, name: str) -> str | None:
    """Why a GPU of compute capability `cc` (86 for sm_86) cannot run the CUDA kernels."""
    if cc < MIN_COMPUTE_CAPABILITY:
        return (f"{name} is sm_{cc}; Strata's CUDA kernels need sm_{MIN_COMPUTE_CAPABILITY} or newer "
                f"(Ampere, Ada, Hopper, Blackwell)")
    return None


@dataclass(frozen=True)
class CudaProblem:
    """Why the CUDA backend cannot run here, and whether a GPU is there all the same (then
    `--device auto` says why it runs on the CPU; without one it says nothing)."""

    why: str
    gpu: bool


def cuda_problem() -> CudaProblem | None:
    """Why the CUDA backend cannot run on this machine's current GPU (None: it can)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        return CudaProblem(f"CuPy is missing ({type(e).__name__})", gpu=False)
    try:
        if not cupy.cuda.is_available():
            return CudaProblem("no CUDA device (CuPy sees no GPU)", gpu=False)
        dev = cupy.cuda.Device()
        cc = int(dev.compute_capability)
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
    except Exception as e:  # a driver too old for this CuPy, a device in a bad state
        return CudaProblem(f"CUDA is not usable here ({type(e).__name__}: {e})".splitlines()[0], gpu=True)
    why = capability_problem(cc, name.decode() if isinstance(name, bytes) else str(name))
    return None if why is None else CudaProblem(why, gpu=True)


def cuda_available() -> bool:
    return cuda_problem() is None


def device_for_model(device: str, arch: str, runs_on: tuple[str, ...], log: Callable[[str], None]) -> str:
    """The --device a model of `arch` gets, where its architecture runs only on some backends
    (runs_on: ArchSpec.devices): `auto` takes the CPU when CUDA is not among them (saying so when
    a GPU is there), `cuda` is one clear line."""
    if device == "cpu" or "cuda" in runs_on:
        return device
    why = f"{arch} runs on the CPU backend only in this build (its CUDA layers are not built yet)"
    if device == "cuda":
        raise StrataError(f"--device cuda: {why}; use --device cpu")
    if cuda_available():
        log(f"strata: --device auto: {why}; running on the CPU")
    return "cpu"


def make_backend(device: str = "auto", *, no_native: set[str] | None = None, threads: int | None = None,
                 log: Callable[[str], None] | None = None) -> Backend:
    """`auto` takes the GPU when the CUDA backend can run there, else the CPU (saying why when
    a GPU is there but cannot run it); `cuda` without a usable GPU is one clear line."""
    problem = None if device == "cpu" else cuda_problem()
    if device == "cpu" or (device == "auto" and problem is not None):
        from strata.backend.cpu import CpuBackend

        if device == "auto" and log is not None and problem.gpu:
            log(f"strata: --device auto: {problem.why}; running on the CPU")
        return CpuBackend(threads=threads)
    if problem is not None:
        raise StrataError(f"--device cuda: {problem.why}")
    try:
        from strata.backend.cuda import CudaBackend
    except ImportError as e:
        if device == "auto":
            from strata.backend.cpu import CpuBackend

            return CpuBackend(threads=threads)
        raise StrataError(f"--device cuda: the CUDA backend is not available in this build ({e})") from None
    return CudaBackend(no_native=no_native or set())
