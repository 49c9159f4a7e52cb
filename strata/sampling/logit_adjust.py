"""Per-request changes to the logits before a row is sampled or verified.

A request's `logit_bias`, llama-server's penalties, `min_tokens` and a grammar's mask change the
distribution a row samples from. They are applied to the logits rows where they are (on the
device for GPU slots: a few gathers, scatters and one mask pass, never a copy of the
vocabulary to the host), before the argmax, the device sampler or the copy of whole rows, so
the speculative verifier sees the adjusted distribution as the distribution itself and stays
lossless.

The order is llama.cpp's sampler chain: the grammar, then logit_bias, then the penalties
(repetition, frequency, presence over the last repeat_last_n tokens); temperature, top-k,
top-p and min-p come after (strata.sampling).

`RowAdjust` is one row's set; `apply_rows` applies a window's rows in a handful of array
operations, the same code for numpy and CuPy.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from strata.protocol import SamplingParams

BANNED = float("-inf")


@dataclass
class RowAdjust:
    """What changes in one logits row: additive biases (token -> value, -inf bans), the
    penalised tokens with their counts in the penalty window, and the grammar's allowed-token
    bitmask (uint32 words; None: no grammar)."""

    bias: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    mask: np.ndarray | None = None

    @property
    def empty(self) -> bool:
        return not self.bias and not self.counts and self.mask is None


def has_adjustments(params: SamplingParams) -> bool:
    """Whether the request changes its logits at all (its rows then go through apply_rows)."""
    return bool(params.logit_bias) or penalised(params) or params.min_tokens > 0 or params.constraint is not None


def penalised(params: SamplingParams) -> bool:
    return params.repeat_last_n != 0 and (
        params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0)


def penalty_tail(params: SamplingParams, history: list[int]) -> list[int]:
    """The end of the sequence the penalties can read (nothing when they are off): a window's
    rows extend this with their drafts instead of copying a long sequence once per row."""
    if not penalised(params):
        return []
    n = params.repeat_last_n
    return history if n < 0 else history[-n:]


def row_adjust(params: SamplingParams, history: Sequence[int], n_generated: int, end_ids: Sequence[int],
               mask: np.ndarray | None = None) -> RowAdjust:
    """One row's adjustments: `history` is the sequence so far (prompt and output, the row's
    drafts included), n_generated how many output tokens come before the row's, end_ids the
    tokens min_tokens holds back (end of generation, stop tokens)."""
    adj = RowAdjust(bias=dict(params.logit_bias), mask=mask)
    if n_generated < params.min_tokens:
        for t in end_ids:
            adj.bias[int(t)] = BANNED
    if penalised(params):
        n = params.repeat_last_n
        window = history if n < 0 else history[-n:]
        adj.counts = dict(collections.Counter(int(t) for t in window))
        adj.repetition, adj.frequency, adj.presence = (
            params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
    return adj


def banned_now(params: SamplingParams, n_generated: int, end_ids: Sequence[int]) -> set[int]:
    """The ids row_adjust sets to -inf in a row after n_generated output tokens: the request's
    `false` biases, and the end ids while min_tokens holds them back."""
    banned = {t for t, b in params.logit_bias.items() if b == BANNED}
    if n_generated < params.min_tokens:
        banned.update(int(t) for t in end_ids)
    return banned


def bans_everything(logit_bias: dict[int, float], vocab: int) -> str | None:
    """Why a request can generate nothing at all: its logit_bias bans every id of the vocabulary
    (a row of -inf has no token to sample, and the sampler's fallback would emit a banned one).
    None when some id remains."""
    if vocab <= 0 or len(logit_bias) < vocab:
        return None
    if sum(1 for t, b in logit_bias.items() if b == BANNED and 0 <= t < vocab) < vocab:
        return None
    return f"logit_bias: bans all {vocab} tokens of the vocabulary; nothing could be generated"


def apply_rows(xp: Any, logits: Any, rows: Sequence[RowAdjust | None]) -> None:
    """Adjust logits (n, V) in place, row i by rows[i] (None: unchanged). Token ids past the
    row's width are ignored (a bias on a token the head does not have changes nothing)."""
    width = logits.shape[-1]
    masked = [(i, a.mask) for i, a in enumerate(rows) if a is not None and a.mask is not None]
    if masked:
        _apply_masks(xp, logits, masked)
    r, t, v = _sparse(rows, width, lambda a: a.bias.items())
    if r.size:
        ri, ti = xp.asarray(r), xp.asarray(t)
        logits[ri, ti] = logits[ri, ti] + xp.asarray(v, dtype=logits.dtype)
    r, t, c = _sparse(rows, width, lambda a: a.counts.items())
    if r.size:
        ri, ti = xp.asarray(r), xp.asarray(t)
        rep, freq, pres = (xp.asarray(np.asarray([getattr(rows[i], f) for i in r], np.float32))
                           for f in ("repetition", "frequency", "presence"))
        x = logits[ri, ti]
        x = xp.where(x > 0, x / rep, x * rep)
        logits[ri, ti] = x - xp.asarray(c, dtype=logits.dtype) * freq - pres


def _sparse(rows: Sequence[RowAdjust | None], width: int, items) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, token, value) triples of every row's entries, tokens inside the width."""
    r, t, v = [], [], []
    for i, a in enumerate(rows):
        if a is None:
            continue
        for tok, val in items(a):
            if 0 <= tok < width:
                r.append(i)
                t.append(tok)
                v.append(val)
    return np.asarray(r, np.int64), np.asarray(t, np.int64), np.asarray(v, np.float32)


def _apply_masks(xp: Any, logits: Any, masked: list[tuple[int, np.ndarray]]) -> None:
    """Tokens a row's grammar does not allow now get -inf: the masks' words go to the device
    (V / 8 bytes a row) and are expanded there."""
    width = logits.shape[-1]
    idx = xp.asarray(np.asarray([i for i, _ in masked], np.int64))
    words = np.stack([m for _, m in masked]).astype(np.uint32)
    need = (width + 31) // 32
    if words.shape[1] < need:  # a head wider than the grammar's vocabulary: the extra tokens are not allowed
        words = np.pad(words, ((0, 0), (0, need - words.shape[1])))
    w = xp.asarray(words[:, :need])
    tok = xp.arange(width, dtype=xp.int64)
    bits = (w[:, tok >> 5] >> (tok & 31).astype(xp.uint32)) & xp.uint32(1)
    sub = logits[idx]
    logits[idx] = xp.where(bits.astype(bool), sub, xp.asarray(BANNED, dtype=logits.dtype))
