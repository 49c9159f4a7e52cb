"""Turning logits into tokens.

`distribution()` gives the exact probability vector a request samples from (temperature,
then the filters of LOGIT_FILTERS and PROB_FILTERS: top-k, top-p and min-p, renormalised).
Speculative verification needs that vector itself, not just a sample, so sampling and
rejection sampling share it. A new filter is a row of one of the two tables (and its knob in
strata/protocol.py's SamplingParams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata.protocol import SamplingParams


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature <= 0.0 or params.top_k == 1


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - float(np.max(logits))
    return z - np.log(np.sum(np.exp(z)))


def _one_hot(logits: np.ndarray) -> np.ndarray:
    p = np.zeros_like(logits)
    p[int(np.argmax(logits))] = 1.0
    return p


def _top_k(z: np.ndarray, params: SamplingParams) -> np.ndarray:
    if params.top_k >= z.size:
        return z
    kth = np.partition(z, -params.top_k)[-params.top_k]
    return np.where(z >= kth, z, -np.inf)


def _top_p(p: np.ndarray, params: SamplingParams) -> np.ndarray:
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order])
    # keep the smallest prefix whose mass reaches top_p (always at least one token)
    cut = int(np.searchsorted(cum, params.top_p, side="left")) + 1
    mask = np.zeros(p.shape, dtype=bool)
    mask[order[:cut]] = True
    return np.where(mask, p, 0.0)


def _min_p(p: np.ndarray, params: SamplingParams) -> np.ndarray:
    return np.where(p >= params.min_p * p.max(), p, 0.0)


@dataclass(frozen=True)
class Filter:
    """One filter of the chain: its llama-server name (GET /props lists the chain), whether a
    request uses it, what it does, and whether the device sampler (strata.kernels.cuda.sample,
    fed by sampler_row) has it too; a request using one the device lacks is sampled on the host."""

    name: str
    used: Callable[[SamplingParams], bool]
    apply: Callable[[np.ndarray, SamplingParams], np.ndarray]
    on_device: bool = False


# after temperature, on the scaled logits (a dropped token's is -inf)
LOGIT_FILTERS: tuple[Filter, ...] = (
    Filter("top_k", lambda params: params.top_k > 0, _top_k, on_device=True),
)
# then on the probabilities (a dropped token's is 0), renormalised at the end
PROB_FILTERS: tuple[Filter, ...] = (
    Filter("top_p", lambda params: params.top_p < 1.0, _top_p, on_device=True),
    Filter("min_p", lambda params: params.min_p > 0.0, _min_p, on_device=True),
)
# the order the filters run in, temperature first, under llama-server's names
CHAIN = ("temperature", *(f.name for f in LOGIT_FILTERS + PROB_FILTERS))


def device_can_sample(params: SamplingParams) -> bool:
    """Whether every filter the request uses is one the device sampler has."""
    return all(f.on_device or not f.used(params) for f in LOGIT_FILTERS + PROB_FILTERS)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities (float64, sums to 1) that `params` samples from; one-hot when greedy."""
    logits = np.asarray(logits, dtype=np.float64)
    if is_greedy(params):
        return _one_hot(logits)
    z = logits / params.temperature
    if not np.max(z) > -np.inf:
        # every token banned (the request's bias and its grammar left none): nothing to weigh,
        # so the argmax a greedy row takes; the caller's grammar or bans refuse it and end the
        # request with why (exp(z - max z) would be -inf - -inf: NaN)
        return _one_hot(logits)
    for f in LOGIT_FILTERS:
        if f.used(params):
            z = f.apply(z, params)
    p = np.exp(z - np.max(z))
    p /= p.sum()
    for f in PROB_FILTERS:
        if f.used(params):
            p = f.apply(p, params)
    return p / p.sum()


def sample_from(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probability vector p (inverse CDF: one uniform per draw, reproducible)."""
    cdf = np.cumsum(p)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), p.size - 1))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if is_greedy(params):
        return int(np.argmax(logits))
    return sample_from(distribution(logits, params), rng)


def sampler_row(params: SamplingParams, u: float) -> tuple[float, float, float, float, float]:
    """A request's filters and the uniform its rng drew, as a backend that samples on the
    device takes them (Backend.sample_rows): temperature, top_k, top_p, min_p, u; greedy rows
    have temperature 0 (argmax)."""
    if is_greedy(params):
        return (0.0, 0.0, 1.0, 0.0, 0.0)
    return (float(params.temperature), float(params.top_k or 0), float(params.top_p), float(params.min_p), float(u))


def make_rng(params: SamplingParams) -> np.random.Generator:
    return np.random.default_rng(params.seed)
