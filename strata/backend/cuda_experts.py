"""MoE experts on the CUDA backend: one pass per (token, expert) pair, or grouped by expert.

Decode windows (a few tokens, captured in graphs) run one weight pass per pair (mmvq_experts,
gate and up in one launch). From GROUPED_PAIRS_PER_EXPERT pairs per expert on average (prefill
windows) the pairs are grouped by expert: one weight pass per tile of up to 8 pairs of one expert
(mmvq_grouped, the decode kernel's bits). Long prompts' rows always take mmq_grouped (int8 tensor
cores, tiles of 32 pairs; other bits, so chosen per request, never per window). Every kernel
reaches the experts through the store's address table (expert_store.py).
"""

from __future__ import annotations

from typing import Any

from strata.backend.cuda_graphs import MAX_GRAPH_TOKENS
from strata.backend.cuda_linear import q8_for
from strata.backend.cuda_window import row_ranges
from strata.backend.expert_store import CudaExperts
from strata.kernels.cuda import experts as ex
from strata.kernels.cuda.mmvq import FLOAT_TYPES

GROUPED_PAIRS_PER_EXPERT = 2


def _quantized(w: CudaExperts) -> bool:
    return w.native and w.type_id not in FLOAT_TYPES


def linear_experts(b: Any, w: CudaExperts, x: Any, expert_ids: Any) -> Any:
    cp = b.xp
    q8 = b.win.q8_of(x)
    ids = cp.asarray(expert_ids, dtype=cp.int32)
    n, k = ids.shape
    if grouped(b, ids, w):
        return experts_grouped(b, w, x, ids)
    if x.ndim == 3:  # one input row per (token, expert): flatten to n*k columns of 1 expert
        flat_x = cp.ascontiguousarray(x.reshape(n * k, -1), dtype=cp.float32)
        if q8 is not None:
            b.win.keep_q8(flat_x, q8)
        return linear_experts(b, w, flat_x, ids.reshape(n * k, 1)).reshape(n, k, -1)
    if _quantized(w):
        x, q8 = q8_for(b, x)
        return ex.mmvq_experts(w.type_id, w.matrices, ids, x, q8=q8)
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    if w.native:
        return ex.mmvq_experts(w.type_id, w.matrices, ids, x)
    sel = w.blocks[ids].astype(cp.float32)  # (n, k, rows, in)
    return cp.einsum("nkri,ni->nkr", sel, x)


def linear_experts_pair(b: Any, w1: CudaExperts, w2: CudaExperts, x: Any, expert_ids: Any) -> tuple[Any, Any] | None:
    """Gate and up over the same x in one launch (or grouped); None: a layout this does not take."""
    if not (b.fused and _quantized(w1) and _quantized(w2) and x.ndim == 2 and w1.n_expert == w2.n_expert):
        return None
    ids = b.xp.asarray(expert_ids, dtype=b.xp.int32)
    if grouped(b, ids, w1, w2):
        return experts_grouped(b, w1, x, ids), experts_grouped(b, w2, x, ids)
    _, q8 = q8_for(b, x)
    return ex.mmvq_experts_pair(w1.type_id, w1.matrices, w2.type_id, w2.matrices, ids, q8)


def _prompt_rows(b: Any, ids: Any) -> list[tuple[int, int]]:
    """The long prompts' row ranges of an experts call over the window's rows ([] when their
    experts keep MMVQ, or the call is not over the window's rows)."""
    return b.win.prompt_rows if b.prompt_experts and b.win.takes_rows(ids) else []


def grouped(b: Any, ids: Any, *ws: CudaExperts) -> bool:
    """Whether these experts run grouped by expert: quantized native weights and many pairs,
    or a window with long prompts' rows, whose pairs always take mmq_grouped (their bits must
    not depend on the window's size). Not in a decode window's graph (one pass per pair there,
    the same bits). A wide window's graph holds it (the plan is one kernel that reads the
    window's ids), unless the plan takes CuPy's sort (thousands of experts)."""
    n_expert = ws[0].n_expert
    if not (b.grouped and ids.ndim == 2 and all(_quantized(w) and w.n_expert == n_expert for w in ws)):
        return False
    prompt = bool(_prompt_rows(b, ids))
    if not (prompt or ids.size >= GROUPED_PAIRS_PER_EXPERT * n_expert):
        return False
    if b.capture.active:
        if b.win.n <= MAX_GRAPH_TOKENS and not prompt:
            return False
        if not ex.plan_in_one_launch(int(ids.size), n_expert):
            b.capture.block("grouped experts (plan by CuPy's sort)")
    return True


def experts_grouped(b: Any, w: CudaExperts, x: Any, ids: Any) -> Any:
    """x (n, in) shared by a token's experts or (n, k, in) one row per pair -> (n, k, out).
    Long prompts' rows through mmq_grouped (tensor cores), the others through mmvq_grouped,
    each range of rows on a plan of its own."""
    cp = b.xp
    n, k = ids.shape
    n_expert = w.n_expert
    plans = b.win.plans(ids)  # gate, up and down share the plans
    q8 = b.win.q8_of(x)
    per_pair = x.ndim == 3
    if q8 is None:
        _, q8 = q8_for(b, x.reshape(n * k, -1) if per_pair else x)
    ranges = row_ranges(n, _prompt_rows(b, ids))
    out = None if len(ranges) == 1 else cp.empty((n * k, w.rows), dtype=cp.float32)
    for a, c, prompt in ranges:
        # a type or length mmq_grouped does not take keeps mmvq_grouped (a fixed choice per matrix)
        mmq = prompt and ex.mmq_supports(w.type_id, q8.k)
        cols = ex.MMQ_COLS if mmq else ex.GROUP_COLS
        entry = plans.get((a, c, n_expert, cols))
        if entry is None:
            plan = ex.expert_plan(ids if len(ranges) == 1 else ids[a:c], n_expert, cols=cols)
            entry = plans[(a, c, n_expert, cols)] = (plan, {})
        plan, slices = entry
        part = q8
        if len(ranges) > 1:  # this range's activation rows (views), the same object for gate and up
            per = k if per_pair else 1
            cached = slices.get(per_pair)
            if cached is None or cached[0] is not q8:
                cached = slices[per_pair] = (q8, q8.rows(a * per, c * per))
            part = cached[1]
        run = ex.mmq_experts_grouped if mmq else ex.mmvq_experts_grouped
        b.expert_kernels[run.__name__] += 1
        y = run(w.type_id, w.matrices, plan, part, per_pair=per_pair)
        if out is None:
            return y.reshape(n, k, -1)
        out[a * k : c * k] = y
    return out.reshape(n, k, -1)
