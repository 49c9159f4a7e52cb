"""Linear layers on the CUDA backend (fused path): which kernel multiplies which rows.

Activations are quantized to Q8_1 once per linear (or taken from the kernel that made x along
with them) and shared by its parts; a window of up to MAX_COLS rows launches the compiled MMVQ
kernel straight away (its launch worked out once per part and row count); more rows run as
several launches. A window with long prompts' rows (Span.long_prompt) multiplies those rows of
large weights through dequant + cuBLAS GEMM in fixed row tiles (cuda_prefill.py), the other rows
through MMVQ: the choice is per request and per weight, never per window, so a row's bits do not
depend on what shares its window.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata.backend.cuda_weights import CudaLinear, Part
from strata.backend.cuda_window import row_ranges
from strata.kernels.cuda import mmvq as mm
from strata.kernels.cuda import mmvq_build
from strata.kernels.cuda.launch import launch
from strata.kernels.ggml_types import type_by_id


def quantize(x: Any) -> Any:
    """Q8_1 activations of x (n, k) float32 contiguous, k a multiple of 32 (every native
    quantized type's rows are): mmvq.quantize_q8_1's kernel without its argument checks."""
    n, k = x.shape
    buf = mm.empty_q8(n, k)
    nblocks = n * (k // mm.QK)
    if nblocks:
        launch(mmvq_build.quant_kernel(), ((nblocks * 32 + 255) // 256,), (256,),
               (x, np.int32(nblocks), buf.q, buf.meta, buf.s))
    return buf


def q8_for(b: Any, x: Any) -> tuple[Any, Any]:
    """x as contiguous float32 and its Q8_1 blocks: the ones a fused kernel made along with x,
    else quantized now and kept for the window (gate and up, or an MoE's experts, read the same rows)."""
    q8 = b.win.q8_of(x)
    x = b.xp.ascontiguousarray(x, dtype=b.xp.float32)
    if q8 is None:
        q8 = quantize(x)
        b.win.keep_q8(x, q8)
    return x, q8


def linear_fused(b: Any, w: CudaLinear, x: Any) -> Any:
    cp = b.xp
    q8 = b.win.q8_of(x)
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    if q8 is None and w.needs_q8:
        q8 = quantize(x)  # once, shared by every part
    if len(w.parts) == 1:
        return run_part(b, w.parts[0], x, q8, None)
    if x.shape[0] == 1:  # a column slice of one row is contiguous: parts write in place
        out = cp.empty((1, w.rows), dtype=cp.float32)
        for p in w.parts:
            run_part(b, p, x, q8, out[:, p.offset : p.offset + p.rows])
        return out
    return cp.concatenate([run_part(b, p, x, q8, None) for p in w.parts], axis=1)


def run_generic(xp: Any, p: Part, x: Any) -> Any:
    """A part without a native kernel: float16 weights through cuBLAS."""
    return xp.matmul(x, p.blocks.T.astype(xp.float32))


def run_part(b: Any, p: Part, x: Any, q8: Any, out: Any) -> Any:
    """One part of a linear: x (n, k) -> (n, p.rows), into `out` when given."""
    cp = b.xp
    n = x.shape[0]
    if not p.native:
        r = run_generic(cp, p, x)
        if out is None:
            return r
        out[...] = r
        return out
    if p.type_id in mm.FLOAT_TYPES:
        return mm.mmvq(p.type_id, p.blocks, p.rows, p.k, x, out=out)  # (float: no split)
    if b.win.prompt_rows and b.win.takes_rows(x) and p.rows * p.k >= b.prompt_gemm_min_weight:
        return run_prompt_rows(b, p, x, q8, out)
    if not 0 < n <= mm.MAX_COLS:
        # several launches: the wrapper splits the columns
        return mm.mmvq(p.type_id, p.blocks, p.rows, p.k, q8 if q8 is not None else x, out=out, split=b.split_columns)
    cached = p.launches.get(n)
    if cached is None:
        # the launch mmvq.mmvq makes for n columns, with everything but the activations and the
        # output worked out once
        row_bytes = type_by_id(p.type_id).row_bytes(p.k)
        (ln,) = mm.column_launches(p.type_id, p.rows, n, b.split_columns, mm.rows_aligned(p.blocks, row_bytes), p.k)
        cached = (mmvq_build.function(p.type_id, ln.name), ln,
                  (p.blocks, np.int32(p.rows), np.int32(row_bytes), np.int32(p.k), np.int32(ln.rpw)))
        p.launches[n] = cached
    fn, ln, lead = cached
    if out is None:
        out = cp.empty((n, p.rows), dtype=cp.float32)
    launch(fn, ln.grid, ln.block, lead + (q8.q, q8.meta, out), shared_mem=ln.smem)  # PDL while captured
    return out


def run_prompt_rows(b: Any, p: Part, x: Any, q8: Any, out: Any) -> Any:
    """A window with long-prompt rows: those rows through dequant + GEMM in fixed row tiles,
    the others (decode rows, short prompts) through MMVQ as in any window."""
    prefill = b.prefill_path()
    if not prefill.capturable:  # the runner then keeps it eager
        b.capture.block("prompt GEMM (cuBLAS)")
    n = x.shape[0]
    res = out if out is not None and out.flags.c_contiguous else b.xp.empty((n, p.rows), dtype=b.xp.float32)
    for a, c, prompt in row_ranges(n, b.win.prompt_rows):
        if prompt:
            prefill.linear(p.type_id, p.blocks, p.rows, p.k, x[a:c], out=res[a:c], tile_m=b.prompt_gemm_rows)
        else:  # other rows: MMVQ on their Q8_1 blocks
            mm.mmvq(p.type_id, p.blocks, p.rows, p.k, q8.rows(a, c), out=res[a:c], split=b.split_columns)
    if res is not out and out is not None:
        out[...] = res
        return out
    return res
