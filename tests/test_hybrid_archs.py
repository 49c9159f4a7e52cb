"""The hybrid linear-attention family (qwen35moe, qwen35, qwen3next) on the CPU backend.

Against the float64 recomputation of tests/support/reference_hybrid.py (written from llama.cpp's
graphs, independently of strata.model), at prefill and token by token; the recurrent state's
rollback (a window cut back inside, to its start, or failing half way) against a fresh
recomputation; and the nextn (MTP) layer, in the pack or as an MTP-only GGUF, decoding exactly
as plain decoding at 1, 2 and 4 slots with and without --batch-mtp.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.backend.cpu import CpuBackend
from strata.errors import StrataError
from strata.model.build import build_model
from strata.model.transformer import Span
from strata.pack.loader import open_pack
from strata.pack.presets import TINY
from strata.pack.synth import synth_pack
from tests.support import reference_hybrid, reference_model
from tests.support.engines import chat_prompts, greedy, load_engine, run_all

ARCHS = ("qwen35moe", "qwen35", "qwen3next")
IDS = [1, 200, 300, 4000, 50, 60, 70, 80, 9, 1234]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """A tiny pack of each arch with its nextn layer inside, and one trunk + MTP-only GGUF."""
    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for arch in ARCHS:
        synth_pack(TINY[arch], root / arch, progress=lambda *a: None)
        out[arch] = root / arch / "model.gguf"
    synth_pack(TINY["qwen35moe"], root / "trunk", mtp_dir=root / "trunk-mtp", progress=lambda *a: None)
    out["trunk"], out["mtp"] = root / "trunk" / "model.gguf", root / "trunk-mtp"
    return out


def _model(path):
    pack = open_pack(pack=str(path))
    return build_model(CpuBackend(), pack.model_config(), lambda n: pack.tensors.get(n))


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_steps_match_the_float64_reference(packs, arch):
    md, W = reference_model.load(packs[arch])
    want = _log_softmax(reference_hybrid.forward(md, W, IDS, kv_round="f16"))
    m = _model(packs[arch])
    cache = m.new_cache(64, "f16")
    _, logits = m.forward(np.asarray(IDS), [Span(cache, 0, len(IDS))], logit_rows=list(range(len(IDS))))
    got = _log_softmax(logits)
    top = np.argsort(-want, axis=1)[:, :5]
    assert np.abs(np.take_along_axis(got, top, 1) - np.take_along_axis(want, top, 1)).max() < 2e-3
    steps = m.new_cache(64, "f16")  # token by token: the recurrent state carried across windows
    rows = [m.forward(np.asarray([t]), [Span(steps, i, 1)], logit_rows=[0])[1][0] for i, t in enumerate(IDS)]
    assert np.abs(_log_softmax(np.asarray(rows)) - got).max() < 2e-3


def _states(cache):
    return [np.array(a[cache.active]) for a in cache.conv + cache.ssm]


def _assert_same_state(got, want, cfg, n_tokens):
    """A recurrent state reached through windows, rollbacks and replays equals the one a single
    prefill of the same tokens computes, up to float32 rounding in a different order.

    The two differ only in how the sums are split: a decode window's matrix products take
    another BLAS kernel (and blocking) than a prefill's, so each rounds differently. A state
    element collects each token's contribution through every layer, each with an input and an
    output projection summing over about n_embd terms: n = tokens x layers x 2 n_embd roundings
    of relative size eps/2 each. As a random walk, the two evaluations differ by a normal of
    standard deviation eps/sqrt(2) * sqrt(n) * |value|, and the largest of `size` such
    differences stays under sqrt(2 ln size) of them; |value| is bounded by the array's largest
    element. A wrong replay (a token lost or applied twice) moves the state by about its own
    size (0.5 to 5 in the tiny packs), over a thousand times this bound."""
    eps = float(np.finfo(np.float32).eps)
    n = n_tokens * cfg.n_layer * 2 * cfg.n_embd
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == np.float32
        tol = eps * np.sqrt(np.log(b.size) * n) * float(np.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=0, atol=tol)


def test_rollback_inside_a_window_equals_recomputation(packs):
    m = _model(packs["qwen35moe"])
    fresh = m.new_cache(64, "f16")
    m.forward(np.asarray(IDS[:6]), [Span(fresh, 0, 6)])
    cut = m.new_cache(64, "f16")
    m.forward(np.asarray(IDS[:3]), [Span(cut, 0, 3)])
    m.forward(np.asarray(IDS[3:6] + [7, 7]), [Span(cut, 3, 5)])  # two wrong drafts after 3 right tokens
    cut.truncate(6)
    assert cut.length == 6
    _assert_same_state(_states(cut), _states(fresh), m.cfg, 6)
    # back to a window's start: nothing recomputed, the state as it was
    before = _states(cut)
    m.forward(np.asarray([5, 5, 5]), [Span(cut, 6, 3)])
    cut.truncate(6)
    for a, b in zip(_states(cut), before):
        np.testing.assert_array_equal(a, b)
    # a window failing half way leaves nothing behind (its states were never committed)
    m.layers[-1].ffn.run = None  # the last layer's FFN is not callable: the forward raises there
    with pytest.raises(TypeError):
        m.forward(np.asarray([5]), [Span(cut, 6, 1)])
    assert cut.length == 6
    for a, b in zip(_states(cut), before):
        np.testing.assert_array_equal(a, b)


def test_rollback_limits_are_one_line(packs):
    m = _model(packs["qwen35"])
    c = m.new_cache(256, "f16")
    m.forward(np.arange(1, 41), [Span(c, 0, 40)])  # a prompt chunk longer than the replay window
    with pytest.raises(StrataError, match="keeps no replay inputs"):
        c.truncate(20)
    m.forward(np.asarray([3]), [Span(c, 40, 1)])
    with pytest.raises(StrataError, match="cannot roll back to position 10"):
        c.truncate(10)
    c.truncate(0)  # a new sequence: always possible
    assert c.length == 0 and all(not a.any() for a in _states(c))


@pytest.mark.parametrize("arch", ARCHS)
def test_nextn_layer_matches_the_float64_reference(packs, arch):
    from strata.mtp.draft import DraftModel, find_draft

    md, W = reference_model.load(packs[arch])
    logits, hidden = reference_hybrid.forward(md, W, IDS, kv_round="f16", with_hidden=True)
    want = _log_softmax(reference_hybrid.nextn_forward(md, W, IDS, hidden, kv_round="f16"))
    pack = open_pack(pack=str(packs[arch]))
    cfg = pack.model_config()
    m = build_model(CpuBackend(), cfg, lambda n: pack.tensors.get(n))
    draft = DraftModel(m.b, cfg, find_draft(None, pack), m)
    main = m.new_cache(64, "f16")
    h = m.forward(np.asarray(IDS), [Span(main, 0, len(IDS))])
    prev = np.concatenate([np.zeros((1, cfg.n_embd), np.float32), h[:-1]], axis=0)
    _, got = draft.step(draft.new_cache(64, "f16"), np.asarray(IDS), prev)
    top = np.argsort(-want, axis=1)[:, :5]
    assert np.abs(np.take_along_axis(_log_softmax(got), top, 1) - np.take_along_axis(want, top, 1)).max() < 2e-3


TEXTS = ["Hello there", "Write a haiku about rain.", "List three colors.", "What is 2+2?"]


@pytest.fixture(scope="module")
def plain(packs):
    out = {}
    for arch in ARCHS:
        core, _ = load_engine(["--pack", str(packs[arch]), "--device", "cpu"])
        prompts = chat_prompts(core, TEXTS)
        out[arch] = prompts, [ids for ids, _, _ in run_all(core, prompts, greedy(12), threaded=False)]
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch_mtp", [True, False])
def test_nextn_mtp_greedy_equals_plain(packs, plain, arch, batch_mtp):
    prompts, want = plain[arch]
    args = ["--pack", str(packs[arch]), "--spec", "3", "--parallel", "4", "--device", "cpu"]
    core, lines = load_engine(args + (["--batch-mtp"] if batch_mtp else []))
    assert any("draft" in ln and "nextn layer 4 of the pack" in ln for ln in lines), lines
    assert any(ln.startswith("strata: recurrent state: 3 Gated DeltaNet layers") for ln in lines), lines
    for n in (1, 2, 4):
        outs = run_all(core, prompts[:n], greedy(12), threaded=False)
        assert [ids for ids, _, _ in outs] == want[:n]
    assert sum(s["mtp_drafted"] for s in core.metrics()["slots"]) > 0


def test_the_reports_config_with_an_mtp_only_gguf(packs, plain):
    """--pack of the main stack, --mtp an MTP-only GGUF, --spec 4 --spec-min-p 0.5 --batch-mtp,
    parallel 4 (the report's flags), served by real threads as the server drives it."""
    prompts, _ = plain["qwen35moe"]
    core, lines = load_engine(["--pack", str(packs["trunk"]), "--mtp", str(packs["mtp"]), "--spec", "4",
                               "--spec-min-p", "0.5", "--batch-mtp", "--parallel", "4", "--device", "cpu",
                               "--kv", "int8", "--max-context", "262144"])
    assert any("--mtp" in ln and "nextn layer 4" in ln for ln in lines), lines
    assert sum(ln.startswith("strata probe:") for ln in lines) == 1
    plain_int8, _ = load_engine(["--pack", str(packs["trunk"]), "--device", "cpu", "--kv", "int8"])
    want8 = [ids for ids, _, _ in run_all(plain_int8, prompts, greedy(12), threaded=False)]
    core.start()
    try:
        for n in (1, 2, 4):
            outs = run_all(core, prompts[:n], greedy(12), threaded=True)
            assert [ids for ids, _, _ in outs] == want8[:n]
            assert all(o[2].reason in ("length", "stop") for o in outs)
    finally:
        core.stop()
    assert core.scheduler.finished.get("error", 0) == 0


@pytest.mark.parametrize("wrong_at,expect", [(set(), 3), ({1}, 0), ({2}, 1), ({3}, 2)])
def test_replayed_proposals_accept_exactly_and_the_state_follows(packs, plain, wrong_at, expect):
    """A proposer replaying the target's own continuation, wrong at chosen positions: each
    window accepts exactly the drafts before the first wrong one, so the recurrent state is cut
    back inside every window; the tokens equal plain decoding and the state equals a fresh one."""
    from strata.batch.scheduler import Scheduler, SchedulerConfig
    from tests.support.engines import collect, request
    from tests.support.proposers import ReplayProposer

    prompts, want = plain["qwen35moe"]
    core, _ = load_engine(["--pack", str(packs["qwen35moe"]), "--device", "cpu"])
    prop = ReplayProposer({tuple(p): w for p, w in zip(prompts, want)}, wrong_at, vocab=core.model.n_vocab)
    cfg = SchedulerConfig(parallel=2, max_ctx=core.n_ctx, kv_kind="f16", prefill_chunk=64, spec=3, batch_mtp=True)
    sch = Scheduler(core.model, core.tokenizer, cfg, proposer=prop, slot_batch_mtp=[(True, None)] * 2,
                    log=lambda s: None)
    handles = [sch.submit(request(p, greedy(12))) for p in prompts[:2]]
    checked = 0
    while any(s.busy for s in sch.slots) or sch.queue:
        sch._admit()
        sch.step()
        for s in sch.slots:
            if s.busy and not s.prefilling and s.n_generated > 2 and checked < 4:
                seq = s.prompt + want[prompts.index(s.prompt)][: s.n_generated - 1]
                assert s.cache.length == len(seq)
                fresh = core.model.new_cache(core.n_ctx, "f16")
                core.model.forward(np.asarray(seq), [Span(fresh, 0, len(seq))])
                _assert_same_state(_states(s.cache), _states(fresh), core.model.cfg, len(seq))
                checked += 1
    assert checked == 4
    assert [collect(h)[0] for h in handles] == want[:2]
    assert sum(s.counters.accepted for s in sch.slots) == sum(prop.expected_accepts)
    assert max(prop.expected_accepts) == expect or not prop.expected_accepts
