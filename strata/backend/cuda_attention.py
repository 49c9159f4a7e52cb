"""Attention over the KV caches on the CUDA backend (fused path), rows routed by kind.

RoPE and the cache write are one kernel (fused.rope_kv_write); attention_kv then reads every
span's cache through the window table, a span's keys split over `splits` blocks (cuda_window.
splits_for). Windows of at least gqa_min_tokens tokens take one block per KV group's query heads
(K/V loaded once for the group, the same bits as one block per head) where a block takes at
least gqa_min_heads heads (8 measured faster, 3 slower: the 8-head kernel's registers leave one
block per SM). Long prompts' rows attend through attention_prefill (f16 tensor cores) where
their head size has a kernel: the same per-request rule as their projections' GEMM path.
"""

from __future__ import annotations

from typing import Any, Sequence

from strata.backend.base import RopeParams
from strata.backend.cuda_window import head_spans, splits_for, window_table
from strata.kernels.cuda import attention_prefill as fa
from strata.kernels.cuda import fused as fk
from strata.kernels.cuda import mmvq as mm

GQA_MIN_TOKENS = 16
GQA_MIN_HEADS = 8
ATT_COUNTERS = 1 << 16  # tokens x heads a window may have for attention_kv to merge its own splits


def gqa(b: Any, n: int, heads: int, n_kv: int) -> bool:
    return n >= b.gqa_min_tokens and fk.heads_per_block(heads, n_kv) >= b.gqa_min_heads


def attend(b: Any, layer: int, q: Any, k: Any, v: Any, spans: Sequence[Any], rope: RopeParams,
           q_norm: Any, k_norm: Any, eps: float) -> Any:
    """The window's attention on the fused path (b.win.table set, rope not frozen)."""
    win = b.win
    int8 = spans[0].cache.kind == "int8"
    qr = fk.rope_kv_write(q, k, v, win.table, layer, int8, base=rope.base, dim=rope.dim, scale=rope.scale,
                          neox=rope.neox, q_norm=q_norm, k_norm=k_norm, eps=eps)
    n, heads, d = (int(x) for x in q.shape)
    n_kv = int(k.shape[1])
    q8 = mm.empty_q8(n, heads * d) if d % mm.QK == 0 else None
    prompts = win.prompt_spans if b.prompt_attention and fa.supported(d) else []
    if not prompts:
        out = fk.attention_kv(qr, win.table, layer, n_kv, int8, win.splits, q8, b.att_counters,
                              gqa=gqa(b, n, heads, n_kv))
    else:
        out = _attend_with_prompts(b, layer, qr, spans, prompts, n_kv, int8, q8)
    win.keep_q8(out, q8)  # the output projection reads them
    return out


def _attend_with_prompts(b: Any, layer: int, qr: Any, spans: Sequence[Any], prompts: list, n_kv: int,
                         int8: bool, q8: Any) -> Any:
    """Long prompts' rows through attention_prefill, the others through attention_kv. The
    scheduler puts prefill rows after decode rows, so the prompts usually end the window:
    attention_kv then takes only the rows before them (a table of their own spans); otherwise
    it takes every row and the prompts' rows are overwritten."""
    cp, win = b.xp, b.win
    n, heads, d = (int(x) for x in qr.shape)
    out = cp.empty((n, heads * d), dtype=cp.float32)
    first = prompts[0][0]
    tail = all(a == c for (_, a, _, _), (c, _, _, _) in zip(prompts, prompts[1:])) and prompts[-1][1] == n
    if not tail:
        fk.attention_kv(qr, win.table, layer, n_kv, int8, win.splits, q8, b.att_counters,
                        gqa=gqa(b, n, heads, n_kv), out=out)
    elif first:
        b.capture.block("decode rows before a prompt's")  # their table is uploaded from the host
        if win.head_attention is None:  # the same for every layer of the window
            head = head_spans(spans, first)
            win.head_attention = (cp.asarray(window_table(head)), splits_for(head, fk.ATT_CHUNK))
        table, splits = win.head_attention
        part = q8.rows(0, first) if q8 is not None else None
        fk.attention_kv(qr[:first], table, layer, n_kv, int8, splits, part, b.att_counters,
                        gqa=gqa(b, first, heads, n_kv), out=out[:first])
    for a, c, sp, i in prompts:  # start and cache from the window table (graph replays)
        fa.attention_prefill_window(qr[a:c], win.table, n, i, layer, sp.cache, int(sp.start), out[a:c])
        if q8 is not None:
            mm.quantize_q8_1(out[a:c], q8.rows(a, c))
    return out
