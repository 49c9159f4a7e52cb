"""Speculative verification: which drafted tokens the target keeps.

Given the target's distributions p_0..p_k over one window [x, d_1..d_k] (p_j predicts the
token after position j) and the draft's distributions q_1..q_k that d_1..d_k were drawn
from, returns the accepted drafts plus one token from the target. Greedy is the special
case where every distribution is one-hot, so the same code serves both and the output
distribution is exactly the target's (rejection sampling: accept d with probability
min(1, p(d)/q(d)); on rejection draw from normalize(max(0, p - q)); if all are accepted,
draw the extra token from p_k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from strata.sampling.filters import sample_from


@dataclass
class Verdict:
    accepted: int  # number of drafts kept (0..k)
    tokens: list[int]  # the kept drafts followed by the target's own next token


def _after_rejection(p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> int:
    """The target's token where a draft drawn from q was rejected: from normalize(max(0, p - q))."""
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    return sample_from(residual / total, rng) if total > 0 else sample_from(p, rng)


def verify(drafts: Sequence[int], p: Sequence[np.ndarray] | Sequence[int], q: Sequence[np.ndarray],
           rng: np.random.Generator, greedy: bool, rejected: np.ndarray | None = None) -> Verdict:
    """`p`: the target's distributions p_0..p_k; greedy: the target's tokens (each one-hot p_j's
    token, its row's argmax: the caller computes it, or the device sent only that).
    `rejected`: the draft distribution of a sampled draft that came after the given ones and
    was cut before the window (a token the request's grammar does not allow: the target gives it
    probability 0, so it would be rejected for sure). Past the given drafts, the token is then
    drawn as on a rejection, from normalize(max(0, p_k - rejected)), which keeps the output
    distribution exactly p (cutting and then drawing from p_k would not)."""
    k = len(drafts)
    out: list[int] = []
    for j in range(k):
        d = int(drafts[j])
        pj = p[j]
        if greedy:
            y = int(pj)
            if y != d:
                return Verdict(j, out + [y])
            out.append(d)
            continue
        qd = float(q[j][d])
        ratio = 1.0 if qd <= 0.0 else min(1.0, float(pj[d]) / qd)
        if rng.random() < ratio:
            out.append(d)
            continue
        return Verdict(j, out + [_after_rejection(pj, q[j], rng)])
    last = p[k]
    if rejected is not None and not greedy:
        return Verdict(k, out + [_after_rejection(last, rejected, rng)])
    nxt = int(last) if greedy else sample_from(last, rng)
    return Verdict(k, out + [nxt])
