"""The grouped-experts plan (strata.kernels.cuda.experts.expert_plan) built with numpy, so CI (no
GPU) checks the tiling. On the GPU one kernel builds it (expert_plan_build); tests/test_cuda_mmvq.py
checks that kernel against this host plan, and the grouped kernel that runs on it."""

from __future__ import annotations

import numpy as np
import pytest

from strata.kernels.cuda import experts
from tests.support.plans import GROUP_COLS, assert_plan_covers


def test_group_cols_match():
    assert experts.GROUP_COLS == GROUP_COLS


@pytest.mark.parametrize("cols", [GROUP_COLS, experts.MMQ_COLS])
@pytest.mark.parametrize("n,n_used,n_expert", [(200, 4, 16), (1, 8, 128), (512, 8, 128), (37, 2, 3)])
def test_plan_tiles_cover_every_pair_once(n, n_used, n_expert, cols):
    rng = np.random.default_rng(n * n_expert)
    ids = rng.integers(0, n_expert, (n, n_used)).astype(np.int32)
    if n_expert > 4:
        ids[ids == 3] = 5  # an unused expert
    ids.reshape(-1)[:: max(1, ids.size // 3)] = -1  # bad ids: their own bucket (NaN rows on the GPU)
    if ids.size > 1:
        ids.reshape(-1)[1] = n_expert + 7
    plan = experts.expert_plan(ids, n_expert, xp=np, cols=cols)
    assert plan.pairs == n * n_used and plan.n_used == n_used and plan.cols == cols
    assert_plan_covers(ids, n_expert, plan.order, plan.tiles, int(plan.n_tiles[0]), plan.max_tiles, cols)
    # a pair's sorted position keeps pair order within its expert (the sort is stable)
    flat = ids.reshape(-1)
    bucket = np.where((flat >= 0) & (flat < n_expert), flat, n_expert)
    assert np.array_equal(plan.order, np.argsort(bucket, kind="stable"))


def test_plan_rejects_flat_ids():
    with pytest.raises(ValueError, match="expert_ids must be"):
        experts.expert_plan(np.zeros(5, np.int32), 4, xp=np)
