"""A long prompt shares each window's prefill budget (strata/batch/budget.py) with the test
model on the CPU engine: a short chat that arrives while a long prompt is being prefilled gets
its first token in the first window it is in (a small one: the long prompt's chunk is held back
in it), decodes one token in every window after it, and the long prompt goes on advancing by
whole chunks; greedy tokens are those of each request alone.

Counted in windows, driven one window at a time on the test's thread (no clock)."""

from __future__ import annotations

import numpy as np

from strata.batch.budget import MIN_CHUNK
from strata.batch.scheduler import Scheduler, SchedulerConfig
from strata.protocol import TokenEvent
from tests.support.engines import greedy, request
from tests.support.model_fixtures import chat_ids, engine

CHUNK = 64  # --prefill: the long prompt needs 8 windows of it alone


def _scheduler(core, parallel: int, chunk: int = CHUNK) -> Scheduler:
    cfg = SchedulerConfig(parallel=parallel, max_ctx=512, kv_kind="f16", prefill_chunk=chunk)
    return Scheduler(core.model, core.tokenizer, cfg, log=lambda line: None)


def _window(sch: Scheduler) -> None:
    sch._admit()
    sch._guarded_step()


def _tokens(h) -> int:
    """Token events the handle holds so far (taken off its queue, counted on the handle)."""
    while not h.events.empty():
        ev = h.events.get_nowait()
        h.seen = getattr(h, "seen", 0) + isinstance(ev, TokenEvent)
        if not isinstance(ev, TokenEvent):
            h.finished = ev
    return getattr(h, "seen", 0)


def _long_prompt(core, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, core.cfg.vocab_size - 100, n).tolist()


def test_a_short_chat_is_not_held_behind_a_long_prompt():
    """Alone, the chat's first token comes after one window; beside a long prompt in flight,
    after one window too (given the budget in slot order, it would wait for the whole prompt)."""
    core = engine(None, 4)
    short = core.tokenizer.encode("Hi! How are you?")
    assert len(short) <= CHUNK // 2  # (under an equal share of the budget: done in one window)
    long_prompt = _long_prompt(core, 8 * CHUNK, seed=1)

    alone = _scheduler(core, 1)  # the short chat alone: its first token after one window
    h = alone.submit(request(short, greedy(1)))
    _window(alone)
    assert _tokens(h) == 1

    sch = _scheduler(core, 2)
    hl = sch.submit(request(long_prompt, greedy(1)))
    _window(sch)
    _window(sch)  # the long prompt is under way, its slot's neighbour free
    long_slot = next(s for s in sch.slots if s.busy)
    done = long_slot.n_prefilled
    assert 0 < done < len(long_prompt)

    hs = sch.submit(request(short, greedy(4, ignore_eos=True)))
    _window(sch)  # the first window after its arrival: its whole prompt and its first token
    assert _tokens(hs) == 1
    # the long prompt went on, held to a small chunk so that the short one's window is short
    assert long_slot.n_prefilled == done + MIN_CHUNK < done + CHUNK - len(short)
    for i in range(2, 5):  # a token every window while the long prompt goes on
        done = long_slot.n_prefilled
        _window(sch)
        assert _tokens(hs) == i
        assert long_slot.n_prefilled == done + CHUNK  # (the neighbour's token is outside the budget)
    assert long_slot.prefilling and _tokens(hl) == 0


def test_greedy_tokens_do_not_depend_on_how_prompts_share_windows():
    """Three prompts prefilled side by side (the budget of 96 split between them, cut where a
    prompt ends) against each prefilled alone in chunks of 96: the same greedy tokens."""
    core = engine(None, 4)
    prompts = [_long_prompt(core, 120, seed=2), chat_ids(core, "Name three colours."),
               _long_prompt(core, 70, seed=3)]
    alone = _scheduler(core, 1, chunk=96)
    want = []
    for p in prompts:
        h = alone.submit(request(p, greedy(4, ignore_eos=True)))
        alone.run_until_idle()
        want.append(h.collect(10)[0])
    sch = _scheduler(core, 3, chunk=96)
    handles = [sch.submit(request(p, greedy(4, ignore_eos=True))) for p in prompts]
    sch.run_until_idle()
    assert [h.collect(10)[0] for h in handles] == want
