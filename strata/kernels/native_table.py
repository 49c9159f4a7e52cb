"""The native kernel table: which (backend, GGML type) pairs have a quantized mat-vec kernel.

One row per (backend, type) that has a native kernel, with how many activation columns one
launch takes (1..max_cols, like llama.cpp's MMVQ_MAX_BATCH_SIZE = 8) and the implementation.
A type with no row on a backend goes through the generic path there: dequantize, then matmul.

Backends fill the same table: the "cpu" rows are the numpy mirrors of strata.kernels.mmvq_numpy
(registered by `cpu_table()`); the CUDA kernels register their own rows with
`strata.kernels.cuda.register_native(table)`, which strata.backend.kernel_table calls where the
machine has a usable GPU. The capability probe reads the table; the diagnostic flag
`--no-native TYPES` removes rows with `without()`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable

from strata.kernels.ggml_types import ALL_TYPES, BY_NAME, type_by_id

# llama.cpp's MMVQ_MAX_BATCH_SIZE: wider batches are split into launches of at most this many.
DEFAULT_MAX_COLS = 8

# A native mat-vec: impl(w uint8 (rows, row_bytes), x float32 (ncols, k)) -> float32 (ncols, rows).
MatVec = Callable[..., object]


@dataclass(frozen=True)
class NativeKernel:
    backend: str
    type_id: int
    max_cols: int  # columns one launch takes; wider windows split into ceil(n / max_cols) launches
    impl: MatVec
    impl_name: str  # for printing: where the kernel lives

    @property
    def type_name(self) -> str:
        t = type_by_id(self.type_id)
        return t.name if t else f"type {self.type_id}"

    def launches(self, ncols: int) -> int:
        """Launches needed for ncols activation columns."""
        return max(1, -(-ncols // self.max_cols))


class NativeTable:
    """(backend, type id) -> NativeKernel. Copies are cheap; `without()` never mutates."""

    def __init__(self, kernels: Iterable[NativeKernel] = ()):
        self._rows: dict[tuple[str, int], NativeKernel] = {}
        # backend -> why it has no rows (e.g. "not built: CuPy is not installed")
        self.unavailable: dict[str, str] = {}
        for k in kernels:
            self._rows[(k.backend, k.type_id)] = k

    def register(self, backend: str, type_id: int, max_cols: int, impl: MatVec,
                 impl_name: str | None = None) -> NativeKernel:
        if type_by_id(type_id) is None:
            raise ValueError(f"native table: unknown GGML type id {type_id}")
        if max_cols < 1:
            raise ValueError(f"native table: max_cols must be >= 1, got {max_cols}")
        name = impl_name or getattr(impl, "__qualname__", None) or repr(impl)
        k = NativeKernel(backend, type_id, max_cols, impl, name)
        self._rows[(backend, type_id)] = k
        return k

    def lookup(self, backend: str, type_id: int) -> NativeKernel | None:
        return self._rows.get((backend, type_id))

    def supports(self, backend: str, type_id: int, ncols: int) -> bool:
        """True when one launch of the native kernel takes ncols columns."""
        k = self.lookup(backend, type_id)
        return k is not None and 1 <= ncols <= k.max_cols

    def without(self, type_names: set[str] | Iterable[str]) -> "NativeTable":
        """A copy with the named types removed on every backend (names are case-insensitive)."""
        names = {n.strip().upper() for n in type_names if n.strip()}
        unknown = sorted(n for n in names if n not in BY_NAME)
        if unknown:
            # Imported here: the error type belongs to the CLI layer's contract, not the table's.
            from strata.errors import StrataError

            raise StrataError(f"--no-native: unknown GGML type {', '.join(unknown)} "
                              f"(known: {', '.join(t.name for t in ALL_TYPES)})")
        drop = {BY_NAME[n].id for n in names}
        copy = NativeTable(k for k in self._rows.values() if k.type_id not in drop)
        copy.unavailable = dict(self.unavailable)
        return copy

    def backends(self) -> list[str]:
        seen = dict.fromkeys(k.backend for k in self._rows.values())
        seen.update(dict.fromkeys(self.unavailable))
        return list(seen)

    def kernels(self, backend: str | None = None) -> list[NativeKernel]:
        return [k for k in self._rows.values() if backend is None or k.backend == backend]

    def status(self, backend: str, type_id: int) -> str:
        """'native 1..N', 'generic', or 'not built' for a backend that could not load."""
        if backend in self.unavailable and not self.kernels(backend):
            return "not built"
        k = self.lookup(backend, type_id)
        return f"native 1..{k.max_cols}" if k else "generic"

    def rows(self, backends: Iterable[str] | None = None) -> list[dict]:
        """One dict per GGML type: type, id, block, bytes and one status per backend."""
        bs = list(backends) if backends is not None else self.backends()
        out = []
        for t in ALL_TYPES:
            row = {"type": t.name, "id": t.id, "block": t.block_size, "bytes": t.type_size}
            for b in bs:
                row[b] = self.status(b, t.id)
            out.append(row)
        return out


def cpu_table() -> NativeTable:
    """A table holding the cpu rows: one numpy MMVQ mirror per type that has one."""
    from strata.kernels import mmvq_numpy  # the mirrors import numpy-heavy tables; keep lazy

    table = NativeTable()
    for type_id in mmvq_numpy.MIRRORED_TYPES:
        table.register("cpu", type_id, DEFAULT_MAX_COLS, functools.partial(mmvq_numpy.mmvq, type_id),
                       "strata.kernels.mmvq_numpy")
    return table
