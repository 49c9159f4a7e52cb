"""MoE experts on the GPU: one pass per (token, expert) pair for decode, grouped by expert for
prefill (mmvq_grouped, and mmq_grouped on int8 tensor cores for long prompts' rows).

Every kernel here reaches an expert's matrix through a table on the device holding one address
per expert (ExpertMatrices.table), never base + expert x stride: the experts of a tensor need not
share one allocation, and a CUDA graph holds the table's address, so whoever owns the table may
point an expert elsewhere between windows without a new capture. The arithmetic is MMVQ's.

    mmvq_experts(type_id, experts, expert_ids_dev, x_dev, out=None) -> (ncols, n_used, rows)
    mmvq_experts_pair(id1, experts1, id2, experts2, expert_ids_dev, q8) -> (out1, out2)
    expert_plan(ids, n_expert, cols) -> ExpertPlan;  mmvq_experts_grouped / mmq_experts_grouped
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from strata.kernels.cuda import mmvq_build as build
from strata.kernels.cuda import mmvq_policy as policy
from strata.kernels.cuda.launch import launch
from strata.kernels.cuda.mmvq import KNOBS, Q8Buffer, check_matrix_bytes, columns, quantize_q8_1
from strata.kernels.cuda.mmvq_policy import FLOAT_TYPES, QK, QUANT_TYPES, RPW, WARPS
from strata.kernels.ggml_types import type_by_id


def _cp():
    import cupy

    return cupy


@dataclass(frozen=True)
class ExpertMatrices:
    """One expert tensor as the kernels read it: `table` uint64 (n_expert,) on the device, expert
    e's matrix (rows, row_bytes) of raw blocks starting at table[e]. aligned: every matrix starts
    on 16 bytes and row_bytes is a multiple of 16 (the A16 instances). owner: what keeps the
    matrices' memory alive (the caller's arrays)."""

    table: object
    n_expert: int
    rows: int
    row_bytes: int
    aligned: bool
    owner: object = None


def address_table(base: int, n_expert: int, stride: int):
    """The table of n_expert matrices laid out one after another from `base` (uint64, device)."""
    cp = _cp()
    return cp.asarray(np.uint64(base) + np.uint64(stride) * np.arange(n_expert, dtype=np.uint64), dtype=cp.uint64)


def resident_matrices(w_dev) -> ExpertMatrices:
    """The ExpertMatrices of a (n_expert, rows, row_bytes) device array holding every expert."""
    cp = _cp()
    w3 = cp.asarray(w_dev)
    if w3.ndim != 3:
        raise ValueError(f"experts: weights must be (n_expert, rows, row_bytes), got {w3.shape}")
    if w3.dtype != cp.uint8 or not w3.flags.c_contiguous or w3.data.ptr % 16:
        w3 = cp.ascontiguousarray(w3).view(cp.uint8).copy()  # kernels read aligned 4- and 16-byte pieces
    n_expert, rows, row_bytes = (int(x) for x in w3.shape)
    aligned = KNOBS.aligned and row_bytes % 16 == 0 and w3.data.ptr % 16 == 0
    return ExpertMatrices(address_table(w3.data.ptr, n_expert, rows * row_bytes), n_expert, rows, row_bytes,
                          aligned, w3)


def _matrices(experts) -> ExpertMatrices:
    return experts if isinstance(experts, ExpertMatrices) else resident_matrices(experts)


def _checked(name: str, type_id: int, m: ExpertMatrices, k: int | None = None):
    """The GGML type and the row length k of these experts, with one clear error naming the call."""
    t = type_by_id(type_id)
    if t is None or type_id not in build.supported_types():
        raise ValueError(f"{name}: no CUDA kernel for GGML type {t.name if t else type_id}")
    check_matrix_bytes(name, m.rows, m.row_bytes)
    if k is None:
        k = m.row_bytes // t.type_size * t.block_size
    if k <= 0 or k % t.block_size or (t.quantized and k % QK) or m.row_bytes != t.row_bytes(k):
        raise ValueError(f"{name}: {t.name} rows of {m.row_bytes} bytes are not whole blocks of {k} weights")
    return t, k


def mmvq_experts(type_id: int, experts, expert_ids_dev, x_dev, out=None, q8: Q8Buffer | None = None):
    """Experts mat-vec: experts (ExpertMatrices, or an (n_expert, rows, row_bytes) array), expert_ids
    (ncols, n_used) int32 on the device, x (ncols, k) -> float32 (ncols, n_used, rows). Ids stay on
    the device: an id outside 0..n_expert-1 yields NaN rows instead of a host round trip. q8: x
    already quantized (shared by several expert weights), skipping the quantization here."""
    cp = _cp()
    m = _matrices(experts)
    t, k = _checked("mmvq_experts", type_id, m)
    ids = cp.ascontiguousarray(cp.asarray(expert_ids_dev, dtype=cp.int32))
    x = columns(x_dev)
    if ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"mmvq_experts: expert_ids must be (ncols={x.shape[0]}, n_used), got {ids.shape}")
    ncols, n_used = ids.shape
    rows, row_bytes = m.rows, m.row_bytes
    if out is None:
        out = cp.empty((ncols, n_used, rows), dtype=cp.float32)
    if ncols * n_used == 0:
        return out
    grid = ((rows + WARPS - 1) // WARPS, ncols * n_used)
    common = (m.table, np.int32(m.n_expert), ids, np.int32(n_used), np.int32(rows), np.int32(row_bytes), np.int32(k))
    if t.id in FLOAT_TYPES:
        vec = np.int32(row_bytes % 16 == 0)
        launch(build.function(t.id, f"mmvf_ids<{t.id}>"), grid, (WARPS * 32,), common + (x, out, vec))
    else:
        act = q8 if q8 is not None else quantize_q8_1(x)
        name = policy.ids_name(t.id, m.aligned)
        rpw = policy.rows_per_warp(build.device_facts(), KNOBS, t.id, name, rows, ncols * n_used)
        qgrid = (-(-rows // (rpw * WARPS)), ncols * n_used)
        launch(build.function(t.id, name), qgrid, (WARPS * 32,), common + (np.int32(rpw), act.q, act.meta, out))
    return out


def pair_function(id1: int, id2: int, aligned: bool = False):
    """mmvq_ids_pair<id1, id2>: gate and up experts of two types in one launch."""
    return build.named_function(policy.pair_name(id1, id2, aligned))


def mmvq_experts_pair(id1: int, experts1, id2: int, experts2, expert_ids_dev, q8: Q8Buffer):
    """Two quantized expert tensors over the same quantized activations (gate and up) in one
    launch, both with rows of q8.k weights. -> (out1 (ncols, n_used, rows1), out2 (ncols, n_used, rows2))."""
    cp = _cp()
    ids = cp.ascontiguousarray(cp.asarray(expert_ids_dev, dtype=cp.int32))
    ncols, n_used = ids.shape
    parts = []
    for tid, experts in ((id1, experts1), (id2, experts2)):
        if tid in FLOAT_TYPES:
            raise ValueError("mmvq_experts_pair: quantized weights only")
        m = _matrices(experts)
        _checked("mmvq_experts_pair", tid, m, q8.k)
        parts.append(m)
    if parts[0].n_expert != parts[1].n_expert or ids.shape[0] != q8.ncols:
        raise ValueError("mmvq_experts_pair: the two matrices must have the same experts and activations")
    fn = pair_function(id1, id2, all(m.aligned for m in parts))
    resident = build.resident_warps_of(fn)
    facts = build.device_facts()
    outs, lead = [], []
    for m in parts:
        rpw = policy.rows_per_warp(facts, KNOBS, 0, "", m.rows, ncols * n_used, resident=resident)
        nb = -(-m.rows // (rpw * WARPS))
        out = cp.empty((ncols, n_used, m.rows), dtype=cp.float32)
        outs.append(out)
        lead.append((m.table, np.int32(m.rows), np.int32(m.row_bytes), np.int32(rpw), nb, out))
    if ncols * n_used:
        (e1, r1, rb1, rpw1, nb1, o1), (e2, r2, rb2, rpw2, nb2, o2) = lead
        launch(fn, (nb1 + nb2, ncols * n_used), (WARPS * 32,), (
            e1, r1, rb1, rpw1, np.int32(nb1), o1, e2, r2, rb2, rpw2, o2,
            np.int32(parts[0].n_expert), ids, np.int32(n_used), np.int32(q8.k), q8.q, q8.meta))
    return outs[0], outs[1]


# ------------------------------------------------------------------ experts grouped by expert
GROUP_COLS = 8  # columns per tile of mmvq_grouped; must match mmvq_kernels.cuh
MMQ_N8 = 4  # mmq_grouped<t, N8>'s groups of 8 columns: its decode is paid once per 32 columns
MMQ_COLS = 8 * MMQ_N8  # columns per tile of the plans mmq_grouped runs on
GROUP_ROW_BLOCKS = 4  # thread blocks sharing one tile's rows


@dataclass
class ExpertPlan:
    """The (token, expert) pairs of a window sorted by expert, cut into tiles of at most `cols`
    pairs of one expert (the grid of mmvq_grouped: GROUP_COLS, or of mmq_grouped: MMQ_COLS).
    Made on the device from the ids (no host round trip); out-of-range ids form one more
    bucket, expert n_expert (NaN rows)."""

    order: object  # int64 (pairs,): sorted position -> pair index (pair = token * n_used + slot)
    tiles: object  # int32 (max_tiles, 4): expert, first sorted position, columns, 0 (unused tiles: any)
    n_tiles: object  # int32 (1,): tiles in use
    max_tiles: int
    pairs: int
    n_used: int
    n_expert: int
    cols: int = GROUP_COLS
    # (q8, per_pair, gathered q, gathered meta): the last activations gathered in sorted order,
    # which an MoE's gate and up share (mmvq_experts_grouped)
    gathered: tuple | None = None


PLAN_THREADS = 256  # expert_plan_build's block; must match mmvq_kernels.cuh
_PLAN_SMEM_MAX = 48 * 1024  # dynamic shared memory a launch gets unasked


def plan_in_one_launch(pairs: int, n_expert: int) -> bool:
    """Whether expert_plan builds the plan of this many pairs in one kernel (expert_plan_build),
    which a CUDA graph can hold; else CuPy's array code (a sort), which a graph cannot."""
    return 0 < pairs < 1 << 31 and (2 + PLAN_THREADS // 32) * (n_expert + 1) * 4 <= _PLAN_SMEM_MAX


def expert_plan(expert_ids_dev, n_expert: int, xp=None, cols: int = GROUP_COLS) -> ExpertPlan:
    """ids (ncols, n_used) int32 on the device -> the ExpertPlan of its pairs, tiles of at most
    `cols` pairs. xp: the array module (CuPy unless given; numpy builds the same plan on the
    host, for tests)."""
    cp = xp if xp is not None else _cp()
    ids = cp.asarray(expert_ids_dev, dtype=cp.int32)
    if ids.ndim != 2:
        raise ValueError(f"expert_plan: expert_ids must be (ncols, n_used), got {ids.shape}")
    n_used = int(ids.shape[1])
    flat = ids.reshape(-1)
    pairs = int(flat.size)
    max_tiles = -(-pairs // cols) + n_expert + 1  # each bucket wastes at most one tile
    if xp is None and plan_in_one_launch(pairs, n_expert):
        smem = (2 + PLAN_THREADS // 32) * (n_expert + 1) * 4
        # one launch (mmvq_kernels.cuh, expert_plan_build): the same plan as the array code below
        flat = cp.ascontiguousarray(flat)
        order = cp.empty(pairs, dtype=cp.int64)
        tiles = cp.empty((max_tiles, 4), dtype=cp.int32)
        n_tiles = cp.empty(1, dtype=cp.int32)
        build.plain_function("expert_plan_build")((1,), (PLAN_THREADS,), (
            flat, np.int32(pairs), np.int32(n_expert), np.int32(max_tiles), order, tiles, n_tiles, np.int32(cols)),
            shared_mem=smem)
        return ExpertPlan(order, tiles, n_tiles, max_tiles, pairs, n_used, n_expert, cols)
    bucket = cp.where((flat >= 0) & (flat < n_expert), flat, n_expert)
    # unique keys: the sort is stable whatever the algorithm (pairs of one expert stay in order)
    order = cp.argsort(bucket.astype(cp.int64) * max(1, pairs) + cp.arange(pairs, dtype=cp.int64))
    # bucket edges in the sorted ids (cupy's bincount checks its input on the host: a sync)
    edges = cp.searchsorted(bucket[order], cp.arange(n_expert + 2, dtype=cp.int32), side="left")
    starts, counts = edges[:-1], cp.diff(edges)
    per = (counts + cols - 1) // cols
    ends = cp.cumsum(per)
    t = cp.arange(max_tiles, dtype=cp.int64)
    e = cp.minimum(cp.searchsorted(ends, t, side="right"), n_expert)  # tiles past the end: ignored
    j = t - (ends[e] - per[e])  # tile index within its expert
    tiles = cp.zeros((max_tiles, 4), dtype=cp.int32)
    tiles[:, 0] = e
    tiles[:, 1] = starts[e] + j * cols
    tiles[:, 2] = cp.minimum(cols, counts[e] - j * cols)
    return ExpertPlan(order, tiles, ends[-1:].astype(cp.int32), max_tiles, pairs, n_used, n_expert, cols)


@dataclass
class _GroupedCall:
    """A grouped experts call, checked: its type, matrices, row length, output and sorted activations."""

    t: object  # the GGML type
    m: ExpertMatrices
    k: int
    out: object  # float32 (pairs, rows), pair order
    qg: object = None  # activations in the plan's sorted order (None: no pairs)
    mg: object = None


def _grouped_call(name: str, type_id: int, experts, plan: ExpertPlan, q8: Q8Buffer, per_pair: bool,
                  cols_ok: bool, cols_want: str) -> _GroupedCall:
    """The checks mmvq_experts_grouped and mmq_experts_grouped share (a clear error naming the
    call and what is wrong), the output, and the activations gathered in sorted order."""
    if type_id in FLOAT_TYPES:
        raise ValueError(f"{name}: quantized weights only")
    m = _matrices(experts)
    if m.n_expert != plan.n_expert or not cols_ok:
        raise ValueError(f"{name}: the plan is for {plan.n_expert} experts in tiles of {plan.cols}, "
                         f"the weights have {m.n_expert} (tiles of {cols_want})")
    t, k = _checked(name, type_id, m, q8.k)
    want = plan.pairs if per_pair else plan.pairs // max(1, plan.n_used)
    if q8.ncols != want:
        raise ValueError(f"{name}: {q8.ncols} activation columns, the plan needs {want}")
    call = _GroupedCall(t, m, k, _cp().empty((plan.pairs, m.rows), dtype=_cp().float32))
    if plan.pairs:
        call.qg, call.mg = _gathered(plan, q8, per_pair)
    return call


def _scatter_sorted(sorted_out, plan: ExpertPlan, c: _GroupedCall):
    """The kernel's rows (sorted order) back to pair order in c.out."""
    build.plain_function("scatter_rows")((plan.pairs,), (128,), (sorted_out, plan.order, np.int32(c.m.rows), c.out))
    return c.out


def mmvq_experts_grouped(type_id: int, experts, plan: ExpertPlan, q8: Q8Buffer, per_pair: bool = False):
    """Experts mat-vec for many pairs, one weight pass per tile of pairs sharing an expert; q8
    the quantized activations, one column per token (per_pair=False: a token's n_used experts
    read its column) or one per pair (per_pair=True). -> float32 (pairs, rows) in pair order,
    bitwise what mmvq_experts gives."""
    c = _grouped_call("mmvq_experts_grouped", type_id, experts, plan, q8, per_pair, plan.cols == GROUP_COLS,
                      str(GROUP_COLS))
    if plan.pairs == 0:
        return c.out
    fn = build.named_function(f"mmvq_grouped<{c.t.id}>")
    rows = c.m.rows
    # a few row blocks per tile: many short blocks, several waves (a prefill window is long
    # enough that the tail of the last wave matters less than idle warps in wide blocks)
    rpw = max(RPW, -(-(-(-rows // (WARPS * GROUP_ROW_BLOCKS))) // RPW) * RPW)
    sorted_out = _cp().empty((plan.pairs, rows), dtype=np.float32)
    fn((-(-rows // (rpw * WARPS)), plan.max_tiles), (WARPS * 32,), (
        c.m.table, np.int32(c.m.n_expert), plan.tiles, plan.n_tiles, np.int32(rows),
        np.int32(c.m.row_bytes), np.int32(c.k), np.int32(rpw), c.qg, c.mg, sorted_out))
    return _scatter_sorted(sorted_out, plan, c)


MMQ_ROWS_PER_BLOCK = 128  # mmq_grouped: MMQ_WARPS x MMQ_ROWS (mmvq_kernels.cuh)
MMQ_THREADS = 128  # mmq_grouped's block: MMQ_WARPS x 32


def mmq_geometry(type_id: int) -> tuple[int, int]:
    """(chunks a step, dynamic shared memory bytes) of mmq_grouped<type_id, MMQ_N8>: MmqGeo."""
    t = type_by_id(type_id)
    cpb = t.block_size // QK
    sch = cpb if cpb >= 4 else 4
    slot = (sch // cpb * t.type_size + 46) // 16 * 16
    ncol = 8 * MMQ_N8
    buf = MMQ_ROWS_PER_BLOCK * slot + ncol * (8 * sch + 4) * 4 + ncol * sch * 8
    return sch, 2 * buf


def mmq_supports(type_id: int, k: int) -> bool:
    """Whether mmq_grouped takes rows of k weights of this type on this device: a quantized
    type, whole steps of k, and its two buffers within the device's shared memory per block."""
    if type_id not in QUANT_TYPES:
        return False
    sch, smem = mmq_geometry(type_id)
    if k % (QK * sch):
        return False
    return smem + 16 * 1024 <= build.smem_optin()  # + the static tiles and codebook


def mmq_experts_grouped(type_id: int, experts, plan: ExpertPlan, q8: Q8Buffer, per_pair: bool = False):
    """mmvq_experts_grouped's result on int8 tensor cores (mmq_grouped), on a plan of MMQ_COLS
    columns a tile: the same chunks, scaled the same way, summed in chunk order instead of
    MMVQ's lane order (other bits: for long prompts' rows only). A pair's row depends only on
    its own activations, never on its tile. mmq_supports(type_id, k) must hold."""
    c = _grouped_call("mmq_experts_grouped", type_id, experts, plan, q8, per_pair, plan.cols <= MMQ_COLS,
                      f"at most {MMQ_COLS}")
    if not mmq_supports(c.t.id, c.k):
        raise ValueError(f"mmq_experts_grouped: {c.t.name} rows of {c.k} weights are not taken on this device")
    if plan.pairs == 0:
        return c.out
    _, smem = mmq_geometry(c.t.id)
    fn = _mmq_function(c.t.id, smem)
    rows = c.m.rows
    sorted_out = _cp().empty((plan.pairs, rows), dtype=np.float32)
    fn((-(-rows // MMQ_ROWS_PER_BLOCK), plan.max_tiles), (MMQ_THREADS,), (
        c.m.table, np.int32(c.m.n_expert), plan.tiles, plan.n_tiles, np.int32(rows),
        np.int32(c.m.row_bytes), np.int32(c.k), c.qg, c.mg, sorted_out), shared_mem=smem)
    return _scatter_sorted(sorted_out, plan, c)


def mmq_name(type_id: int) -> str:
    return f"mmq_grouped<{type_id}, {MMQ_N8}>"


@functools.cache
def _mmq_function(type_id: int, smem: int):
    fn = build.named_function(mmq_name(type_id))
    if fn.shared_size_bytes + smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem  # past the 48 KB a launch gets unasked
    return fn


def _gathered(plan: ExpertPlan, q8: Q8Buffer, per_pair: bool):
    """q8's rows in the plan's sorted order, + plan.cols zero rows a tile may read past its
    columns (not stored); made once for the gate and the up that read the same activations."""
    g = plan.gathered
    if g is not None and g[0] is q8 and g[1] == per_pair:
        return g[2], g[3]
    cp, k = _cp(), q8.k
    total = plan.pairs + plan.cols
    qg = cp.empty((total, k), dtype=cp.int8)
    mg = cp.empty((total, k // QK, 2), dtype=cp.int32)
    q, meta = cp.ascontiguousarray(q8.q), cp.ascontiguousarray(q8.meta)
    build.plain_function("gather_q8_rows")((total,), (128,), (
        q, meta, plan.order, np.int32(1 if per_pair else plan.n_used), np.int32(plan.pairs), np.int32(k), qg, mg))
    plan.gathered = (q8, per_pair, qg, mg)
    return qg, mg
