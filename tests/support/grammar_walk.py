"""Reading a grammar matcher's mask, and random walks through what it allows: shared by the
grammar library's tests and the tool-call grammars' tests."""

from __future__ import annotations

import numpy as np
import pytest


def allowed_ids(matcher) -> np.ndarray:
    """The token ids the matcher's mask allows now, ascending."""
    mask = np.zeros(matcher.vocab_words, np.uint32)
    matcher.fill_mask(mask)
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))


def random_walk(matcher, rng, stops: set[int], max_steps: int = 3000) -> list[int]:
    """Tokens drawn uniformly from the mask until a stop token is drawn; every step must leave
    at least one token allowed and be accepted, and a finite language must end in max_steps."""
    ids: list[int] = []
    for _ in range(max_steps):
        choices = allowed_ids(matcher)
        assert len(choices), "empty mask before the grammar ended"
        token = int(rng.choice(choices))
        if token in stops:
            return ids
        assert matcher.accept(token)
        ids.append(token)
    pytest.fail("a random walk over a finite language did not end")
