"""How a window's prefill budget is shared between the slots whose prompts are not done.

Decoding slots always take their token(s) first, outside this budget (scheduler._plan): a
prompt never delays a neighbour's next token by more than one window. The prefill budget
(`--prefill`, tokens per window) is then shared max-min fairly ("water filling"): every
prefilling slot gets an equal share, a slot that needs less than its share takes only what it
needs and the rest goes to the others. So a short prompt that arrives while a long one is being
prefilled finishes in the first window it is in (its remainder is under the equal share), and
two long prompts advance side by side instead of one after the other.

A share under `min_chunk` tokens would spend a window's fixed cost on very little prompt; when
the budget cannot give every prefilling slot that much, only as many slots as it can are served
in this window, taken in turn from `turn` (round robin over slot indices), so each is served
within a few windows.

A window in which some prompt ends (its first token is sampled at the window's end) holds the
prompts that do not end to `min_chunk` tokens each (`hold_back`): the short request's first
token then waits for a small window, not for a full chunk of its neighbour's prompt. It never
holds back twice in a row (`PrefillSharing`), so a stream of short requests slows a long
prompt to at most every other window's full share, never to nothing.
"""

from __future__ import annotations

from typing import Sequence

MIN_CHUNK = 32  # tokens: the smallest prompt chunk a window gives a slot (unless it needs less)


def prefill_shares(needs: Sequence[tuple[int, int]], budget: int, *, turn: int = 0,
                   min_chunk: int = MIN_CHUNK) -> dict[int, int]:
    """{slot index: prompt tokens in this window} for the prefilling slots `needs` (slot index,
    prompt tokens still to prefill, each > 0). The shares add up to min(budget, total need);
    a slot that needs at most an equal share of the budget gets all it needs."""
    if budget <= 0 or not needs:
        return {}
    order = sorted(needs, key=lambda p: _in_turn(p[0], turn))
    chosen, floor = [], 0
    for index, need in order:  # as many slots, in turn, as the budget gives a useful chunk
        least = min(need, min_chunk)
        if chosen and floor + least > budget:
            break
        chosen.append((index, need))
        floor += least
    shares = _water_fill(chosen, budget)
    left = budget - sum(shares.values())  # > 0 only when every chosen slot's whole need was met
    for index, need in order[len(chosen):]:  # (small needs): what is left goes on in turn
        if left <= 0:
            break
        shares[index] = min(need, left)
        left -= shares[index]
    return shares


def _in_turn(index: int, turn: int) -> tuple[bool, int]:
    """Sort key of the round robin: slot indices from `turn` up, then those below it."""
    return index < turn, index


def _water_fill(chosen: list[tuple[int, int]], budget: int) -> dict[int, int]:
    """Max-min fair split of budget over chosen (in turn order): the smallest needs are met
    whole, the others share what is left equally; the rounding remainder goes one token each
    to the first slots in turn that still need it."""
    shares = {index: 0 for index, _ in chosen}
    left, open_ = budget, sorted(chosen, key=lambda p: p[1])
    while open_ and left > 0:
        level = left // len(open_)
        if level == 0:
            break
        index, need = open_[0]
        if need <= level:  # the smallest need fits under an equal share: met whole
            shares[index] = need
            left -= need
            open_.pop(0)
            continue
        for index, _ in open_:  # every remaining need exceeds the level: each gets it
            shares[index] = level
        left -= level * len(open_)
        break
    for index, need in chosen:  # the remainder of the division, in turn order
        if left <= 0:
            break
        if shares[index] < need:
            shares[index] += 1
            left -= 1
    return {index: n for index, n in shares.items() if n > 0}


def next_turn(shares: dict[int, int], turn: int) -> int:
    """Where the next window's round robin starts: after the last slot served in turn order
    from `turn` (so slots left out of this window come first in the next; past the highest
    index the circle starts again at 0)."""
    if not shares:
        return turn
    return max(shares, key=lambda i: _in_turn(i, turn)) + 1


def hold_back(shares: dict[int, int], needs: Sequence[tuple[int, int]], min_chunk: int = MIN_CHUNK) -> dict[int, int]:
    """The shares of a window in which some prompt ends: the prompts that do not end are cut to
    min_chunk tokens (they still advance); unchanged when no prompt ends or none goes on."""
    need = dict(needs)
    ending = [i for i, n in shares.items() if n == need[i]]
    going_on = [i for i, n in shares.items() if n < need[i]]
    if not ending or not going_on:
        return shares
    return {i: n if i in ending else min(n, min_chunk) for i, n in shares.items()}


class PrefillSharing:
    """The scheduler's prefill sharing across windows: the round robin's turn, and whether the
    last window held prompts back (the next one does not)."""

    def __init__(self, min_chunk: int = MIN_CHUNK):
        self.min_chunk = min_chunk
        self.turn = 0
        self.held = False

    def shares(self, needs: Sequence[tuple[int, int]], budget: int) -> dict[int, int]:
        """{slot index: prompt tokens} for this window (see the module's docstring)."""
        fair = prefill_shares(needs, budget, turn=self.turn, min_chunk=self.min_chunk)
        self.turn = next_turn(fair, self.turn)
        out = fair if self.held else hold_back(fair, needs, self.min_chunk)
        self.held = out != fair
        return out
