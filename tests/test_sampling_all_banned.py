"""A row where every token is banned (a request's bias and its grammar left none) is weighed
without NaN: the sampler gives the row's argmax, which the caller's grammar or bans then refuse."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from strata.protocol import SamplingParams
from strata.sampling.filters import distribution, make_rng, sample


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=1),
                                    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=2)])
def test_a_row_with_every_token_banned_gives_one_token_and_no_nan(params):
    row = np.full(64, -np.inf, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # -inf - -inf would warn and give NaN
        p = distribution(row, params)
        tok = sample(row, params, make_rng(params))
    assert not np.isnan(p).any() and p.sum() == 1.0 and np.count_nonzero(p) == 1
    assert tok == int(np.argmax(p)) == int(np.argmax(row))


def test_a_row_with_one_token_left_samples_only_that_token():
    row = np.full(64, -np.inf, dtype=np.float32)
    row[17] = -3.0
    params = SamplingParams(temperature=1.0, seed=3)
    p = distribution(row, params)
    assert p[17] == 1.0 and p.sum() == 1.0
    assert sample(row, params, make_rng(params)) == 17
