"""How a policy ranks the units of a pool: a key per unit, the smallest evicted first.

A unit is one layer's expert (all of its tensors move together). Each window, the units a layer
needs are `use`d with how many of the window's tokens routed to each; the policy returns their new
counts and keys, as arrays, and keeps no state of its own (the cache holds the arrays).

- `LRU`: the key is the window of the last use: the unit used longest ago goes.
- `FrequencyLRU` (frequency-weighted LRU, the CRF of LRFU: Lee et al., "LRFU: a spectrum of
  policies that subsumes the least recently used and least frequently used policies", IEEE
  Trans. Computers 50(12), 2001): each unit keeps a decayed use count
      C(t) = sum over its uses i of w_i * 2^(-(t - t_i) / h)
  (w_i the tokens routed to it in window t_i, h the half-life in windows), and the unit with the
  smallest C(now) goes. log2 C(now) = log2 C(t_last) + t_last / h - now / h, so the key
  log2 C(t_last) + t_last / h, which changes only when the unit is used, ranks units by C(now)
  at any now. h -> 0 is LRU, h -> infinity is LFU. Counts are kept for units out of the pool
  too, so an expert that comes back is known.

`seed(rates)`: the counts and keys of units from a profile (expected tokens per window), before
any window: FrequencyLRU's steady count of that rate, LRU's order by rate below every real use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LRU:
    name = "lru"

    def use(self, count: np.ndarray, last: np.ndarray, tokens: np.ndarray, now: int):
        """-> (count, last, key) of units used at window `now` by `tokens` tokens each."""
        return count + tokens, np.full(len(tokens), float(now)), np.full(len(tokens), float(now))

    def seed(self, rates: np.ndarray):
        """-> (count, last, key): keys in (-1, 0], in the order of the rates."""
        top = float(rates.max()) if rates.size else 0.0
        return rates.astype(np.float64), np.zeros(len(rates)), rates / (top + 1.0) - 1.0 if top > 0 else rates - 1.0


# windows: on the bench's traces (bench/expert_cache_policy.py, a quarter of the experts cached), at
# one token per window 32 is within 0.2 points of the best half-life on the trace with temporal
# locality and 3-7 points over LRU on the skewed ones; 64 and longer lose 6-13 points on the
# temporal trace. At four tokens per window (--batch 4) the same 32 windows lose 16 points to LRU on
# the temporal trace while gaining 9-11 on the skewed ones; 8 windows (the same 32 tokens) lose 4 and
# gain 5-7: the half-life is counted in windows, so batched decode remembers longer
DEFAULT_HALF_LIFE = 32.0


@dataclass(frozen=True)
class FrequencyLRU:
    half_life: float = DEFAULT_HALF_LIFE
    name = "frequency"

    def __post_init__(self) -> None:
        if not self.half_life > 0:
            raise ValueError(f"half_life must be > 0, not {self.half_life!r}")

    def use(self, count: np.ndarray, last: np.ndarray, tokens: np.ndarray, now: int):
        h = self.half_life
        c = count * np.exp2(-(now - last) / h) + tokens
        return c, np.full(len(tokens), float(now)), np.log2(c) + now / h

    def seed(self, rates: np.ndarray):
        """A unit used at rate r per window settles at C = r / (1 - 2^(-1/h)); its key at window 0."""
        c = rates.astype(np.float64) / (1.0 - 2.0 ** (-1.0 / self.half_life))
        with np.errstate(divide="ignore"):
            return c, np.zeros(len(rates)), np.log2(c)


# --expert-policy name -> the policy's class
POLICIES = {"lru": LRU, "frequency": FrequencyLRU}
