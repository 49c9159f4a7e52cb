"""logit_bias, llama-server's penalties and min_tokens: applied where rows are sampled, checked
against a float64 recomputation, and lossless under speculative decoding (greedy tokens equal
plain decoding's; sampled tokens keep the adjusted distribution)."""

from __future__ import annotations

import numpy as np
import pytest

from strata.batch.scheduler import Scheduler, SchedulerConfig
from strata.protocol import SamplingParams
from strata.sampling.logit_adjust import apply_rows, row_adjust
from strata.model.transformer import Span
from strata.sampling.filters import distribution
from tests.support.engines import collect, load_engine, request, run_all, shared_seed_moe
from tests.support.model_fixtures import chat_ids, engine, logits_of
from tests.support.proposers import SampledProposer
from tests.test_mtp_sampling import chi2_p_value


def reference_adjust(logits, params: SamplingParams, history, n_generated, end_ids):
    """llama.cpp's logit-bias then penalties sampler, one token at a time in float64."""
    z = np.array(logits, dtype=np.float64)
    for t, b in params.logit_bias.items():
        z[t] += b
    if n_generated < params.min_tokens:
        for t in end_ids:
            z[t] = -np.inf
    n = params.repeat_last_n
    window = list(history) if n < 0 else list(history)[-n:] if n > 0 else []
    for t in set(window):
        c = window.count(t)
        z[t] = z[t] * params.repetition_penalty if z[t] <= 0 else z[t] / params.repetition_penalty
        z[t] -= c * params.frequency_penalty + params.presence_penalty
    return z


def test_apply_rows_matches_reference():
    rng = np.random.default_rng(3)
    V = 300
    logits = rng.normal(0, 3, (4, V)).astype(np.float32)
    params = [SamplingParams(logit_bias={5: 2.5, 7: float("-inf"), 299: -1.0}),
              SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.9, repeat_last_n=6),
              SamplingParams(min_tokens=3, repetition_penalty=0.8, repeat_last_n=-1, logit_bias={1: 4.0}),
              SamplingParams()]
    history = [list(rng.integers(0, 20, 12)) for _ in params]
    end_ids = [0, 2]
    got = logits.copy()
    apply_rows(np, got, [row_adjust(p, h, 1, end_ids) for p, h in zip(params, history)])
    for i, (p, h) in enumerate(zip(params, history)):
        want = reference_adjust(logits[i], p, h, 1, end_ids)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)
    # a grammar mask bans every token whose bit is clear, the rest untouched
    words = np.zeros((V + 31) // 32, np.uint32)
    allowed = [0, 31, 32, 200, 299]
    for t in allowed:
        words[t >> 5] |= np.uint32(1 << (t & 31))
    got = logits.copy()
    apply_rows(np, got, [None, row_adjust(SamplingParams(), [], 0, [], words), None, None])
    np.testing.assert_array_equal(got[[0, 2, 3]], logits[[0, 2, 3]])
    assert np.isfinite(got[1]).sum() == len(allowed) and np.all(got[1, allowed] == logits[1, allowed])


@pytest.fixture(scope="module")
def core():
    return engine(None, 4)


def _greedy_reference(core, prompt, params, ids):
    """The adjusted greedy choice after each prefix of `ids`, recomputed: one fresh full forward
    of prompt + ids (row r sees tokens 0..r only, so it is the last row of a forward of that
    prefix), the adjustment in float64. Equal to `ids` exactly when `ids` is the greedy path
    (by induction over the prefixes), as a fresh forward per token would say."""
    seq = list(prompt) + list(ids)
    logits = logits_of(core.model, seq[:-1])
    end_ids = sorted(core.tokenizer.eog_ids)
    out = []
    for i in range(len(ids)):
        history = seq[: len(prompt) + i]
        z = reference_adjust(logits[len(history) - 1], params, history, i, end_ids)
        out.append(int(np.argmax(z)))
    return out


def test_penalties_and_bias_match_stepwise_reference(core):
    prompt = chat_ids(core, "Repeat the word cat ten times.")
    plain = run_all(core, [prompt], SamplingParams(max_tokens=8, temperature=0.0), threaded=False)[0][0]
    params = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                            presence_penalty=0.5, repeat_last_n=32, logit_bias={plain[0]: -3.0})
    ids, _, fin = run_all(core, [prompt], params, threaded=False)[0]
    assert ids != plain  # the adjustments change the greedy path here
    assert ids == _greedy_reference(core, prompt, params, ids)
    assert fin.reason == "length"


def test_logit_bias_bans_and_forces(core):
    prompt = chat_ids(core, "Say hello.")
    plain = run_all(core, [prompt], SamplingParams(max_tokens=6, temperature=0.0), threaded=False)[0][0]
    banned = {t: float("-inf") for t in plain}
    ids = run_all(core, [prompt], SamplingParams(max_tokens=6, temperature=0.0, logit_bias=banned), threaded=False)[0][0]
    assert not set(ids) & set(plain)
    forced = core.tokenizer.encode(" banana")[0]
    ids = run_all(core, [prompt], SamplingParams(max_tokens=4, temperature=0.8, seed=1, logit_bias={forced: 100.0}),
                  threaded=False)[0][0]
    assert ids == [forced] * 4


