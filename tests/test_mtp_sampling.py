"""With sampling, speculative verification keeps the target's distribution exactly.

Unit level: verify() on hand-made distributions. End to end: the scheduler with a proposer
that drafts from a fixed distribution q, against the exact joint distribution of the first
two tokens computed from the model's own logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.batch.scheduler import Scheduler, SchedulerConfig
from strata.protocol import SamplingParams
from strata.model.transformer import Span
from strata.sampling.verify import verify
from strata.sampling.filters import distribution
from tests.support.engines import collect, load_engine, request, shared_seed_moe, shared_tiny
from tests.support.proposers import SampledProposer


def chi2_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit, p-value via the Wilson-Hilferty normal approximation."""
    from math import erf, sqrt

    keep = probs > 0
    n = counts.sum()
    exp = probs[keep] * n
    stat = float((((counts[keep] - exp) ** 2) / exp).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / sqrt(2 / (9 * dof))
    return 0.5 * (1 - erf(z / sqrt(2)))


def test_verify_greedy_semantics():
    rng = np.random.default_rng(0)
    p = [2, 3, 4]  # the target's greedy tokens
    v = verify([2, 3], p, [None, None], rng, greedy=True)
    assert v.accepted == 2 and v.tokens == [2, 3, 4]
    v = verify([2, 1], p, [None, None], rng, greedy=True)
    assert v.accepted == 1 and v.tokens == [2, 3]
    v = verify([0], p, [None], rng, greedy=True)
    assert v.accepted == 0 and v.tokens == [2]


def test_rejection_sampling_keeps_target_distribution():
    rng = np.random.default_rng(1)
    V = 6
    p0, p1, p2 = (rng.dirichlet(np.ones(V)) for _ in range(3))
    q0, q1 = rng.dirichlet(np.ones(V) * 0.5), rng.dirichlet(np.ones(V) * 0.5)
    n = 20000
    joint = np.zeros((V, V))
    for _ in range(n):
        d0 = rng.choice(V, p=q0)
        d1 = rng.choice(V, p=q1)
        # the target's distribution for the second token is p1 whatever the first (a fixed table)
        v = verify([d0, d1], [p0, p1, p2], [q0, q1], rng, greedy=False)
        # after a rejection the next window draws the second token from p1 itself
        second = v.tokens[1] if len(v.tokens) > 1 else rng.choice(V, p=p1)
        joint[v.tokens[0], second] += 1
    assert chi2_p_value(joint.sum(axis=1), p0) > 1e-3
    assert chi2_p_value(joint.reshape(-1), np.outer(p0, p1).reshape(-1)) > 1e-3


# seed-moe (12 s on 2 cores) runs with -m slow; the hybrid one, which also cuts recurrent state, always
@pytest.fixture(scope="module", params=[pytest.param("seed-moe", marks=pytest.mark.slow), "qwen35moe"])
def pack(request, tmp_path_factory):
    """The seed-moe preset (qwen3moe), and the tiny hybrid qwen35moe: drafts rejected there are
    cut back inside the window in the recurrent state as well as in the KV cache. Both at a
    4096-token vocabulary (tests.support.engines: the tiny hybrid's windows cost half as much; the
    joint law checked is the model's own top-3 x top-3, whatever the vocabulary)."""
    if request.param == "seed-moe":
        return shared_seed_moe(tmp_path_factory)
    return shared_tiny(tmp_path_factory, "qwen35moe")


def test_scheduler_sampling_with_drafts_matches_exact_distribution(pack):
    core, _ = load_engine(["--pack", str(pack), "--device", "cpu"])
    prompt = core.tokenizer.encode("Once upon a time", add_special=False)  # short: 300 runs
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=3)
    # exact joint distribution of the first two tokens from the model's own logits
    cache = core.model.new_cache(core.n_ctx, "f16")
    h = core.model.forward(np.asarray(prompt), [Span(cache, 0, len(prompt))])
    p_first = distribution(core.model.logits(h[-1:])[0], params)
    support1 = np.nonzero(p_first)[0]
    exact = {}
    for t in support1:
        c2 = core.model.new_cache(core.n_ctx, "f16")
        seq = prompt + [int(t)]
        h2 = core.model.forward(np.asarray(seq), [Span(c2, 0, len(seq))])
        p2 = distribution(core.model.logits(h2[-1:])[0], params)
        for u in np.nonzero(p2)[0]:
            exact[(int(t), int(u))] = p_first[t] * p2[u]
    # drafts come from a q that overlaps the target's support only in part
    second = {}
    for (_, u), pr in exact.items():
        second[u] = second.get(u, 0.0) + pr
    likely = sorted(second, key=second.get, reverse=True)
    support_q = likely[:2] + [7]
    prop = SampledProposer(support_q, [0.5, 0.3, 0.2], core.model.n_vocab, seed=5)
    cfg = SchedulerConfig(parallel=1, max_ctx=core.n_ctx, kv_kind="f16", prefill_chunk=256, spec=2)
    sch = Scheduler(core.model, core.tokenizer, cfg, proposer=prop, slot_batch_mtp=[(True, None)],
                    log=lambda s: None)
    keys = sorted(exact)
    counts = np.zeros(len(keys))
    n = 300
    for seed in range(n):
        # max_tokens=2 leaves room for one draft after the first token
        hd = sch.submit(request(prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=seed)))
        sch.run_until_idle()
        ids, _, _ = collect(hd)
        counts[keys.index((ids[0], ids[1]))] += 1
    assert sch.slots[0].counters.drafted > 0
    assert 0 < sch.slots[0].counters.accepted < sch.slots[0].counters.drafted
    assert chi2_p_value(counts, np.array([exact[k] for k in keys])) > 1e-3
