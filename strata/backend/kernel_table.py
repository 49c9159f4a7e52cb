"""The native kernel table an engine uses on this machine: the cpu rows always (the host
fallback), plus the cuda rows where the CUDA backend can run here (select.cuda_problem) and
strata.kernels.cuda registers them. The table itself is strata.kernels.native_table; this
module only knows how to find out what the machine has."""

from __future__ import annotations

from typing import Iterable

from strata.backend.select import cuda_problem
from strata.kernels.native_table import NativeTable, cpu_table


def add_cuda_rows(table: NativeTable) -> bool:
    """Let the CUDA kernels register their rows; record why not when CuPy or a GPU is absent.

    The CUDA kernels are optional (they need CuPy): any failure to import them or to find a
    device marks the backend "not built" instead of failing."""
    problem = cuda_problem()  # no CuPy, no device, or a GPU the kernels cannot run on (< sm_80)
    if problem is not None:
        table.unavailable["cuda"] = f"not built: {problem.why}"
        return False
    try:
        from strata.kernels.cuda import register_native

        register_native(table)
    except Exception as e:
        table.unavailable["cuda"] = f"not built: {type(e).__name__}: {e}".splitlines()[0]
        return False
    return True


def cuda_kernels_usable() -> bool:
    """True when the CUDA backend can run on this GPU and strata.kernels.cuda imports."""
    if cuda_problem() is not None:
        return False
    try:
        import strata.kernels.cuda  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(device: str) -> str:
    """--device auto|cpu|cuda -> the backend name the table and probe use."""
    if device == "auto":
        return "cuda" if cuda_kernels_usable() else "cpu"
    return device


def table_for_backend(backend: str, no_native: Iterable[str] = ()) -> NativeTable:
    """The table an engine on `backend` uses: cpu rows always (host fallback), cuda rows on cuda."""
    table = cpu_table()
    if backend == "cuda":
        add_cuda_rows(table)
    return table.without(set(no_native)) if no_native else table
