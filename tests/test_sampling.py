"""strata.sampling: greedy, temperature, top-k / top-p / min-p supports on hand-made logits,
sample() frequencies against distribution(), and seeded reproducibility through the engine."""

from __future__ import annotations

import numpy as np
import pytest

from strata.protocol import GenerationRequest, SamplingParams
from strata.sampling.filters import distribution, is_greedy, sample
from tests.support.model_fixtures import chat_ids, drain, engine

# probabilities 0.5, 0.3, 0.15, 0.05 (as logits), shuffled so order != index
P4 = np.array([0.15, 0.5, 0.05, 0.3])
L4 = np.log(P4) + 3.0  # a constant shift changes nothing


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kw})


def support(p: np.ndarray) -> set[int]:
    return {int(i) for i in np.nonzero(p > 0)[0]}


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


# ------------------------------------------------------------------ greedy and temperature
@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"temperature": -1.0}, {"temperature": 0.7, "top_k": 1}])
def test_greedy_is_the_argmax_whatever_the_rng(kw):
    logits = np.array([0.1, 2.0, 1.99, -5.0])
    p = params(**kw)
    assert is_greedy(p)
    assert distribution(logits, p).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert {sample(logits, p, np.random.default_rng(s)) for s in range(20)} == {1}


@pytest.mark.parametrize("t", [0.25, 1.0, 3.0])
def test_temperature_divides_the_logits(t):
    logits = np.array([1.0, -0.5, 2.5, 0.0, 2.4])
    p = distribution(logits, params(temperature=t))
    assert np.allclose(p, softmax(logits / t), rtol=1e-12, atol=0)
    assert p.dtype == np.float64 and abs(p.sum() - 1.0) < 1e-12


# ------------------------------------------------------------------ filters: exact supports
@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (3, {0, 1, 3}), (4, {0, 1, 2, 3}), (0, {0, 1, 2, 3}), (9, {0, 1, 2, 3})])
def test_top_k_support(k, expected):
    p = distribution(L4, params(top_k=k))
    assert support(p) == expected
    kept = sorted(expected)
    assert np.allclose(p[kept], P4[kept] / P4[kept].sum(), rtol=1e-12)


@pytest.mark.parametrize("top_p, expected", [(0.45, {1}), (0.75, {1, 3}), (0.9, {0, 1, 3}), (0.99, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p, expected):
    p = distribution(L4, params(top_p=top_p))
    assert support(p) == expected
    kept = sorted(expected)
    assert np.allclose(p[kept], P4[kept] / P4[kept].sum(), rtol=1e-12)


def test_top_p_zero_keeps_the_top_token():
    assert support(distribution(L4, params(top_p=0.0))) == {1}


@pytest.mark.parametrize("min_p, expected", [(0.05, {0, 1, 2, 3}), (0.2, {0, 1, 3}), (0.5, {1, 3}), (0.7, {1})])
def test_min_p_drops_tokens_under_a_fraction_of_the_top(min_p, expected):
    # thresholds: 0.025, 0.1, 0.25, 0.35 of the top probability 0.5
    p = distribution(L4, params(min_p=min_p))
    assert support(p) == expected


def test_filters_compose_and_temperature_applies_first():
    # T = 0.5 squares the probabilities: 0.25, 0.09, 0.0225, 0.0025 (normalised: 0.6840, 0.2462, 0.0616, 0.0068)
    p = distribution(L4, params(temperature=0.5, top_p=0.9))
    assert support(p) == {1, 3}  # 0.684 + 0.246 = 0.930 >= 0.9
    p = distribution(L4, params(temperature=0.5, min_p=0.05))
    assert support(p) == {0, 1, 3}  # 0.0616 >= 0.05 * 0.684 > 0.0068
    p = distribution(L4, params(top_k=3, min_p=0.4))
    assert support(p) == {1, 3}


# ------------------------------------------------------------------ sample() follows distribution()
CHI2_CRIT_P001 = {3: 16.27, 4: 18.47, 5: 20.52}  # chi-square critical values at p = 0.001


@pytest.mark.parametrize("kw", [{"temperature": 0.8}, {"temperature": 1.3, "top_k": 4}, {"top_p": 0.9, "min_p": 0.02}])
def test_sample_frequencies_match_distribution(kw):
    logits = np.array([2.0, 1.2, 0.3, -0.4, 1.9, -3.0])
    sp = params(**kw)
    p = distribution(logits, sp)
    rng = np.random.default_rng(12345)
    n = 20000
    counts = np.bincount([sample(logits, sp, rng) for _ in range(n)], minlength=logits.size)
    assert set(np.nonzero(counts)[0]) <= support(p), "drew a token outside the support"
    kept = sorted(support(p))
    expected = n * p[kept]
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_P001[len(kept) - 1], chi2
    tv = 0.5 * np.abs(counts / n - p).sum()
    assert tv < 0.015, tv


def test_same_rng_state_same_draws():
    logits = np.linspace(-1, 1, 50)
    a = [sample(logits, params(), np.random.default_rng(3)) for _ in range(5)]
    r1, r2 = np.random.default_rng(9), np.random.default_rng(9)
    assert [sample(logits, params(), r1) for _ in range(30)] == [sample(logits, params(), r2) for _ in range(30)]
    assert len(set(a)) == 1  # a fresh generator with one seed gives one first draw


# ------------------------------------------------------------------ seeds through the engine
def test_seed_reproducibility_on_a_real_prompt():
    """T = 1 over the test model: the same seed gives the same tokens (also when the other
    requests in its windows differ); another seed gives another continuation."""
    core = engine(None, 4)
    ids = chat_ids(core, "Write a short poem about the sea.")

    def submit(seed):
        sp = SamplingParams(max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
        return core.submit(GenerationRequest(ids, sp))

    batch = [submit(s) for s in (7, 7, 8)]
    core.scheduler.run_until_idle()
    a, b, c = ([e.token_id for e in drain(h)[0]] for h in batch)
    alone = submit(7)
    core.scheduler.run_until_idle()
    d = [e.token_id for e in drain(alone)[0]]
    assert len(a) == 8
    assert a == b == d
    assert a != c
