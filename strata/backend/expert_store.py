"""Where a model's expert weights live on the GPU, and the tables through which kernels reach them.

Every expert tensor the CUDA backend loads goes through the store. For each it keeps the experts'
blocks and a table on the device with one address per expert (strata.kernels.cuda.experts,
ExpertMatrices): the experts kernels read an expert's matrix from that table, never as base +
expert x stride. So a store may place an expert anywhere (or, with another tier, somewhere else
between windows) by rewriting its table entry, and a CUDA graph stays valid: it captured the
table's address, not the experts'. Today every expert is resident on the device, in one array per
tensor, and the tables never change.

A pool smaller than the experts (--expert-cache) keeps its bookkeeping in strata.experts.cache,
which knows no device: `resolve(layer, ids)` before a layer's experts names each expert's slot and
the (expert, slot) uploads of the window; a device store then copies those experts' blocks into
their slots and writes their slot addresses into the tables. The CPU backend's store
(cpu_experts.py) is such a tier in host memory today (float32 slots over the pack's quantized
blocks, a miss dequantized into its slot); this one declares no pool yet (Backend.expert_pool is
None): every expert loads resident.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from strata.backend.base import TensorSource
from strata.kernels.cuda import experts
from strata.kernels.dequant import dequantize
from strata.kernels.ggml_types import type_by_id


@dataclass
class CudaExperts:
    """One expert tensor as the backend runs it. Native: its raw blocks, reached through
    `matrices` (the address table). Otherwise (a type without a native kernel) the experts
    dequantized to float16 (n_expert, rows, k), which the generic path multiplies."""

    type_id: int
    native: bool
    n_expert: int
    rows: int  # output rows of one expert
    k: int  # weights per row
    blocks: Any  # the resident storage: (n_expert, rows, row_bytes) uint8, or (n_expert, rows, k) float16
    matrices: Any = None  # experts.ExpertMatrices of a native tensor (None: generic)


class ExpertStore:
    """The expert tensors of the backend's models, all resident on the device.

    device(host array, what) puts an array on the device (one clear line when it does not fit);
    native_types: the GGML types with native kernels (others are dequantized to float16)."""

    def __init__(self, device: Callable[[np.ndarray, str], Any], native_types: set[int]):
        self._device = device
        self.native_types = native_types
        # weak: a model dropped (a draft that did not fit) takes its experts with it
        self._tensors: list[weakref.ref] = []

    def add(self, source: TensorSource) -> CudaExperts:
        """Load an expert tensor (ne: [k, rows, n_expert]) and make its address table."""
        k, rows, n_exp = (int(x) for x in source.shape)
        raw = np.asarray(source.data())
        if source.ggml_type in self.native_types:
            blocks = self._device(raw.reshape(n_exp, rows, type_by_id(source.ggml_type).row_bytes(k)), source.name)
            w = CudaExperts(source.ggml_type, True, n_exp, rows, k, blocks, experts.resident_matrices(blocks))
        else:
            dense = dequantize(source.ggml_type, raw, n_exp * rows * k).reshape(n_exp, rows, k)
            blocks = self._device(dense.astype(np.float16), f"{source.name} (as float16)")
            w = CudaExperts(source.ggml_type, False, n_exp, rows, k, blocks)
        self._tensors.append(weakref.ref(w))
        return w

    def tensors(self) -> Iterator[CudaExperts]:
        """The expert tensors still in use, in loading order."""
        return (w for w in (r() for r in self._tensors) if w is not None)
