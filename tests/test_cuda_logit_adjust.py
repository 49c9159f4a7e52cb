"""Logit adjustments on the GPU: the same arrays as numpy's, rows adjusted where they are (no
copy of the vocabulary), device sampling over banned (-inf) tokens, and prompt reuse on the
device giving the tokens a prefill gives. Skips cleanly without CuPy or a device."""

from __future__ import annotations

import numpy as np

from tests.support.gpu import require_cuda, synth_for_gpu

cp = require_cuda()

from strata.protocol import SamplingParams  # noqa: E402
from strata.sampling.logit_adjust import apply_rows, row_adjust  # noqa: E402


def test_device_rows_equal_host_rows():
    rng = np.random.default_rng(7)
    V = 49152
    logits = rng.normal(0, 4, (3, V)).astype(np.float32)
    words = rng.integers(0, 2**32, (V + 31) // 32, dtype=np.uint64).astype(np.uint32)
    params = [SamplingParams(logit_bias={3: 1.5, 40000: float("-inf")}, min_tokens=2),
              SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2, repeat_last_n=-1),
              SamplingParams()]
    hist = [rng.integers(0, 500, 40).tolist() for _ in params]
    adj = [row_adjust(p, h, 0, [0, 2], words if i == 2 else None) for i, (p, h) in enumerate(zip(params, hist))]
    host = logits.copy()
    apply_rows(np, host, adj)
    dev = cp.asarray(logits)
    apply_rows(cp, dev, adj)
    np.testing.assert_array_equal(cp.asnumpy(dev), host)


def test_engine_on_gpu_bans_forces_and_reuses(tmp_path):
    from tests.support.engines import load_engine, run_all

    path = synth_for_gpu(tmp_path, "llama")
    core, _ = load_engine(["--pack", str(path), "--device", "cuda", "--parallel", "2"])
    prompt = list(range(10, 200))
    plain = run_all(core, [prompt], SamplingParams(max_tokens=6, temperature=0.0), threaded=False)[0][0]
    banned = {t: float("-inf") for t in plain}
    for params in (SamplingParams(max_tokens=6, temperature=0.0, logit_bias=banned),
                   SamplingParams(max_tokens=6, temperature=0.9, seed=3, logit_bias=banned)):  # device sampler
        ids = run_all(core, [prompt], params, threaded=False)[0][0]
        assert len(ids) == 6 and not set(ids) & set(plain)
    forced = run_all(core, [prompt], SamplingParams(max_tokens=3, temperature=0.7, seed=1, logit_bias={77: 100.0}),
                     threaded=False)[0][0]
    assert forced == [77, 77, 77]
    # the prompt's blocks came from the device prefix cache; the tokens equal a fresh engine's
    again = run_all(core, [prompt + [5, 6]], SamplingParams(max_tokens=6, temperature=0.0), threaded=False)[0]
    fresh, _ = load_engine(["--pack", str(path), "--device", "cuda", "--prefix-cache", "0"])
    want = run_all(fresh, [prompt + [5, 6]], SamplingParams(max_tokens=6, temperature=0.0), threaded=False)[0][0]
    assert again[2].cached_tokens == 128 and again[0] == want
