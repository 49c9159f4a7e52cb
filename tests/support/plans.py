"""Checks of an experts.ExpertPlan (host arrays), shared by the CPU and GPU tests."""

from __future__ import annotations

import numpy as np

GROUP_COLS = 8  # strata.kernels.cuda.experts.GROUP_COLS


def assert_plan_covers(ids: np.ndarray, n_expert: int, order: np.ndarray, tiles: np.ndarray, used: int,
                       max_tiles: int, cols: int = GROUP_COLS) -> None:
    """Every (token, expert) pair lands in exactly one used tile of its own expert (bad ids in
    bucket n_expert), tiles hold 1..cols pairs, and the grid bound holds."""
    flat = ids.reshape(-1)
    bucket = np.where((flat >= 0) & (flat < n_expert), flat, n_expert)
    assert sorted(order.tolist()) == list(range(flat.size))
    seen = np.zeros(flat.size, np.int64)
    for e, s0, nc, _ in tiles[:used]:
        assert 1 <= nc <= cols
        assert (bucket[order[s0 : s0 + nc]] == e).all()
        seen[order[s0 : s0 + nc]] += 1
    assert (seen == 1).all() and used <= max_tiles
