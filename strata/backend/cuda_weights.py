"""How the CUDA backend keeps 2-D weights and the token embedding on the device.

A weight of a type with a native kernel is uploaded once as its raw GGUF blocks; consecutive
parts of a fused weight (q,k,v / gate,up) of one native type and row length are stacked into one
part (one MMVQ launch for all, each output row the same dot product as in its own weight). A
type without a native kernel (or dropped with --no-native) is dequantized on the host and kept
as float16 for cuBLAS. Expert weights go through the expert store (expert_store.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from strata.backend.base import TensorSource
from strata.gguf.row_source import HOST_ROW_TENSORS
from strata.kernels.dequant import dequantize
from strata.kernels.ggml_types import type_by_id


@dataclass
class Part:
    type_id: int
    rows: int
    k: int
    blocks: Any  # cupy uint8 (rows, row_bytes) for native; cupy float16 (rows, k) for generic
    native: bool
    offset: int = 0  # first output row of this part in the weight's output
    launches: dict = field(default_factory=dict)  # ncols -> (kernel, launch, leading args)


@dataclass
class CudaLinear:
    parts: list[Part]
    names: tuple[str, ...]
    rows: int = 0  # output rows of all parts
    needs_q8: bool = False  # some part multiplies Q8_1-quantized activations


@dataclass
class CudaEmbedding:
    source: TensorSource  # host memmap of the blocks
    row_len: int
    blocks: Any = None  # the blocks on the device (rows gathered there), or None: on the host


class Uploads:
    """The weights a backend put on the device, each uploaded once (a tied embedding and output
    head share their blocks). device(host array, what): the array on the device, or one clear
    line when it does not fit."""

    def __init__(self, device: Callable[[np.ndarray, str], Any], native_types: set[int], float_types: tuple[int, ...]):
        self._device = device
        self.native_types = native_types
        self._float_types = float_types
        # keyed by the source object, not its name: a draft's tensors may share the main model's
        # names; the entry holds the source so its id is never reused
        self._blocks: dict[int, tuple[Any, Any]] = {}

    def blocks(self, src: TensorSource, rows: int) -> Any:
        """The raw blocks of a tensor on the device as (rows, row_bytes) uint8."""
        hit = self._blocks.get(id(src))
        if hit is None:
            row_bytes = type_by_id(src.ggml_type).row_bytes(int(src.shape[0]))
            hit = (src, self._device(np.asarray(src.data()).reshape(rows, row_bytes), src.name))
            self._blocks[id(src)] = hit
        return hit[1]

    def part(self, src: TensorSource) -> Part:
        k, rows = int(src.shape[0]), int(np.prod(src.shape[1:]))
        if src.ggml_type in self.native_types:
            return Part(src.ggml_type, rows, k, self.blocks(src, rows), True)
        w = dequantize(src.ggml_type, np.asarray(src.data()), rows * k).reshape(rows, k)
        return Part(src.ggml_type, rows, k, self._device(w.astype(np.float16), f"{src.name} (as float16)"), False)

    def merged(self, sources: Sequence[TensorSource]) -> Part:
        """One native part from several sources of one type and row length, rows stacked."""
        t = type_by_id(sources[0].ggml_type)
        k = int(sources[0].shape[0])
        raw = np.concatenate([np.asarray(s.data()).reshape(-1, t.row_bytes(k)) for s in sources], axis=0)
        return Part(t.id, raw.shape[0], k, self._device(raw, ", ".join(s.name for s in sources)), True)

    def linear_weight(self, sources: Sequence[TensorSource], fused: bool) -> CudaLinear:
        """A weight of one or more sources (fused along the output rows); fused: runs of
        mergeable sources stacked into one part (else one part per source)."""
        names = tuple(s.name for s in sources)
        if not fused:
            return CudaLinear([self.part(s) for s in sources], names)
        groups: list[list[TensorSource]] = []  # runs of consecutive mergeable sources
        for s in sources:
            prev = groups[-1][-1] if groups else None
            if (prev is not None and s.ggml_type == prev.ggml_type and s.shape[0] == prev.shape[0]
                    and s.ggml_type in self.native_types):
                groups[-1].append(s)
            else:
                groups.append([s])
        parts = [self.merged(g) if len(g) > 1 else self.part(g[0]) for g in groups]
        off = 0
        for p in parts:
            p.offset, off = off, off + p.rows
        needs_q8 = any(p.native and p.type_id not in self._float_types for p in parts)
        return CudaLinear(parts, names, off, needs_q8)

    def mark(self) -> int:
        return len(self._blocks)

    def drop_since(self, mark: int) -> None:
        for key in list(self._blocks)[mark:]:  # insertion order: the ones made after the mark
            del self._blocks[key]


HOST_SIDE = ("token_embd", *HOST_ROW_TENSORS)  # tensors weight_bytes leaves out


def weight_bytes(tensors: Sequence[Any], native_types: set[int]) -> int:
    """What the pack's tensors take on the device once loaded, at least: native types their own
    blocks, others dequantized to float16, 1-D tensors float32. The token embedding is left out
    (it may stay on the host), and the n-gram table (it always does: strata/gguf/row_source.py)."""
    total = 0
    for t in tensors:
        if t.name.startswith(HOST_SIDE):
            continue
        n = int(np.prod(t.shape))
        if len(t.shape) == 1:
            total += 4 * n
        elif t.ggml_type in native_types:
            total += int(t.nbytes)
        else:
            total += 2 * n
    return total
