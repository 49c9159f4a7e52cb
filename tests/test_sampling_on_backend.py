"""The scheduler's device-sampling path, on the CPU: a backend that says it samples gets one
uniform per sampled row, drawn from the slot's rng exactly when the host sampler would draw it,
so a seeded request gives the same tokens either way. The stand-in backend draws with the host
sampler's own distribution and inverse CDF from that uniform (what strata/kernels/cuda/sample.cu
computes on the GPU, checked against the host in tests/test_cuda_sample.py). Rows that need
whole distributions (logprobs) still come to the host."""

from __future__ import annotations

import types

import numpy as np

from strata.protocol import SamplingParams
from strata.sampling.filters import distribution
from tests.support.engines import request, run_all
from tests.support.model_fixtures import engine


def sample_rows_like_the_device(self, logits, params):
    out = []
    for row, (temp, top_k, top_p, min_p, u) in zip(np.asarray(logits), params):
        if temp <= 0.0:
            out.append(int(np.argmax(row)))
            continue
        p = distribution(row, SamplingParams(temperature=temp, top_k=int(top_k), top_p=top_p, min_p=min_p))
        cdf = np.cumsum(p)
        out.append(int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), p.size - 1)))
    self.rows_sampled += len(out)
    return np.asarray(out, dtype=np.int64)


def test_seeded_sampling_same_through_the_backend_sampler(monkeypatch):
    core = engine(None, 4)  # the shared test model (its backend's stand-in sampler is undone after the test)
    prompts = [[1, 9690, 198, 2683], [1, 4093, 198, 1780, 314], [1, 520, 9531]]
    mixed = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=1.2, min_p=0.05, seed=5, ignore_eos=True)]

    def run():
        handles = [core.submit(request(p, sp)) for p, sp in zip(prompts, mixed)]
        core.scheduler.run_until_idle()
        return [h.collect()[0] for h in handles]

    on_host = run()
    b = core.model.b
    monkeypatch.setattr(b, "samples_on_device", True)
    monkeypatch.setattr(b, "rows_sampled", 0, raising=False)
    monkeypatch.setattr(b, "sample_rows", types.MethodType(sample_rows_like_the_device, b))
    through_backend = run()
    assert through_backend == on_host
    assert b.rows_sampled >= 3 * 12  # every token of the three requests went through it
    # logprobs need whole rows: the backend sampler is not asked
    b.rows_sampled = 0
    run_all(core, prompts[:1], SamplingParams(max_tokens=4, temperature=0.8, seed=3, logprobs=True), threaded=False)
    assert b.rows_sampled == 0
