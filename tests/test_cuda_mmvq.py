"""CUDA MMVQ kernels against the numpy mirrors (strata.kernels.mmvq_numpy), on a GPU.

Every supported type x ncols in {1, 2, 3, 4, 8}, plus the experts variant, on fresh random
valid blocks (strata.kernels.random_blocks) and fresh random activations each run; outputs
are poisoned with NaN before each launch so an unwritten element fails. Bound: the relative
error ||gpu - mirror|| / ||mirror|| < 2e-5 (both accumulate in float32, in different orders;
the activation quantization is checked bit-exact separately).
Skips cleanly without CuPy or a device.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support.gpu import require_cuda  # noqa: E402

cp = require_cuda()

from strata.kernels import mmvq_numpy  # noqa: E402
from strata.kernels.activation_quant import quantize_activations  # noqa: E402
from strata.kernels.cuda import experts as gx  # noqa: E402
from strata.kernels.cuda import mmvq as gpu  # noqa: E402
from strata.kernels.cuda import mmvq_build as build  # noqa: E402
from strata.kernels.cuda import mmvq_policy as policy  # noqa: E402
from strata.kernels.ggml_types import BY_NAME, type_by_id  # noqa: E402
from strata.kernels.random_blocks import random_blocks  # noqa: E402

REL_BOUND = 2e-5
ROWS = 37  # not a multiple of the 4 rows per thread block: exercises the tail
K = 4352  # 17 super-blocks: Q8_0 rows span 3 tiles, Q4_K 2 (multi-tile streaming)
NCOLS = (1, 2, 3, 4, 8)
SEED = int.from_bytes(os.urandom(4), "little")
TYPES = [t for t in gpu.supported_types()]
NAMES = [type_by_id(t).name for t in TYPES]
WIDE_TYPES = tuple(build.KNOBS.wide_warps)


@pytest.fixture(scope="module", autouse=True)
def compiled():
    build.compile_all()


def _rng(*salt):
    return np.random.default_rng([SEED, *salt])


def _rel(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def _x(rng, ncols, k):
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    x[:, rng.integers(0, k, 5)] *= 8.0  # a few outliers, as real activations have
    return x


def test_quantize_matches_numpy_bit_exact():
    rng = _rng(0)
    x = _x(rng, 5, 2048)
    x[1, 64:96] = 0.0  # an all-zero block: d = 0, q = 0
    x[2, 0] = 127.0  # d = 1 exactly, so the next values sit on .5 ties (roundf: away from zero)
    x[2, 1:32] = np.arange(31, dtype=np.float32) - np.float32(14.5)
    ref = quantize_activations(x)
    buf = gpu.quantize_q8_1(cp.asarray(x))
    np.testing.assert_array_equal(cp.asnumpy(buf.q), ref.q)
    np.testing.assert_array_equal(cp.asnumpy(buf.d), ref.d)
    np.testing.assert_array_equal(cp.asnumpy(buf.s), ref.s)


@pytest.mark.parametrize("type_id", TYPES, ids=NAMES)
def test_mmvq_matches_mirror(type_id):
    """Each column count through the many-column kernel (split=False) and, for this small
    matrix, a grid row per column (split=True): both against the mirror, and bit for bit the
    same as each other."""
    failures = []
    for ncols in NCOLS:
        rng = _rng(type_id, ncols)
        w = random_blocks(type_id, ROWS, K, rng)
        x = _x(rng, ncols, K)
        ref = mmvq_numpy.mmvq(type_id, w, x)
        got = {}
        for split in (False, True):
            out = cp.full((ncols, ROWS), cp.nan, dtype=cp.float32)
            gpu.mmvq(type_id, cp.asarray(w), ROWS, K, cp.asarray(x), out=out, split=split)
            got[split] = cp.asnumpy(out)
            rel = _rel(got[split], ref) if np.isfinite(got[split]).all() else float("inf")
            if not rel < REL_BOUND:
                failures.append(f"ncols={ncols} split={split}: rel error {rel:.3g}")
        if not np.array_equal(got[False], got[True], equal_nan=True):
            failures.append(f"ncols={ncols}: split columns differ from the many-column kernel")
    assert not failures, f"{type_by_id(type_id).name} (seed {SEED}): " + "; ".join(failures)


def test_group_rows_only_for_large_matrices_of_few_rows():
    """RPW rows per group unless that leaves over a quarter of the warp slots empty on a
    matrix of GROUP2_BYTES or more; then 2."""
    big = policy.GROUP2_BYTES
    assert policy.group_rows(14336, 2640, 8 * big) == gpu.RPW  # an FFN gate / up projection
    assert policy.group_rows(4096, 2640, 3 * big) == 2  # its down projection: 1024 warps -> 2048
    assert policy.group_rows(4096, 2640, big - 1) == gpu.RPW  # small: latency-bound
    assert policy.group_rows(1980 * 4, 2640, 8 * big) == gpu.RPW  # exactly three quarters: RPW
    q4k = 12
    k = 14336
    (ln,) = gpu.column_launches(q4k, 4096, 1, split=False, aligned=True, k=k)
    resident = build.resident_warps(q4k, policy.mmvq_name(q4k, 1, True))
    if 4 * 4096 < 3 * gpu.RPW * resident:  # the H200 and most large GPUs
        assert ln.name == "mmvq<12, 1, true, 2>" and ln.rpw == 2 and ln.grid[0] == 4096 // (2 * gpu.WARPS)
    (ln,) = gpu.column_launches(q4k, 4096, 1, split=False, aligned=True)  # no k: RPW
    assert ln.name == "mmvq<12, 1, true>"


def test_split_columns_only_for_matrices_that_leave_the_device_idle():
    q4k = 12
    assert gpu.split_columns(q4k, 576, 1) is None  # one column: nothing to split
    name, rpw, bx = gpu.split_columns(q4k, 576, 8)  # the test model's 576 rows: 36 blocks
    assert name == f"mmvq<{q4k}, 1>" and bx * rpw * gpu.WARPS >= 576
    assert gpu.split_columns(q4k, 14336, 2) is None  # already a full wave of warps
    assert gpu.split_columns(0, 576, 4) is None  # float weights: another kernel


QUANT = [t for t in TYPES if t in gpu.QUANT_TYPES]


@pytest.mark.parametrize("type_id", QUANT, ids=[type_by_id(t).name for t in QUANT])
def test_aligned_rows_instances_equal_the_general_ones(type_id):
    """Rows of 4096 weights are a multiple of 16 bytes in every type, so mmvq picks the 1-column
    and experts instances compiled for 16-byte aligned rows; the general instances run on the
    same data must give the same bits (only the addressing differs), and both match the mirror."""
    rows, k, n_expert = 37, 4096, 3
    rng = _rng(type_id, 4096)
    t = type_by_id(type_id)
    host = np.stack([random_blocks(type_id, rows, k, rng) for _ in range(n_expert)])
    w3 = cp.asarray(host)
    row_bytes = t.row_bytes(k)
    assert gpu.rows_aligned(w3, row_bytes)
    x = _x(rng, 1, k)
    q8 = gpu.quantize_q8_1(cp.asarray(x))
    ref = mmvq_numpy.mmvq(type_id, host[0], x)
    got = {}
    for aligned in (False, True):
        (ln,) = gpu.column_launches(type_id, rows, 1, split=False, aligned=aligned)
        assert (", true" in ln.name) == aligned
        out = cp.full((1, rows), cp.nan, dtype=cp.float32)
        build.function(type_id, ln.name)(ln.grid, ln.block, (
            w3, np.int32(rows), np.int32(row_bytes), np.int32(k), np.int32(ln.rpw), q8.q, q8.meta, out),
            shared_mem=ln.smem)
        got[aligned] = cp.asnumpy(out)
        assert _rel(got[aligned], ref) < REL_BOUND, f"aligned={aligned} (seed {SEED})"
    np.testing.assert_array_equal(got[False], got[True])
    # the aligned instance with each group size (rows a warp works on together: _group_rows
    # takes 2 or 1 for few rows): the same bits, every row written
    for group in (gpu.RPW, 2, 1):
        name = policy.mmvq_name(type_id, 1, True, group)
        out = cp.full((1, rows), cp.nan, dtype=cp.float32)
        build.function(type_id, name)((-(-rows // (group * gpu.WARPS)),), (gpu.WARPS * 32,), (
            w3, np.int32(rows), np.int32(row_bytes), np.int32(k), np.int32(group), q8.q, q8.meta, out))
        np.testing.assert_array_equal(cp.asnumpy(out), got[True], err_msg=f"{name} (seed {SEED})")
    ids = cp.asarray(np.array([[2, 0]], dtype=np.int32))
    ref_e = mmvq_numpy.mmvq_experts(type_id, host, cp.asnumpy(ids), x)
    got_e = {}
    matrices = gx.resident_matrices(w3)  # one address per expert: the table the experts kernels read
    for aligned in (False, True):
        name = policy.ids_name(type_id, aligned)
        rpw = policy.rows_per_warp(build.device_facts(), build.KNOBS, type_id, name, rows, 2)
        out = cp.full((1, 2, rows), cp.nan, dtype=cp.float32)
        build.function(type_id, name)((-(-rows // (rpw * gpu.WARPS)), 2), (gpu.WARPS * 32,), (
            matrices.table, np.int32(n_expert), ids, np.int32(2), np.int32(rows),
            np.int32(row_bytes), np.int32(k), np.int32(rpw), q8.q, q8.meta, out))
        got_e[aligned] = cp.asnumpy(out)
        assert _rel(got_e[aligned], ref_e) < REL_BOUND, f"experts aligned={aligned} (seed {SEED})"
    np.testing.assert_array_equal(got_e[False], got_e[True])


@pytest.mark.parametrize("type_id", WIDE_TYPES, ids=[type_by_id(t).name for t in WIDE_TYPES])
def test_wide_codebook_kernel_equals_the_eight_copy_one(type_id):
    """mmvq_wide (a codebook copy per lane, 16-warp blocks on dynamic shared memory) reads the
    same words as mmvq's 8 copies: the same bits for every group size, rows per warp that are
    not a multiple of the group, both alignments, a grid past one block per SM; and column_launches
    picks it for one column where the device has the shared memory (the H200 has)."""
    if not policy.wide_ok(build.device_facts(), build.KNOBS):
        pytest.skip("this GPU gives a block less than mmvq_wide's shared memory")
    most = build.KNOBS.wide_warps[type_id]
    rows, k = 2 * most * 4 * 3 + 13, 4096  # several blocks, a ragged tail
    rng = _rng(type_id, 7)
    t = type_by_id(type_id)
    host = random_blocks(type_id, rows, k, rng)
    w = cp.asarray(host)
    row_bytes = t.row_bytes(k)
    x = _x(rng, 1, k)
    q8 = gpu.quantize_q8_1(cp.asarray(x))
    ref_out = cp.full((1, rows), cp.nan, dtype=cp.float32)
    build.function(type_id, policy.mmvq_name(type_id, 1, True))((-(-rows // (gpu.RPW * gpu.WARPS)),), (gpu.WARPS * 32,), (
        w, np.int32(rows), np.int32(row_bytes), np.int32(k), np.int32(gpu.RPW), q8.q, q8.meta, ref_out))
    ref = cp.asnumpy(ref_out)
    assert _rel(ref, mmvq_numpy.mmvq(type_id, host, x)) < REL_BOUND
    for aligned in (True, False):
        for group in (gpu.RPW, 2, 1):
            for rpw, warps in ((group, most), (3 * group + (1 if group > 1 else 0), most - 3)):
                name = policy.wide_name(type_id, aligned, group)
                out = cp.full((1, rows), cp.nan, dtype=cp.float32)
                build.function(type_id, name)((-(-rows // (rpw * warps)),), (warps * 32,), (
                    w, np.int32(rows), np.int32(row_bytes), np.int32(k), np.int32(rpw), q8.q, q8.meta, out),
                    shared_mem=build.KNOBS.wide_smem)
                np.testing.assert_array_equal(cp.asnumpy(out), ref, err_msg=f"{name} rpw {rpw} (seed {SEED})")
    # the rule: few long rows (groups of 2) from WIDE_MIN_BYTES, any matrix from WIDE_ANY_BYTES
    assert policy.takes_wide(build.device_facts(), build.KNOBS, type_id, policy.WIDE_MIN_BYTES, 2) and not policy.takes_wide(build.device_facts(), build.KNOBS, type_id, policy.WIDE_MIN_BYTES - 1, 2)
    assert not policy.takes_wide(build.device_facts(), build.KNOBS, type_id, policy.WIDE_ANY_BYTES - 1, gpu.RPW) and policy.takes_wide(build.device_facts(), build.KNOBS, type_id, policy.WIDE_ANY_BYTES, gpu.RPW)
    assert not policy.takes_wide(build.device_facts(), build.KNOBS, 12, policy.WIDE_ANY_BYTES, gpu.RPW)  # Q4_K: no codebook
    # a down projection's shape (rows of 14336 weights, groups of 2) at WIDE_MIN_BYTES: mmvq_wide,
    # the same bits as the 8-copy kernel
    k2 = 14336
    row2 = t.row_bytes(k2)
    big = -(-policy.WIDE_MIN_BYTES // row2)
    (ln,) = gpu.column_launches(type_id, big, 1, split=False, aligned=True, k=k2)
    assert ln.name == policy.wide_name(type_id, True, 2) and ln.smem == build.KNOBS.wide_smem and ln.block[0] <= 32 * most
    assert ln.grid[0] * ln.rpw * (ln.block[0] // 32) >= big
    (ln,) = gpu.column_launches(type_id, big - 1, 1, split=False, aligned=True, k=k2)
    assert ln.name.startswith("mmvq<")  # a smaller matrix: the 8-copy kernel
    (ln,) = gpu.column_launches(type_id, big, 2, split=False, aligned=True, k=k2)
    assert ln.name.startswith("mmvq<")  # more columns: the 8-copy kernels
    wbig = cp.asarray(random_blocks(type_id, big, k2, rng))
    q82 = gpu.quantize_q8_1(cp.asarray(_x(rng, 1, k2)))
    out = cp.full((1, big), cp.nan, dtype=cp.float32)
    build.function(type_id, policy.mmvq_name(type_id, 1, True))((-(-big // (gpu.RPW * gpu.WARPS)),), (gpu.WARPS * 32,), (
        wbig, np.int32(big), np.int32(row2), np.int32(k2), np.int32(gpu.RPW), q82.q, q82.meta, out))
    np.testing.assert_array_equal(cp.asnumpy(gpu.mmvq(type_id, wbig, big, k2, q82)), cp.asnumpy(out))


@pytest.mark.parametrize("type_id", build.KNOBS.lean_types, ids=[type_by_id(t).name for t in build.KNOBS.lean_types])
def test_lean_instance_equals_the_default(type_id, monkeypatch):
    """The lean one-column instance (one chunk per lane per tile, registers held for more resident
    blocks) gives the default instance's bits, for a ragged tail and several rows per warp; and
    column_launches takes it exactly where the default needs more than one wave and the lean one
    fits in one, only with PDL (where it was measured)."""
    rows, k = 4 * gpu.WARPS * 5 + 7, 4096
    rng = _rng(type_id, 11)
    t = type_by_id(type_id)
    host = random_blocks(type_id, rows, k, rng)
    w = cp.asarray(host)
    x = _x(rng, 1, k)
    q8 = gpu.quantize_q8_1(cp.asarray(x))
    default, lean = policy.mmvq_name(type_id, 1, True), policy.mmvq_name(type_id, 1, True, lean=True)
    outs = {}
    for name in (default, lean):
        for rpw in (gpu.RPW, 3 * gpu.RPW):
            out = cp.full((1, rows), cp.nan, dtype=cp.float32)
            build.function(type_id, name)((-(-rows // (rpw * gpu.WARPS)),), (gpu.WARPS * 32,), (
                w, np.int32(rows), np.int32(t.row_bytes(k)), np.int32(k), np.int32(rpw), q8.q, q8.meta, out))
            outs[name, rpw] = cp.asnumpy(out)
    ref = outs[default, gpu.RPW]
    assert _rel(ref, mmvq_numpy.mmvq(type_id, host, x)) < REL_BOUND
    for key, out in outs.items():
        np.testing.assert_array_equal(out, ref, err_msg=f"{key} (seed {SEED})")
    # the rule, at the row counts where the resident warps of the two instances part
    few, many = build.resident_warps(type_id, default), build.resident_warps(type_id, lean)
    assert many > few  # more blocks per SM: the point of the instance
    def name_at(n):
        (ln,) = gpu.column_launches(type_id, n, 1, split=False, aligned=True, k=k)
        return ln.name
    if build.pdl.enabled():
        assert name_at(gpu.RPW * few + 1) == lean and name_at(gpu.RPW * many) == lean
    else:
        assert name_at(gpu.RPW * few + 1) == default
    assert name_at(gpu.RPW * few) == default and name_at(gpu.RPW * many + 1) == default
    monkeypatch.setattr(build.pdl, "enabled", lambda: False)
    assert name_at(gpu.RPW * few + 1) == default
    assert not policy.takes_lean(build.device_facts(), build.KNOBS, 42, gpu.RPW * few + 1, few)  # Q2_0: not a lean type


@pytest.mark.parametrize("type_id", TYPES, ids=NAMES)
def test_mmvq_experts_matches_mirror(type_id):
    n_expert, rows, k = 5, 33, 1280
    rng = _rng(type_id, 99)
    w = np.stack([random_blocks(type_id, rows, k, rng) for _ in range(n_expert)])
    for ncols, n_used in ((1, 2), (3, 4)):
        ids = rng.integers(0, n_expert, (ncols, n_used)).astype(np.int32)
        x = _x(rng, ncols, k)
        ref = mmvq_numpy.mmvq_experts(type_id, w, ids, x)
        out = cp.full((ncols, n_used, rows), cp.nan, dtype=cp.float32)
        gx.mmvq_experts(type_id, cp.asarray(w), cp.asarray(ids), cp.asarray(x), out=out)
        got = cp.asnumpy(out)
        assert np.isfinite(got).all(), f"unwritten outputs (seed {SEED})"
        assert _rel(got, ref) < REL_BOUND, f"ncols={ncols}: rel {_rel(got, ref):.3g} (seed {SEED})"


def test_experts_bad_id_gives_nan_rows():
    tid = type_by_id(2).id  # Q4_0
    rng = _rng(7)
    w = np.stack([random_blocks(tid, 8, 256, rng) for _ in range(2)])
    ids = cp.asarray(np.array([[0, 5]], dtype=np.int32))
    out = cp.asnumpy(gx.mmvq_experts(tid, cp.asarray(w), ids, cp.asarray(_x(rng, 1, 256))))
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1]).all()


@pytest.mark.parametrize("id1,id2", [(21, 18), (12, 12), (42, 20)], ids=["IQ3_S+IQ3_XXS", "Q4_K+Q4_K", "Q2_0+IQ4_NL"])
def test_experts_pair_equals_two_launches(id1, id2):
    """Gate and up in one launch (types may differ): the same bits as one launch each, a bad
    id still NaN rows in both."""
    n_expert, k = 6, 1024
    rng = _rng(id1, id2, 5)
    w1 = cp.asarray(np.stack([random_blocks(id1, 40, k, rng) for _ in range(n_expert)]))
    w2 = cp.asarray(np.stack([random_blocks(id2, 52, k, rng) for _ in range(n_expert)]))
    ids = rng.integers(0, n_expert, (3, 4)).astype(np.int32)
    ids[2, 1] = n_expert + 3
    x = cp.asarray(_x(rng, 3, k))
    q8 = gpu.quantize_q8_1(x)
    cp.full(1 << 20, cp.nan, dtype=cp.float32)  # poison what the pool hands out next
    g, u = gx.mmvq_experts_pair(id1, w1, id2, w2, cp.asarray(ids), q8)
    g_ref = gx.mmvq_experts(id1, w1, cp.asarray(ids), x, q8=q8)
    u_ref = gx.mmvq_experts(id2, w2, cp.asarray(ids), x, q8=q8)
    for got, ref in ((g, g_ref), (u, u_ref)):
        got, ref = cp.asnumpy(got), cp.asnumpy(ref)
        assert np.isnan(got[2, 1]).all() and np.isnan(ref[2, 1]).all()
        got[2, 1] = ref[2, 1] = 0
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, ref)


GROUPED_TYPES = [12, 21, 18, 42, 20, 2, 8, 14]  # Q4_K IQ3_S IQ3_XXS Q2_0 IQ4_NL Q4_0 Q8_0 Q6_K


@pytest.mark.parametrize("type_id", GROUPED_TYPES, ids=[type_by_id(t).name for t in GROUPED_TYPES])
def test_experts_grouped_equals_one_pass_per_pair(type_id):
    """Prefill's grouped experts (one weight pass per tile of <= 8 pairs of one expert) give
    the decode kernel's bits for every pair: tokens shared by their experts and one row per
    pair, experts with 0, 1, 8 and 17 pairs (partial and whole tiles), bad ids NaN."""
    n_expert, rows, k, n, n_used = 7, 45, 1024, 29, 3
    rng = _rng(type_id, 31)
    w = cp.asarray(np.stack([random_blocks(type_id, rows, k, rng) for _ in range(n_expert)]))
    counts = {0: 17, 1: 8, 3: 1}  # expert 2, 5, 6 unused; the rest spread over 4 and the bad ids
    flat = np.concatenate([np.full(c, e) for e, c in counts.items()] + [np.full(n * n_used - 26 - 3, 4)]
                          + [np.array([-1, n_expert, 99])]).astype(np.int32)
    ids = rng.permutation(flat).reshape(n, n_used)
    ids_d = cp.asarray(ids)
    plan = gx.expert_plan(ids_d, n_expert)
    x = cp.asarray(_x(rng, n, k))
    q8 = gpu.quantize_q8_1(x)
    per_x = cp.asarray(_x(rng, n * n_used, k))
    per_q8 = gpu.quantize_q8_1(per_x)
    bad = ~((ids >= 0) & (ids < n_expert)).reshape(-1)
    w2 = cp.asarray(np.stack([random_blocks(type_id, rows, k, rng) for _ in range(n_expert)]))
    cases = ((False, x, q8, ids_d, w), (True, per_x, per_q8, ids_d.reshape(-1, 1), w),
             (True, per_x, per_q8, ids_d.reshape(-1, 1), w2))  # a second matrix on the same rows (an MoE's up)
    for per_pair, act, act_q8, ref_ids, wm in cases:
        cp.full(1 << 22, cp.nan, dtype=cp.float32)  # poison what the pool hands out next
        got = cp.asnumpy(gx.mmvq_experts_grouped(type_id, wm, plan, act_q8, per_pair=per_pair))
        ref = cp.asnumpy(gx.mmvq_experts(type_id, wm, ref_ids, act, q8=act_q8)).reshape(n * n_used, rows)
        assert np.isnan(got[bad]).all() and np.isnan(ref[bad]).all()
        assert np.isfinite(got[~bad]).all(), f"unwritten outputs (seed {SEED})"
        np.testing.assert_array_equal(got[~bad], ref[~bad])


QUANT_IDS = [t for t in TYPES if t in gpu.QUANT_TYPES]


@pytest.mark.parametrize("type_id", QUANT_IDS, ids=[type_by_id(t).name for t in QUANT_IDS])
def test_mmq_experts_match_mmvq_and_ignore_their_tile(type_id):
    """Long prompts' experts on int8 tensor cores (mmq_grouped): every pair within float
    rounding of the grouped MMVQ kernel (the same chunks and scales, summed in another order:
    2e-6 relative per row measured on the H200), bad ids NaN; and a pair's row is the same bit
    for bit when other tokens join the window and the tiles regroup (batch invariance), also
    between a plan of MMQ_COLS columns a tile and one of GROUP_COLS, for tokens shared by their
    experts and for a row per pair. 45 rows leave a partial row block; ~27 pairs an expert give
    tiles of one to four column groups, and some experts two tiles."""
    n_expert, rows, k, n, n_used = 5, 45, 1024, 45, 3
    assert gx.mmq_supports(type_id, k)
    rng = _rng(type_id, 41)
    w = cp.asarray(np.stack([random_blocks(type_id, rows, k, rng) for _ in range(n_expert)]))
    ids = rng.integers(0, n_expert, (n, n_used)).astype(np.int32)
    ids[4, 1] = n_expert + 2
    more = rng.integers(0, n_expert, (13, n_used)).astype(np.int32)
    ids_all = cp.asarray(np.concatenate([more[:6], ids, more[6:]]))  # the same pairs, other neighbours
    bad = ~((ids >= 0) & (ids < n_expert)).reshape(-1)
    for per_pair in (False, True):
        per = n_used if per_pair else 1  # activation rows per token
        xa = cp.asarray(_x(rng, (n + 13) * per, k))
        q8 = gpu.quantize_q8_1(xa[6 * per : (6 + n) * per])  # quantized per row: the same rows in both
        q8_all = gpu.quantize_q8_1(xa)
        plan = gx.expert_plan(cp.asarray(ids), n_expert, cols=gx.MMQ_COLS)
        plan_ref = gx.expert_plan(cp.asarray(ids), n_expert)
        plan_all = gx.expert_plan(ids_all, n_expert)  # tiles of GROUP_COLS
        cp.full(1 << 22, cp.nan, dtype=cp.float32)  # poison what the pool hands out next
        got = cp.asnumpy(gx.mmq_experts_grouped(type_id, w, plan, q8, per_pair=per_pair))
        ref = cp.asnumpy(gx.mmvq_experts_grouped(type_id, w, plan_ref, q8, per_pair=per_pair))
        alone = cp.asnumpy(gx.mmq_experts_grouped(type_id, w, plan_all, q8_all, per_pair=per_pair))
        alone = alone[6 * n_used : 6 * n_used + n * n_used]
        assert np.isnan(got[bad]).all()
        assert np.isfinite(got[~bad]).all(), f"unwritten outputs (seed {SEED})"
        rel = np.linalg.norm(got[~bad] - ref[~bad], axis=1) / np.maximum(np.linalg.norm(ref[~bad], axis=1), 1e-30)
        assert rel.max() < 2e-5, f"per_pair={per_pair}: max row error {rel.max():.3g} (seed {SEED})"
        np.testing.assert_array_equal(alone[~bad], got[~bad])


def test_mmq_takes_whole_steps_only():
    """mmq_grouped walks k in steps of 4 chunks (8 for 256-weight blocks): 640 weights (seed-moe's
    downs) suit Q2_0 and IQ4_NL, not Q4_K, whose experts then keep mmvq_grouped; a plan of
    GROUP_COLS tiles is the only one mmvq_grouped takes."""
    q2, nl, q4k = (BY_NAME[n].id for n in ("Q2_0", "IQ4_NL", "Q4_K"))
    assert gx.mmq_supports(q2, 640) and gx.mmq_supports(nl, 640)
    assert not gx.mmq_supports(q4k, 640) and gx.mmq_supports(q4k, 768)
    assert not gx.mmq_supports(BY_NAME["F16"].id, 1024)
    ids = cp.asarray(np.zeros((4, 2), dtype=np.int32))
    w = cp.zeros((1, 8, BY_NAME["Q2_0"].row_bytes(640)), dtype=cp.uint8)
    q8 = gpu.quantize_q8_1(cp.zeros((4, 640), dtype=cp.float32))
    with pytest.raises(ValueError, match="tiles of"):
        gx.mmvq_experts_grouped(q2, w, gx.expert_plan(ids, 1, cols=gx.MMQ_COLS), q8)


def test_expert_plan_tiles_cover_every_pair_once():
    """The plan built on the device equals the host (numpy) plan tests/test_expert_plan.py checks:
    several chunks of the kernel's stable scatter, unused experts, bad ids, few and many experts."""
    from tests.support.plans import assert_plan_covers

    for n, n_used, n_expert in ((200, 4, 16), (1, 8, 128), (777, 8, 128), (300, 2, 3), (64, 6, 512)):
        rng = _rng(77, n)
        ids = rng.integers(0, n_expert, (n, n_used)).astype(np.int32)
        if n_expert > 5:
            ids[ids == 3] = 5  # an unused expert
        ids.reshape(-1)[:: max(1, ids.size // 5)] = -1
        ids.reshape(-1)[-1] = n_expert + 3
        _check_plan(ids, n_expert, assert_plan_covers)


def _check_plan(ids, n_expert, assert_plan_covers):
    for cols in (gx.GROUP_COLS, gx.MMQ_COLS):
        plan = gx.expert_plan(cp.asarray(ids), n_expert, cols=cols)
        host = gx.expert_plan(ids, n_expert, xp=np, cols=cols)
        used = int(cp.asnumpy(plan.n_tiles)[0])
        assert_plan_covers(ids, n_expert, cp.asnumpy(plan.order), cp.asnumpy(plan.tiles), used, plan.max_tiles, cols)
        # the device builds it in one kernel (expert_plan_build); tiles past the used ones never run
        assert used == int(host.n_tiles[0]) and np.array_equal(cp.asnumpy(plan.tiles)[:used], host.tiles[:used])
        assert np.array_equal(cp.asnumpy(plan.order), host.order)


def test_more_columns_than_one_launch():
    tid = 12  # Q4_K
    rng = _rng(11)
    w = random_blocks(tid, 20, 512, rng)
    x = _x(rng, 11, 512)  # 8 + 3 columns: two launches
    got = cp.asnumpy(gpu.mmvq(tid, cp.asarray(w), 20, 512, cp.asarray(x)))
    assert _rel(got, mmvq_numpy.mmvq(tid, w, x)) < REL_BOUND


@pytest.mark.parametrize("type_id", [0, 1, 30, 12, 21], ids=["F32", "F16", "BF16", "Q4_K", "IQ3_S"])
def test_wide_window_equals_column_groups(type_id):
    """27 columns as one launch of 3 groups + a launch of 3 give each column the bits of its
    own 8-column (or 3-column) launch: a column's sum does not depend on the window's width."""
    rng = _rng(type_id, 27)
    rows, k = 45, 1024
    w = cp.asarray(random_blocks(type_id, rows, k, rng))
    x = cp.asarray(_x(rng, 27, k))
    cp.full(1 << 20, cp.nan, dtype=cp.float32)
    wide = cp.asnumpy(gpu.mmvq(type_id, w, rows, k, x))
    for c0 in range(0, 27, 8):
        part = cp.asnumpy(gpu.mmvq(type_id, w, rows, k, x[c0 : c0 + 8]))
        np.testing.assert_array_equal(wide[c0 : c0 + 8], part, err_msg=f"columns {c0}..")


def test_registers_every_type_in_native_table():
    from strata.kernels.native_table import NativeTable

    table = NativeTable()
    gpu.register(table)
    assert {k.type_id for k in table.kernels("cuda")} == set(gpu.supported_types())
    k = table.lookup("cuda", 42)  # Q2_0
    rng = _rng(12)
    w = random_blocks(42, 9, 256, rng)
    x = _x(rng, 2, 256)
    assert k.max_cols == gpu.MAX_COLS
    assert _rel(cp.asnumpy(k.impl(w, x)), mmvq_numpy.mmvq(42, w, x)) < REL_BOUND


def test_rejects_bad_shapes():
    with pytest.raises(ValueError):
        gpu.mmvq(12, cp.zeros(100, dtype=cp.uint8), 1, 256, cp.zeros((1, 256), dtype=cp.float32))
    with pytest.raises(ValueError):
        gpu.mmvq(15, cp.zeros(292, dtype=cp.uint8), 1, 256, cp.zeros((1, 256), dtype=cp.float32))  # Q8_K
