"""Sampling on the device (strata/kernels/cuda/sample.cu) against strata.sampling on the host.

The kernel gets the uniform the host sampler would draw; for every filter combination
(temperature, top-k, top-p, min-p, together and alone) on fresh random logits, including rows
full of tied values so top-k and top-p cut inside a tie, it must return the host's token
(they can differ only where u, top_p or min_p falls within ~1e-15 of a cumulative boundary,
which random draws do not hit). Greedy rows give the first argmax. End to end, a seeded
sampled generation on the GPU gives the same tokens with device sampling as with the rows
sampled on the host. Skips cleanly without CuPy or a device.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support.gpu import require_cuda, require_synth_tokenizer, synth_for_gpu

cp = require_cuda()

from strata.protocol import SamplingParams  # noqa: E402
from strata.kernels.cuda import sample  # noqa: E402
from strata.sampling.filters import distribution, sample_from, sampler_row  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")

FILTERS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=40),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.6, min_p=0.05),
    dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.02),
    dict(temperature=2.5, top_p=0.5),
    dict(temperature=0.9, top_p=1e-6),  # keeps one token
    dict(temperature=1.0, top_k=100000),  # larger than the vocabulary: off
    dict(temperature=0.0),  # greedy
    dict(temperature=0.7, top_k=1),  # greedy
]


def _logits(rng, n, V, ties: bool):
    x = rng.standard_normal((n, V)).astype(np.float32) * 3
    if ties:  # coarse values: many exact ties, so top-k / top-p cut inside a run of equals
        x = np.round(x * 2) / 2
    return x


@pytest.mark.parametrize("V", [49152, 1003])
@pytest.mark.parametrize("ties", [False, True])
def test_device_token_equals_host_token(V, ties):
    rng = np.random.default_rng([SEED, V, ties])
    cases = [(f, s) for f in FILTERS for s in range(12)]
    logits = _logits(rng, len(cases), V, ties)
    rows, want = [], []
    for (f, s), row in zip(cases, logits):
        p = SamplingParams(**f)
        host_rng, dev_rng = np.random.default_rng([SEED, s]), np.random.default_rng([SEED, s])
        want.append(sample_from(distribution(row, p), host_rng) if p.temperature > 0 and p.top_k != 1
                    else int(np.argmax(row)))
        rows.append(sampler_row(p, dev_rng.random()))
    dev = cp.asarray(logits)
    got = cp.asnumpy(sample.sample_rows(dev, np.asarray(rows)))
    bad = [(cases[i][0], int(got[i]), want[i]) for i in range(len(cases)) if int(got[i]) != want[i]]
    assert not bad, f"seed {SEED}: {bad[:5]}"


def test_many_uniforms_follow_the_distribution():
    """One row, 4000 uniforms on a grid: the device's tokens are the host's inverse CDF."""
    rng = np.random.default_rng([SEED, 99])
    row = (rng.standard_normal(5000) * 2).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_p=0.8, min_p=0.01)
    dist = distribution(row, p)
    us = (np.arange(4000) + 0.5) / 4000
    rows = np.asarray([sampler_row(p, u) for u in us])
    got = cp.asnumpy(sample.sample_rows(cp.asarray(np.tile(row, (len(us), 1))), rows))
    cdf = np.cumsum(dist)
    want = np.minimum(np.searchsorted(cdf, us * cdf[-1], side="right"), row.size - 1)
    assert np.array_equal(got, want)


def test_seeded_generation_same_with_device_sampling(tmp_path):
    from tests.support.engines import load_engine, run_all

    require_synth_tokenizer()
    path = synth_for_gpu(tmp_path, "llama")
    core, _ = load_engine(["--pack", str(path), "--device", "cuda", "--parallel", "3"])
    prompts = [[5, 9, 200, 31], [7, 7, 7], [100, 3, 44, 81, 2]]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=60, seed=1234, ignore_eos=True)
    on_device = [r[0] for r in run_all(core, prompts, params, threaded=False)]
    core.model.b.samples_on_device = False  # the rows go to the host instead
    on_host = [r[0] for r in run_all(core, prompts, params, threaded=False)]
    assert on_device == on_host
    assert all(len(t) == 24 for t in on_device)


@pytest.mark.parametrize("V", [49152, 1003, 7])
@pytest.mark.parametrize("n", [1, 2, 17])
def test_top_rows_first_argmax_and_top_probability(V, n):
    """top_rows: numpy's argmax (the first of tied maxima) and 1 / sum(exp(z - max)) in float64
    to float32 rounding, on rows with ties, -inf entries and a repeated maximum."""
    rng = np.random.default_rng([SEED, V, n, 7])
    x = _logits(rng, n, V, ties=True)
    x[0, rng.integers(0, V, size=max(1, V // 50))] = -np.inf
    if V > 3:
        x[n - 1, [V - 1, V // 2, 1]] = x[n - 1].max() + 1.0  # three equal maxima: the first (1) wins
    d = cp.asarray(x)
    ids, top = sample.top_rows(d)
    got_ids, got_top = cp.asnumpy(ids), cp.asnumpy(top)
    x64 = x.astype(np.float64)
    want_top = 1.0 / np.exp(x64 - x64.max(axis=1, keepdims=True)).sum(axis=1)
    np.testing.assert_array_equal(got_ids, np.argmax(x, axis=1))
    np.testing.assert_allclose(got_top, want_top, rtol=2e-5)
    if V > 3:
        assert got_ids[n - 1] == 1


def test_backend_argmax_and_top_rows_use_the_kernel():
    from strata.backend.cuda import CudaBackend

    b = CudaBackend(fused=True)
    rng = np.random.default_rng([SEED, 11])
    x = cp.asarray(rng.standard_normal((3, 5000)).astype(np.float32))
    np.testing.assert_array_equal(cp.asnumpy(b.argmax_rows(x)), np.argmax(cp.asnumpy(x), axis=1))
    ids, top = b.top_rows(x)
    h = cp.asnumpy(x).astype(np.float64)
    np.testing.assert_allclose(cp.asnumpy(top), 1.0 / np.exp(h - h.max(axis=1, keepdims=True)).sum(axis=1), rtol=2e-5)
    assert ids.dtype == cp.int64 and top.dtype == cp.float32
