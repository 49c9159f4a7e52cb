"""plan_window decides a window without doing it: who decodes, drafts (with which k), verifies a
stored draft, unfuses, prefills how much; and it changes no slot (strata/batch/plan.py). No model."""

from __future__ import annotations

import copy

from strata.batch.plan import grammar_cut, mtp_allowed, plan_window
from strata.batch.scheduler import SchedulerConfig
from strata.batch.slots import Slot
from strata.mtp.state import DraftState, Proposer
from strata.protocol import GenerationRequest, RequestHandle, SamplingParams


class _Cache:
    checkpointed = True

    def __init__(self, length: int = 0):
        self.length = length

    def truncate(self, n: int) -> None:
        self.length = n


class _Proposer(Proposer):
    draft = object()  # a draft model a fused window could run

    def propose(self, slot, k, params):
        raise AssertionError("the plan proposes nothing")


def _slot(i: int, prompt: int, prefilled: int, generated: int = 0, max_tokens: int = 100,
          temperature: float = 0.0) -> Slot:
    s = Slot(i, _Cache(prefilled + generated), mtp=DraftState(cache=_Cache(prefilled), admitted=True))
    s.handle = RequestHandle(GenerationRequest(list(range(prompt)), SamplingParams(max_tokens=max_tokens,
                                                                                   temperature=temperature)))
    s.prompt = list(range(prompt))
    s.n_prefilled, s.n_generated, s.pending = prefilled, generated, 7
    return s


def _state(s: Slot) -> dict:
    """What a plan could change of a slot: its fields, its draft state's and its caches' lengths."""
    fields = {k: copy.copy(v) for k, v in vars(s).items() if k not in ("handle", "cache", "mtp")}
    return {**fields, "mtp": {k: copy.copy(v) for k, v in vars(s.mtp).items() if k != "cache"},
            "lengths": (s.cache.length, s.mtp.cache.length)}


def _cfg(**kw) -> SchedulerConfig:
    return SchedulerConfig(**{"parallel": 4, "max_ctx": 64, "kv_kind": "f16", "prefill_chunk": 16, "spec": 3, **kw})


def test_one_decoding_slot_drafts_within_its_room_and_the_plan_changes_nothing():
    s = _slot(0, prompt=10, prefilled=10, generated=5, max_tokens=7)
    before = _state(s)
    plan = plan_window([s], {}, _cfg(), _Proposer())
    assert plan.decode == [s] and plan.propose == [(s, 1)]  # max_tokens 7, 5 out: one draft + the target's
    assert not plan.prefill and not plan.stored and not plan.unfuse and plan.fused == frozenset()
    assert _state(s) == before


def test_batch_mtp_refused_by_the_probe_is_a_fallback_and_prefill_takes_its_share():
    a, b = _slot(0, 10, 10, 1), _slot(1, 40, 8)
    a.batch_mtp_reason = "quant"
    plan = plan_window([a, b], {1: 16}, _cfg(batch_mtp=True), _Proposer())
    assert plan.propose == [] and plan.fallbacks == ["quant"]
    assert plan.prefill == [(b, 16)] and plan.decode == [a]
    assert plan_window([a, b], {1: 16}, _cfg(), _Proposer()).fallbacks == []  # no --batch-mtp: not a fallback


def test_a_fused_slot_verifies_its_stored_draft_and_one_that_may_not_fuse_unfuses():
    s = _slot(0, 10, 10, 2)
    s.mtp.next_draft = (5, 0.9)
    cfg = _cfg(spec=1, fused_drafts=True)
    plan = plan_window([s], {}, cfg, _Proposer())
    assert plan.fused == {0} and plan.stored == [(s, 1)] and plan.propose == [] and plan.unfuse == []
    sampled = _slot(1, 10, 10, 2, temperature=0.7)  # a sampled neighbour: no window fuses
    plan = plan_window([s, sampled], {}, cfg, _Proposer())
    assert plan.fused == frozenset() and plan.unfuse == [s] and plan.stored == []
    assert s.mtp.next_draft == (5, 0.9)  # (unfusing is the scheduler's step, after the plan)


def test_mtp_allowed_and_the_grammar_cut():
    s = _slot(0, 4, 4, 1)
    assert mtp_allowed(s, 1, False, None) == (False, None)
    assert mtp_allowed(s, 1, False, _Proposer()) == (True, None)
    s.mtp.failed = "draft: boom"
    assert mtp_allowed(s, 1, False, _Proposer()) == (False, None)
    assert grammar_cut(s, [1, 2], [None, None]) == ([1, 2], [None, None], None)  # no grammar: all stay


def test_mtp_never_imports_batch():
    """The contract types live in strata/mtp/state.py: MTP knows no scheduler type."""
    from tests.test_house_rules import import_graph

    edges = import_graph()
    assert not [(m, t) for m, ts in edges.items() if m.startswith("strata.mtp") for t in ts if t.startswith("strata.batch")]
