"""Pick the compute backend for `--device auto|cpu|cuda`."""

from __future__ import annotations

from strata.backend.base import Backend
from strata.errors import StrataError


def cuda_available() -> bool:
    try:
        import cupy  # noqa: F401

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def make_backend(device: str = "auto", *, no_native: set[str] | None = None, threads: int | None = None) -> Backend:
    if device == "cpu" or (device == "auto" and not cuda_available()):
        from strata.backend.cpu import CpuBackend

        return CpuBackend(threads=threads)
    if not cuda_available():
        raise StrataError("--device cuda: no CUDA device (CuPy is missing or sees no GPU)")
    try:
        from strata.backend.cuda import CudaBackend
    except ImportError as e:
        if device == "auto":
            from strata.backend.cpu import CpuBackend

            return CpuBackend(threads=threads)
        raise StrataError(f"--device cuda: the CUDA backend is not available in this build ({e})") from None
    return CudaBackend(no_native=no_native or set())
