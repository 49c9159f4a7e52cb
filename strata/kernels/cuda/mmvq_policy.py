"""Which MMVQ kernel instance and launch shape a matrix gets: a pure policy.

Device facts (SMs, shared memory, PDL, the resident warps of an instance) and the benchmark knobs
go in, a `Launch` comes out; nothing here touches a GPU or the environment, so the rules are
testable on the CPU (tests/test_mmvq_policy.py), as llama.cpp's ggml_cuda_should_use_mmq is.
No rule changes a result's bits: every instance adds a row's chunks in the same order
(mmvq_kernels.cuh, stream_rows), so the rules choose speed only. Timings quoted are H200 us.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from strata.kernels.ggml_types import BY_NAME, type_by_id

MAX_COLS = 8  # columns per launch (llama.cpp's MMVQ_MAX_BATCH_SIZE)
QK = 32  # activation block
WARPS = 4  # warps (rows) per thread block; must match mmvq_kernels.cuh
RPW = 4  # rows a warp works on together; must match mmvq_kernels.cuh

QUANT_TYPE_NAMES = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0", "Q2_0",
)
FLOAT_TYPE_NAMES = ("F32", "F16", "BF16")
QUANT_TYPES = tuple(BY_NAME[n].id for n in QUANT_TYPE_NAMES)
FLOAT_TYPES = tuple(BY_NAME[n].id for n in FLOAT_TYPE_NAMES)
# Types decoded through a 16-entry int8 codebook (lut16_pairs / lut16x8, 4-bit codes): the
# kernels (LUT16, generated from this) and decode_heavy both treat them apart.
LOOKUP_4BIT = tuple(BY_NAME[n].id for n in ("IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4"))
# mmvq_wide's warps per block by type (a codebook copy per lane, one block per SM); the kernels'
# WideWarps and WIDE_SMEM_MAX are generated from the knobs (mmvq_build.source).
WIDE_WARPS = {BY_NAME["IQ3_XXS"].id: 24, BY_NAME["IQ3_S"].id: 16}
WIDE_SMEM = 200 * 1024
WIDE_MIN_BYTES = 16 << 20  # few long rows (groups of 2) from here
WIDE_ANY_BYTES = 64 << 20  # any matrix from here
# Types whose one column takes the lean instance where takes_lean's rule applies: those it was
# measured to help at 14336 x 4096 (Q4_K 10.6 -> 9.8 us, IQ4_NL 13.7 -> 12.2, ...); it lost 2-8%
# on Q2_0, Q2_K, Q3_K, Q5_0, IQ3_XXS, TQ1_0 and TQ2_0.
LEAN_NAMES = "Q4_0,Q4_K,Q5_K,Q6_K,IQ2_XS,IQ2_S,IQ3_S,IQ1_S,IQ1_M,IQ4_NL,IQ4_XS,MXFP4,NVFP4"
GROUP2_BYTES = 6 << 20  # group_rows: matrices from this size may take groups of 2 rows
LOW_BIT_BYTES_PER_32 = 18  # 4.5 bits per weight: decode_heavy types are below it

# Pipeline macros a benchmark may set (bench/bench_mmvq.py; the defaults are the measured best).
BUILD_KNOBS = {"STRATA_MMVQ_IN_FLIGHT": "IN_FLIGHT", "STRATA_MMVQ_TILE_MAX": "TILE_MAX",
               "STRATA_MMVQ_CPL_MAX": "CPL_MAX", "STRATA_MMVQ_WIDE_MIN_BLOCKS": "WIDE_MIN_BLOCKS",
               "STRATA_MMVQ_NARROW_MIN_BLOCKS": "NARROW_MIN_BLOCKS", "STRATA_MMVQ_SIGN_RAW": "SIGN_RAW",
               "STRATA_MMVQ_LEAN_STAGES": "LEAN_STAGES", "STRATA_MMVQ_PLANES_RAW": "PLANES_RAW"}


@dataclass(frozen=True)
class Knobs:
    """Benchmark settings (STRATA_MMVQ_*); the defaults are what the engine runs."""

    wide_warps: dict = field(default_factory=lambda: dict(WIDE_WARPS))  # type id -> mmvq_wide warps
    wide_smem: int = WIDE_SMEM  # mmvq_wide's dynamic shared memory
    wide: bool = True  # mmvq_wide where the rule takes it (False: the 8-copy kernel)
    lean_types: tuple[int, ...] = tuple(BY_NAME[n].id for n in LEAN_NAMES.split(","))
    lean: bool | None = None  # the lean instance wherever it can run (True), never (False), by rule (None)
    rows_per_warp: int | None = None  # a forced rows-per-warp count (keeps the default instance)
    aligned: bool = True  # the 16-byte aligned instances where rows allow (False: the general ones)
    defines: tuple[str, ...] = ()  # -DMACRO=n compiler options (BUILD_KNOBS)


def read_knobs(env: Mapping[str, str]) -> Knobs:
    """The knobs an environment sets (mmvq_build reads os.environ once, at import)."""
    forced_warps = int(env.get("STRATA_MMVQ_WIDE_WARPS") or 0)
    lean = env.get("STRATA_MMVQ_LEAN")
    return Knobs(
        wide_warps={t: forced_warps or w for t, w in WIDE_WARPS.items()},
        wide_smem=int(env.get("STRATA_MMVQ_WIDE_SMEM") or WIDE_SMEM),
        wide=env.get("STRATA_MMVQ_WIDE") != "0",
        lean_types=tuple(BY_NAME[n].id for n in (env.get("STRATA_MMVQ_LEAN_TYPES") or LEAN_NAMES).split(",")),
        lean={"0": False, "1": True}.get(lean or ""),
        rows_per_warp=int(env["STRATA_MMVQ_ROWS_PER_WARP"]) if env.get("STRATA_MMVQ_ROWS_PER_WARP") else None,
        aligned=env.get("STRATA_MMVQ_ALIGNED") != "0",
        defines=tuple(f"-D{macro}={int(env[name])}" for name, macro in BUILD_KNOBS.items() if env.get(name)),
    )


@dataclass(frozen=True)
class DeviceFacts:
    """What the policy needs to know of the GPU: its SMs, the shared memory a block may opt in
    to, whether launches use programmatic dependent launch (sm_90+), and how many warps of a
    kernel instance (type id, name) stay resident on the whole device at once."""

    sm_count: int
    smem_optin: int
    pdl: bool
    resident: Callable[[int, str], int]


@dataclass(frozen=True)
class Launch:
    """One launch of a quantized mmvq: its first column, kernel instance, rows per warp, grid,
    block and dynamic shared memory."""

    c0: int
    name: str
    rpw: int
    grid: tuple
    block: tuple = (WARPS * 32,)
    smem: int = 0


# ------------------------------------------------------------------ instance names
def mmvq_name(type_id: int, nc: int, aligned: bool = False, group: int = RPW, lean: bool = False) -> str:
    if aligned and nc == 1:
        if lean:
            return f"mmvq<{type_id}, 1, true, {group}, true>"
        return f"mmvq<{type_id}, 1, true>" if group == RPW else f"mmvq<{type_id}, 1, true, {group}>"
    return f"mmvq<{type_id}, {nc}>"


def wide_name(type_id: int, aligned: bool, group: int = RPW) -> str:
    return f"mmvq_wide<{type_id}, {'true' if aligned else 'false'}, {group}>"


def ids_name(type_id: int, aligned: bool = False) -> str:
    return f"mmvq_ids<{type_id}, true>" if aligned else f"mmvq_ids<{type_id}>"


def pair_name(id1: int, id2: int, aligned: bool = False) -> str:
    return f"mmvq_ids_pair<{id1}, {id2}, true>" if aligned else f"mmvq_ids_pair<{id1}, {id2}>"


def dynamic_smem(knobs: Knobs, name: str) -> int:
    return knobs.wide_smem if name.startswith("mmvq_wide<") else 0


# ------------------------------------------------------------------ rules
def decode_heavy(type_id: int) -> bool:
    """Types with much decode work per byte (below 4.5 bits per weight, and the 4-bit lookup
    types): one column runs RPW rows per warp past one wave, more warps hiding the decode's
    latency (14336 x 4096: Q2_K 12.2 -> 11.0 us, IQ3_S 19.3 -> 17.8; Q8_0 loses: 19.0 -> 21.6)."""
    if type_id in FLOAT_TYPES:
        return False
    t = type_by_id(type_id)
    return t.type_size * 32 < LOW_BIT_BYTES_PER_32 * t.block_size or type_id in LOOKUP_4BIT


def rows_per_warp(facts: DeviceFacts, knobs: Knobs, type_id: int, name: str, rows: int, npairs: int = 1,
                  resident: int | None = None, one_column: bool = False) -> int:
    """Rows per warp: a multiple of RPW, few enough warps to stay resident in one wave; RPW for
    one column of a decode-heavy type, or of any quantized type under PDL (there the one-wave
    rule left slots the next launch's blocks filled early: 57344 x 8192 Q4_K 72.4 -> 65.3 us)."""
    if knobs.rows_per_warp is not None:
        per = knobs.rows_per_warp
    elif one_column and (decode_heavy(type_id) or (type_id not in FLOAT_TYPES and facts.pdl)):
        per = RPW
    else:
        per = -(-rows * npairs // (resident or facts.resident(type_id, name)))
    return max(RPW, -(-per // RPW) * RPW)


def split_columns(facts: DeviceFacts, knobs: Knobs, type_id: int, rows: int, ncols: int,
                  aligned: bool = False) -> tuple[str, int, int] | None:
    """(the 1-column kernel, its rows per warp, its blocks per column) where `ncols` columns of a
    small matrix should run as one launch with a grid row per column, else None: taken while a
    column's blocks cover at most half the SMs and all columns' warps fit one wave (576 rows,
    4 columns: 3.24 -> 2.41 us; 192 blocks a column lose: 3.09 -> 3.26)."""
    if ncols < 2 or type_id in FLOAT_TYPES:
        return None
    name = mmvq_name(type_id, 1, aligned)
    rpw = rows_per_warp(facts, knobs, type_id, name, rows)
    bx = -(-rows // (rpw * WARPS))
    fits = 2 * bx <= facts.sm_count and bx * ncols * WARPS <= facts.resident(type_id, name)
    return (name, rpw, bx) if fits else None


def column_groups(ncols: int) -> list[tuple[int, int, int]]:
    """(first column, columns per group, groups): whole groups of MAX_COLS, then the rest."""
    full, rest = divmod(ncols, MAX_COLS)
    return [(c0, nc, g) for c0, nc, g in ((0, MAX_COLS, full), (full * MAX_COLS, rest, 1)) if nc and g]


def group_rows(rows: int, resident: int, matrix_bytes: int) -> int:
    """Rows a warp works on together at one column: RPW, or 2 where groups of RPW would leave
    over a quarter of the device's warp slots empty on a matrix of at least GROUP2_BYTES (few
    long rows, an FFN down projection: 4096 x 14336 Q6_K 29.0 -> 18.1 us; small ones lose)."""
    if matrix_bytes >= GROUP2_BYTES and 4 * rows < 3 * RPW * resident:
        return 2
    return RPW


def takes_lean(facts: DeviceFacts, knobs: Knobs, type_id: int, rows: int, resident: int) -> bool:
    """Whether one column of aligned rows runs the lean instance (smaller tiles, 2 stages, more
    resident blocks): a LEAN type under PDL whose row groups need more than one wave of the
    default instance and fit one of the lean one (14336 rows Q4_K 11.0 -> 9.8 us; larger
    matrices run several waves either way and keep the default's larger tiles). resident: the
    default instance's resident warps. A forced rows-per-warp count keeps the default."""
    if knobs.lean is not None or knobs.rows_per_warp is not None:
        return bool(knobs.lean)
    if type_id not in knobs.lean_types or not facts.pdl:
        return False
    warps = -(-rows // RPW)
    return resident < warps <= facts.resident(type_id, mmvq_name(type_id, 1, True, lean=True))


def wide_ok(facts: DeviceFacts, knobs: Knobs) -> bool:
    """Whether the device lets a block have mmvq_wide's shared memory (sm_90, sm_100 parts)."""
    return knobs.wide and facts.smem_optin >= knobs.wide_smem


def takes_wide(facts: DeviceFacts, knobs: Knobs, type_id: int, matrix_bytes: int, group: int) -> bool:
    """Whether one column of this IQ3 matrix runs mmvq_wide: from WIDE_MIN_BYTES in groups of 2,
    any from WIDE_ANY_BYTES (IQ3_S 57344 x 8192 84.6 -> 69.5 us); smaller ones lose (one block
    per SM leaves PDL nothing to overlap)."""
    if type_id not in knobs.wide_warps or matrix_bytes < WIDE_MIN_BYTES or not wide_ok(facts, knobs):
        return False
    return group < RPW or matrix_bytes >= WIDE_ANY_BYTES


def wide_shape(sm_count: int, rows: int, group: int, most_warps: int) -> tuple[int, int, int]:
    """(rows per warp, warps per block, blocks) of mmvq_wide: one block per SM for one wave,
    every warp whole groups of `group` rows; of most_warps down to half as many warps per block,
    the count keeping the most slots busy (the most warps where several come within 2%)."""
    groups = -(-rows // group)
    best = None
    for warps in range(most_warps, most_warps // 2 - 1, -1):
        rounds = -(-groups // (sm_count * warps))
        busy = groups / (rounds * sm_count * warps)
        if best is None or busy > best[0] + 0.02:
            best = (busy, warps, rounds)
    _, warps, rounds = best
    rpw = rounds * group
    return rpw, warps, -(-rows // (rpw * warps))


def column_launches(facts: DeviceFacts, knobs: Knobs, type_id: int, rows: int, ncols: int, split: bool = True,
                    aligned: bool = False, k: int = 0) -> list[Launch]:
    """The launches of a quantized mmvq over `ncols` columns: whole groups of MAX_COLS columns in
    one launch (grid y), the rest in another; or, for a small matrix (split_columns), every
    column a grid row of the 1-column kernel. k (weights per row) lets one column of a large
    matrix take groups of 2 rows (group_rows), the lean instance or mmvq_wide; 0 keeps RPW."""
    one = split_columns(facts, knobs, type_id, rows, ncols, aligned) if split else None
    if one is not None:
        name, rpw, bx = one
        return [Launch(0, name, rpw, (bx, ncols))]
    out = []
    matrix_bytes = rows * type_by_id(type_id).row_bytes(k) if k else 0
    for c0, nc, groups in column_groups(ncols):
        name = mmvq_name(type_id, nc, aligned)
        rpw = rows_per_warp(facts, knobs, type_id, name, rows, one_column=nc == 1)
        group = RPW
        if nc == 1 and aligned and k:
            resident = facts.resident(type_id, name)
            group = group_rows(rows, resident, matrix_bytes)
            if group < RPW:
                name, rpw = mmvq_name(type_id, 1, True, group), group
            elif takes_lean(facts, knobs, type_id, rows, resident):
                name, rpw = mmvq_name(type_id, 1, True, lean=True), RPW
        if nc == 1 and k and takes_wide(facts, knobs, type_id, matrix_bytes, group):
            rpw, warps, blocks = wide_shape(facts.sm_count, rows, group, knobs.wide_warps[type_id])
            out.append(Launch(c0, wide_name(type_id, aligned, group), rpw, (blocks, groups), (warps * 32,),
                              knobs.wide_smem))
            continue
        out.append(Launch(c0, name, rpw, (-(-rows // (rpw * WARPS)), groups)))
    return out