def test_min_tokens_holds_back_the_end(core):
    prompt = chat_ids(core, "Hi")
    ids, _, fin = run_all(core, [prompt], SamplingParams(max_tokens=64, temperature=0.0), threaded=False)[0]
    assert fin.reason == "stop" and len(ids) < 60  # it ends by itself ...
    want = len(ids) + 4
    ids2, _, fin2 = run_all(core, [prompt], SamplingParams(max_tokens=64, temperature=0.0, min_tokens=want),
                            threaded=False)[0]
    assert len(ids2) >= want and fin2.reason in ("stop", "length")  # ... but not before min_tokens
    assert ids2[: len(ids)] == ids  # until then the path is the same (the end token was the only one held back)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return shared_seed_moe(tmp_path_factory)


ADJUSTED = dict(repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.2, repeat_last_n=16, min_tokens=6)
MOE_BASE = ["--device", "cpu", "--parallel", "2"]


@pytest.fixture(scope="module")
def moe_plain(moe):
    """Plain decoding of both prompts (two slots) with the adjustments, once for both parametrizations."""
    plain, _ = load_engine(["--pack", str(moe), *MOE_BASE])
    prompts = [plain.tokenizer.encode(t) for t in ("Once upon a time", "The capital of")]
    params = SamplingParams(max_tokens=16, temperature=0.0, logit_bias={prompts[0][0]: 2.0}, **ADJUSTED)
    return prompts, params, [ids for ids, _, _ in run_all(plain, prompts, params, threaded=False)]


@pytest.mark.parametrize("batch_mtp", [False, True])
def test_mtp_greedy_with_adjustments_equals_plain(moe, moe_plain, batch_mtp):
    prompts, params, want = moe_plain
    spec, _ = load_engine(["--pack", str(moe), *MOE_BASE, "--mtp", str(moe / "mtp"), "--spec", "3"]
                          + (["--batch-mtp"] if batch_mtp else []))
    outs = run_all(spec, prompts if batch_mtp else prompts[:1], params, threaded=False)
    assert [ids for ids, _, _ in outs] == want[: len(outs)]
    assert sum(s.counters.drafted for s in spec.scheduler.slots) > 0


@pytest.mark.slow  # 12 s on 2 cores: a chi-square over many sampled windows
def test_sampling_with_drafts_keeps_the_adjusted_distribution(moe):
    """As test_mtp_sampling's exact joint of the first two tokens, with logit_bias and
    penalties: the verifier's target is the adjusted distribution."""
    core, _ = load_engine(["--pack", str(moe), "--device", "cpu"])
    prompt = core.tokenizer.encode("Once upon a time", add_special=False)
    base = SamplingParams(max_tokens=2, temperature=1.0, top_k=3)
    probe = core.model.logits(core.model.forward(np.asarray(prompt), [Span(core.model.new_cache(64, "f16"), 0, len(prompt))])[-1:])[0]
    top = [int(t) for t in np.argsort(-np.asarray(probe))[:4]]
    adj = dict(logit_bias={top[0]: -1.5, top[3]: 1.0}, repetition_penalty=2.0, frequency_penalty=0.5, repeat_last_n=-1)
    end_ids = sorted(core.tokenizer.eog_ids)

    def p_next(seq, n_gen):
        c = core.model.new_cache(64, "f16")
        h = core.model.forward(np.asarray(seq), [Span(c, 0, len(seq))])
        z = reference_adjust(np.asarray(core.model.logits(h[-1:])[0]), SamplingParams(**adj), seq, n_gen, end_ids)
        return distribution(z, base)

    p1 = p_next(prompt, 0)
    exact = {}
    for t in np.nonzero(p1)[0]:
        p2 = p_next(prompt + [int(t)], 1)
        for u in np.nonzero(p2)[0]:
            exact[(int(t), int(u))] = p1[t] * p2[u]
    prop = SampledProposer(top[:2] + [7], [0.5, 0.3, 0.2], core.model.n_vocab, seed=5)
    cfg = SchedulerConfig(parallel=1, max_ctx=core.n_ctx, kv_kind="f16", prefill_chunk=256, spec=2)
    sch = Scheduler(core.model, core.tokenizer, cfg, proposer=prop, slot_batch_mtp=[(True, None)], log=lambda s: None)
    keys = sorted(exact)
    counts = np.zeros(len(keys))
    for seed in range(300):
        hd = sch.submit(request(prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=seed, **adj)))
        sch.run_until_idle()
        ids, _, _ = collect(hd)
        counts[keys.index((ids[0], ids[1]))] += 1
    assert sch.slots[0].counters.drafted > 0
    assert chi2_p_value(counts, np.array([exact[k] for k in keys])) > 1e-3
