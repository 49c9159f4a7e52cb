"""The prefill budget's sharing rule (strata/batch/budget.py), without a model."""

from __future__ import annotations

import itertools

import pytest

from strata.batch.budget import MIN_CHUNK, PrefillSharing, hold_back, next_turn, prefill_shares


def test_a_short_prompt_is_done_in_the_window_it_joins():
    """A 4-token chat beside a 4000-token prompt: it takes its 4 tokens, the long one the rest."""
    assert prefill_shares([(0, 4000), (1, 4)], 512) == {0: 508, 1: 4}
    assert prefill_shares([(0, 4), (1, 4000)], 512) == {0: 4, 1: 508}


def test_long_prompts_advance_side_by_side():
    assert prefill_shares([(0, 4000), (1, 3000)], 512) == {0: 256, 1: 256}
    # the smallest need under an equal share is met whole; the others share what is left
    assert prefill_shares([(0, 4000), (1, 3000), (2, 10)], 512) == {0: 251, 1: 251, 2: 10}
    assert prefill_shares([(0, 100), (1, 100), (2, 100)], 101) == {0: 34, 1: 34, 2: 33}


def test_one_prompt_takes_the_whole_budget():
    """Alone, a prompt is chunked as before the budget was shared: min(budget, need)."""
    assert prefill_shares([(3, 4000)], 512) == {3: 512}
    assert prefill_shares([(3, 100)], 512) == {3: 100}
    assert prefill_shares([(0, 100)], 8) == {0: 8}


def test_no_prompt_or_no_budget():
    assert prefill_shares([], 512) == {}
    assert prefill_shares([(0, 10)], 0) == {}


def test_a_small_budget_serves_slots_in_turn_with_a_minimum_chunk():
    """Three long prompts, room for two chunks of MIN_CHUNK: two slots per window, in turn."""
    needs = [(0, 1000), (1, 1000), (2, 1000)]
    budget = 2 * MIN_CHUNK
    turn, served = 0, []
    for _ in range(3):
        shares = prefill_shares(needs, budget, turn=turn)
        assert sum(shares.values()) == budget and len(shares) == 2
        assert all(n == MIN_CHUNK for n in shares.values())
        served.append(sorted(shares))
        turn = next_turn(shares, turn)
    assert served == [[0, 1], [0, 2], [1, 2]]  # no slot waits more than one window


def test_what_the_chosen_slots_leave_goes_on_in_turn():
    """Small needs under the minimum chunk: the budget is not left idle."""
    assert prefill_shares([(0, 5), (1, 7)], 8) == {0: 5, 1: 3}
    assert prefill_shares([(0, 5), (1, 7)], 8, turn=1) == {1: 7, 0: 1}


@pytest.mark.parametrize("budget", [1, 7, 31, 64, 100, 512])
def test_shares_are_fair_and_use_the_budget(budget):
    """Every combination of needs: the shares add up to min(budget, total need), none exceeds
    its need, and a slot that needs at most an equal share of the budget gets it all."""
    for needs_only in itertools.product([1, 3, 40, 300, 5000], repeat=3):
        needs = list(enumerate(needs_only))
        for turn in range(4):
            shares = prefill_shares(needs, budget, turn=turn)
            assert sum(shares.values()) == min(budget, sum(needs_only)), (needs, budget, turn, shares)
            assert all(0 < shares[i] <= need for i, need in needs if i in shares)
            if budget >= len(needs) * MIN_CHUNK:  # every slot is served: the fair split
                for i, need in needs:
                    if need <= budget // len(needs):
                        assert shares[i] == need, (needs, budget, shares)
                    else:
                        assert shares[i] >= budget // len(needs), (needs, budget, shares)


def test_next_turn_goes_round_the_slots():
    assert next_turn({0: 32, 1: 32}, 0) == 2
    assert next_turn({2: 32, 0: 32}, 2) == 1  # served 2 then 0 (in turn from 2): slot 1 is next
    assert next_turn({}, 5) == 5


def test_a_window_where_a_prompt_ends_holds_the_others_back():
    """The short prompt's first token waits for a small window: the long prompt gets MIN_CHUNK."""
    needs = [(0, 4000), (1, 4)]
    assert hold_back({0: 508, 1: 4}, needs) == {0: MIN_CHUNK, 1: 4}
    assert hold_back({0: 256, 1: 256}, [(0, 4000), (1, 3000)]) == {0: 256, 1: 256}  # none ends
    assert hold_back({0: 300}, [(0, 300)]) == {0: 300}  # none goes on
    assert hold_back({0: 508, 1: 4}, needs, min_chunk=1000) == {0: 508, 1: 4}


def test_a_stream_of_short_prompts_never_stops_a_long_one():
    """A new short prompt every window: the long prompt is held back at most every other window."""
    sharing = PrefillSharing()
    long_left, got = 4000, []
    for _ in range(8):
        shares = sharing.shares([(0, long_left), (1, 4)], 512)
        assert shares[1] == 4  # every short prompt ends in its first window
        got.append(shares[0])
        long_left -= shares[0]
    assert got == [MIN_CHUNK, 508] * 4
    assert PrefillSharing().shares([(0, 4000)], 512) == {0: 512}  # alone: the whole budget
