"""Native quantized mat-vec (MMVQ) on NVIDIA GPUs through CuPy.

Weights stay in their GGUF block layout on the device (uploaded once, never dequantized);
activations are quantized on the GPU to Q8_1-style blocks of 32 (int8 q, float32 d and s,
exactly strata.kernels.activation_quant's math), and one launch multiplies up to MAX_COLS
columns. The CUDA C++ lives in *.cuh beside this file and is compiled at first use of a type
with NVRTC (cupy.RawModule; CuPy caches the binaries on disk).

    quantize_q8_1(x_dev) -> Q8Buffer
    mmvq(type_id, w_dev, rows, k, x_dev, out=None) -> (ncols, rows) float32 cupy array
    mmvq_experts(type_id, w_dev, expert_ids_dev, x_dev, out=None) -> (ncols, n_used, rows)
    mmvq_experts_grouped(type_id, w_dev, expert_plan(ids, n_expert), q8) -> (pairs, rows)  (prefill)
    supported_types() -> tuple of GGML type ids;  register(table): fill the native kernel table
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.kernels.cuda import launch as pdl
from strata.kernels.cuda.launch import launch
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
# kernels (LUT16, generated from this) and the launch rule below both treat them apart.
LOOKUP_4BIT = tuple(BY_NAME[n].id for n in ("IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4"))
# One column of these IQ3 types runs mmvq_wide (mmvq_kernels.cuh: a codebook copy per lane, up
# to WIDE_WARPS[type] warps per block, WIDE_SMEM bytes of dynamic shared memory, one block per
# SM) on the matrices _takes_wide names, where the device lets a block have that much shared
# memory (sm_90 and sm_100 datacenter parts; not an sm_89 card, which keeps mmvq). The kernels'
# WideWarps and WIDE_SMEM_MAX are generated from these (_source).
_WIDE_FORCED = int(os.environ.get("STRATA_MMVQ_WIDE_WARPS") or 0)  # benchmarks only
WIDE_WARPS = {BY_NAME[n].id: _WIDE_FORCED or w for n, w in (("IQ3_XXS", 24), ("IQ3_S", 16))}
WIDE_TYPES = tuple(WIDE_WARPS)
WIDE_SMEM = int(os.environ.get("STRATA_MMVQ_WIDE_SMEM") or 200 * 1024)
WIDE_MIN_BYTES = 16 << 20  # few long rows (groups of 2) from here
WIDE_ANY_BYTES = 64 << 20  # any matrix from here
# Types whose one column takes the lean instance where _takes_lean's rule applies: those it was
# measured to help at 14336 x 4096 (us, default -> lean, the lean instance with 2 stages):
# Q4_K 10.6 -> 9.8, IQ4_NL 13.7 -> 12.2, Q5_K 14.0 -> 12.0, MXFP4 14.8 -> 12.3, NVFP4 14.3 ->
# 12.6, IQ4_XS 14.8 -> 13.1, IQ2_XS 14.5 -> 12.9, IQ2_S 16.8 -> 15.0, IQ1_M 15.1 -> 13.6, IQ1_S
# 14.0 -> 13.0, IQ3_S 13.3 -> 12.4, Q6_K 16.1 -> 15.4, Q4_0 11.0 -> 10.6. It lost on Q2_0, Q2_K,
# Q3_K, Q5_0, IQ3_XXS, TQ1_0 and TQ2_0 (2-8%); the other types' lean instances keep no more warps
# resident than their default ones, so the rule never takes them.
_LEAN_NAMES = "Q4_0,Q4_K,Q5_K,Q6_K,IQ2_XS,IQ2_S,IQ3_S,IQ1_S,IQ1_M,IQ4_NL,IQ4_XS,MXFP4,NVFP4"
LEAN_TYPES = tuple(BY_NAME[n].id for n in (os.environ.get("STRATA_MMVQ_LEAN_TYPES") or _LEAN_NAMES).split(","))  # env: benchmarks only

_HERE = Path(__file__).parent
# Pipeline knobs a benchmark may try (bench/bench_mmvq.py; the defaults are the measured best).
_KNOBS = {"STRATA_MMVQ_IN_FLIGHT": "IN_FLIGHT", "STRATA_MMVQ_TILE_MAX": "TILE_MAX", "STRATA_MMVQ_CPL_MAX": "CPL_MAX",
          "STRATA_MMVQ_WIDE_MIN_BLOCKS": "WIDE_MIN_BLOCKS", "STRATA_MMVQ_NARROW_MIN_BLOCKS": "NARROW_MIN_BLOCKS",
          "STRATA_MMVQ_SIGN_RAW": "SIGN_RAW", "STRATA_MMVQ_LEAN_STAGES": "LEAN_STAGES",
          "STRATA_MMVQ_PLANES_RAW": "PLANES_RAW"}
_OPTIONS = ("--use_fast_math", "-std=c++17") + tuple(
    f"-D{macro}={int(os.environ[env])}" for env, macro in _KNOBS.items() if os.environ.get(env))
_lock = threading.Lock()


def supported_types() -> tuple[int, ...]:
    return QUANT_TYPES + FLOAT_TYPES


def _cp():
    import cupy

    return cupy


@functools.cache
def _source() -> str:
    from strata.kernels.cuda.tables import table_source

    files = ("pdl.cuh", "mmvq_common.cuh", "mmvq_decode.cuh", "mmvq_kernels.cuh")
    pdl, common, decode, kernels = ((_HERE / f).read_text() for f in files)
    lut16 = " || ".join(f"ID == {t}" for t in LOOKUP_4BIT)
    lut16 = f"template <int ID> struct LUT16 {{ static constexpr bool YES = {lut16}; }};\n"
    wide = "".join(f"ID == {t} ? {w} : " for t, w in WIDE_WARPS.items())
    wide = (f"template <int ID> struct WideWarps {{ static constexpr int N = {wide}0; }};\n"
            f"#define WIDE_SMEM_MAX {WIDE_SMEM}\n")
    return pdl + common + table_source() + decode + lut16 + wide + kernels


def _names(type_id: int) -> list[str]:
    if type_id in FLOAT_TYPES:
        return [f"mmvf<{type_id}, {nc}>" for nc in range(1, MAX_COLS + 1)] + [f"mmvf_ids<{type_id}>"]
    return ([_mmvq_name(type_id, nc) for nc in range(1, MAX_COLS + 1)] + [_mmvq_name(type_id, 1, True)]
            + [_ids_name(type_id, a) for a in (False, True)])


# Rows that start on 16-byte boundaries (the weights 16-aligned, row_bytes a multiple of 16: most
# real matrices) have kernel instances of their own for one column (decode, experts): their tile
# copies need no alignment arithmetic (mmvq_kernels.cuh, A16).
def rows_aligned(w_dev, row_bytes: int) -> bool:
    if os.environ.get("STRATA_MMVQ_ALIGNED") == "0":  # benchmarks only: the general instances
        return False
    return row_bytes % 16 == 0 and w_dev.data.ptr % 16 == 0


def _mmvq_name(type_id: int, nc: int, aligned: bool = False, group: int = RPW, lean: bool = False) -> str:
    if aligned and nc == 1:
        if lean:
            return f"mmvq<{type_id}, 1, true, {group}, true>"
        return f"mmvq<{type_id}, 1, true>" if group == RPW else f"mmvq<{type_id}, 1, true, {group}>"
    return f"mmvq<{type_id}, {nc}>"


def _wide_name(type_id: int, aligned: bool, group: int = RPW) -> str:
    return f"mmvq_wide<{type_id}, {'true' if aligned else 'false'}, {group}>"


@functools.cache
def _wide_ok() -> bool:
    if os.environ.get("STRATA_MMVQ_WIDE") == "0":  # benchmarks only: the 8-copy kernel
        return False
    return int(_cp().cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]) >= WIDE_SMEM


def _dynamic_smem(name: str) -> int:
    return WIDE_SMEM if name.startswith("mmvq_wide<") else 0


def _ids_name(type_id: int, aligned: bool = False) -> str:
    return f"mmvq_ids<{type_id}, true>" if aligned else f"mmvq_ids<{type_id}>"


_modules: dict[int, object] = {}


def _module(type_id: int):
    """The compiled module of one type (all column counts + the experts kernel)."""
    mod = _modules.get(type_id)
    if mod is None:
        cp = _cp()
        mod = cp.RawModule(code=_source(), options=_OPTIONS, name_expressions=_names(type_id))
        mod.compile()
        with _lock:
            _modules[type_id] = mod
    return mod


@functools.cache
def _plain_module():
    """The module of the extern "C" kernels: activation quantization, and prefill's experts
    plan, sorted-activation gather and row scatter."""
    return _cp().RawModule(code=_source(), options=_OPTIONS)


def _quant_kernel():
    return _plain_function("quantize_q8_1")


@functools.cache
def _plain_function(name: str):
    return _plain_module().get_function(name)


def compile_all(type_ids=None, threads: int = 8) -> None:
    """Compile the modules of several types at once (NVRTC runs outside the GIL)."""
    ids = [t for t in (type_ids or supported_types()) if t not in _modules]
    _quant_kernel()
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        list(pool.map(_module, ids))


@functools.cache
def _function(type_id: int, name: str):
    if name in _names(type_id):
        fn = _module(type_id).get_function(name)
    else:
        fn = _named_function(name)  # the rarer instances (fewer rows per group) compile apart
    dyn = _dynamic_smem(name)
    if dyn:
        fn.max_dynamic_shared_size_bytes = dyn  # past the 48 KB a launch gets unasked
    return fn


# ------------------------------------------------------------------ activations
@dataclass
class Q8Buffer:
    """Quantized activations on the device: q int8 (ncols, k); meta (ncols, k/32, 2) int32
    records of float32 d and the two 16-value int16 sums of q packed (what the kernels read);
    s float32 (ncols, k/32) = d * sum(q) (activation_quant's s, for callers)."""

    q: object
    meta: object
    s: object
    ncols: int
    k: int

    @property
    def d(self):
        return self.meta.view(_cp().float32)[..., 0]


def empty_q8(ncols: int, k: int) -> Q8Buffer:
    cp = _cp()
    return Q8Buffer(cp.empty((ncols, k), dtype=cp.int8), cp.empty((ncols, k // QK, 2), dtype=cp.int32),
                    cp.empty((ncols, k // QK), dtype=cp.float32), ncols, k)


def quantize_q8_1(x_dev, out: Q8Buffer | None = None) -> Q8Buffer:
    """float32 (ncols, k) or (k,) device array -> Q8Buffer (k a multiple of 32)."""
    cp = _cp()
    x = cp.ascontiguousarray(cp.asarray(x_dev, dtype=cp.float32))
    if x.ndim == 1:
        x = x[None, :]
    ncols, k = x.shape
    if k % QK:
        raise ValueError(f"quantize_q8_1: row length {k} is not a multiple of {QK}")
    buf = out if out is not None else empty_q8(ncols, k)
    nblocks = ncols * (k // QK)
    if nblocks:
        threads = 256
        grid = (nblocks * 32 + threads - 1) // threads
        launch(_quant_kernel(), (grid,), (threads,), (x, np.int32(nblocks), buf.q, buf.meta, buf.s))
    return buf


# ------------------------------------------------------------------ launches
@functools.cache
def _resident_warps(type_id: int, name: str) -> int:
    return _resident_warps_of(_function(type_id, name))


def _resident_warps_of(fn) -> int:
    """Warps of this kernel that stay resident on the whole device at once (occupancy from
    its registers and shared memory), so a grid of that many warps runs in one wave."""
    cp = _cp()
    attrs = cp.cuda.Device().attributes
    regs_per_warp = -(-fn.num_regs * 32 // 256) * 256
    by_regs = attrs["MaxRegistersPerMultiprocessor"] // max(1, regs_per_warp * WARPS)
    by_smem = attrs["MaxSharedMemoryPerMultiprocessor"] // (fn.shared_size_bytes + 1024)
    by_threads = attrs["MaxThreadsPerMultiProcessor"] // (WARPS * 32)
    per_sm = max(1, min(by_regs, by_smem, by_threads, 32))
    return attrs["MultiProcessorCount"] * per_sm * WARPS


def _rows_per_warp(type_id: int, name: str, rows: int, npairs: int = 1, resident: int | None = None,
                   one_column: bool = False) -> int:
    """Rows per warp: a multiple of RPW, few enough warps to stay resident in one wave; RPW for
    one column of a decode-heavy type, or of any type where graphs launch with PDL (below)."""
    forced = os.environ.get("STRATA_MMVQ_ROWS_PER_WARP")  # benchmarks only (bench_mmvq.py)
    if forced:
        per = int(forced)
    elif one_column and (_decode_heavy(type_id) or (type_id not in FLOAT_TYPES and pdl.enabled())):
        per = RPW
    else:
        per = -(-rows * npairs // (resident or _resident_warps(type_id, name)))
    return max(RPW, -(-per // RPW) * RPW)


@functools.cache
def _named_function(name: str):
    """One kernel instance compiled on first use in a module of its own (kernels that only
    some packs or windows need stay out of the per-type modules)."""
    mod = _cp().RawModule(code=_source(), options=_OPTIONS, name_expressions=[name])
    mod.compile()
    return mod.get_function(name)


def _pair_function(id1: int, id2: int, aligned: bool = False):
    """mmvq_ids_pair<id1, id2>: gate and up experts of two types in one launch."""
    return _named_function(f"mmvq_ids_pair<{id1}, {id2}, true>" if aligned else f"mmvq_ids_pair<{id1}, {id2}>")


def _weights(type_id: int, w_dev, k: int):
    cp = _cp()
    t = type_by_id(type_id)
    if t is None or type_id not in supported_types():
        raise ValueError(f"mmvq: no CUDA kernel for GGML type {t.name if t else type_id}")
    if k <= 0 or k % t.block_size or (t.quantized and k % QK):
        raise ValueError(f"mmvq: {t.name} rows of {k} weights are not whole blocks")
    w = cp.asarray(w_dev)
    if w.dtype != cp.uint8:
        w = w.view(cp.uint8) if w.flags.c_contiguous else cp.ascontiguousarray(w).view(cp.uint8)
    if not w.flags.c_contiguous or w.data.ptr % 16:
        w = cp.ascontiguousarray(w).copy()  # kernels read aligned 4- and 16-byte pieces
    return t, w


def _check_matrix_bytes(what: str, rows: int, row_bytes: int) -> None:
    """The kernels address a matrix by 32-bit byte offsets (fewer registers than 64-bit row
    pointers: more resident warps); an expert's matrix is addressed from its own start."""
    if rows * row_bytes >= 1 << 32:
        raise ValueError(f"{what}: a matrix of {rows} rows x {row_bytes} bytes is 4 GiB or more")


def _columns(x_dev):
    cp = _cp()
    x = cp.asarray(x_dev, dtype=cp.float32)
    if x.ndim == 1:
        x = x[None, :]
    return cp.ascontiguousarray(x)


def split_columns(type_id: int, rows: int, ncols: int, aligned: bool = False) -> tuple[str, int, int] | None:
    """The 1-column kernel, its rows per warp and its blocks per column, where `ncols` columns
    of a small matrix should run as one launch with a grid row per column; else None.

    A small matrix (the test model's 576 rows make 36 thread blocks) leaves most SMs idle, and
    the launch takes its latency: one warp looping over 4 or 8 columns takes ~1.5x / 2x as long
    as over one. With a grid row per column every column runs at once, each block reading the
    (L2-resident) rows again. Taken while all the columns' warps fit on the device in one wave;
    a larger matrix keeps the many-column kernel (each weight byte read once).

    Measured on the H200 (bench/probes/gpu_kernel_profile.py, Q4_1 rows of 576 or 1536 weights): 36
    and 60 blocks per column gain (4 columns 3.24 -> 2.41 us, 2.72 -> 2.20), 192 lose a little
    (3.09 -> 3.26): so a column's blocks must cover at most half the SMs. A column's sum is the
    same either way (stream_rows adds columns independently, every rounding spelled out), so
    the choice never changes a result's bits."""
    if ncols < 2 or type_id in FLOAT_TYPES:
        return None
    name = _mmvq_name(type_id, 1, aligned)
    rpw = _rows_per_warp(type_id, name, rows)
    bx = -(-rows // (rpw * WARPS))
    fits = 2 * bx <= _sm_count() and bx * ncols * WARPS <= _resident_warps(type_id, name)
    return (name, rpw, bx) if fits else None


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


def column_launches(type_id: int, rows: int, ncols: int, split: bool = True,
                    aligned: bool = False, k: int = 0) -> list[Launch]:
    """The launches (Launch) of a quantized mmvq over `ncols` columns. Whole groups of MAX_COLS
    columns in one launch (grid y), the rest in another; or, for a small matrix (split_columns),
    every column a grid row of the 1-column kernel. k (weights per row) lets one column of a
    large matrix of few rows take groups of 2 rows (_group_rows), and an IQ3 matrix mmvq_wide
    (_takes_wide); 0 keeps RPW and mmvq. CudaBackend caches these per weight and column count."""
    one = split_columns(type_id, rows, ncols, aligned) if split else None
    if one is not None:
        name, rpw, bx = one
        return [Launch(0, name, rpw, (bx, ncols))]
    out = []
    for c0, nc, groups in _column_groups(ncols):
        name = _mmvq_name(type_id, nc, aligned)
        rpw = _rows_per_warp(type_id, name, rows, one_column=nc == 1)
        group = RPW
        matrix_bytes = rows * type_by_id(type_id).row_bytes(k) if k else 0
        if nc == 1 and aligned and k:
            resident = _resident_warps(type_id, name)
            group = _group_rows(rows, resident, matrix_bytes)
            if group < RPW:
                name, rpw = _mmvq_name(type_id, 1, True, group), group
            elif _takes_lean(type_id, rows, resident):
                name, rpw = _mmvq_name(type_id, 1, True, lean=True), RPW
        if nc == 1 and k and _takes_wide(type_id, matrix_bytes, group):
            rpw, warps, blocks = _wide_shape(rows, group, WIDE_WARPS[type_id])
            out.append(Launch(c0, _wide_name(type_id, aligned, group), rpw, (blocks, groups), (warps * 32,), WIDE_SMEM))
            continue
        out.append(Launch(c0, name, rpw, (-(-rows // (rpw * WARPS)), groups)))
    return out


def _takes_lean(type_id: int, rows: int, resident: int) -> bool:
    """Whether one column of aligned rows runs the lean instance (mmvq_kernels.cuh, LEAN: smaller
    tiles and 2 stages, registers held for more resident blocks): for a type of LEAN_TYPES, under
    PDL (where it was measured: rows in groups of RPW, one warp each), when its row groups need
    more than one wave of the default instance and fit one of the lean one. On the H200, 14336
    rows (us, default -> lean with 3 stages): Q4_K 11.0 -> 10.5 (72 -> 75-76% of copy),
    IQ4_NL 14.6 -> 13.6; with 2 stages 9.8 (80-81%) and 12.2 (64-65%), and more types
    gain (LEAN_TYPES). Larger matrices run several waves either way, and there the default's
    larger tiles win (57344 x 8192: Q4_K 64.3 -> 65.9, IQ4_NL 75.5 -> 81.0). resident: the
    default instance's resident warps."""
    # benchmarks only: STRATA_MMVQ_LEAN "1" wherever it can run, "0" never; a forced rows-per-warp
    # count (_rows_per_warp) keeps the default instance, which takes any count
    forced = os.environ.get("STRATA_MMVQ_LEAN")
    if forced in ("0", "1") or os.environ.get("STRATA_MMVQ_ROWS_PER_WARP"):
        return forced == "1"
    if type_id not in LEAN_TYPES or not pdl.enabled():
        return False
    warps = -(-rows // RPW)
    return resident < warps <= _resident_warps(type_id, _mmvq_name(type_id, 1, True, lean=True))


def _takes_wide(type_id: int, matrix_bytes: int, group: int) -> bool:
    """Whether one column of this matrix runs mmvq_wide. Measured on the H200 (us,
    mmvq -> mmvq_wide): IQ3_S 57344 x 8192 84.6 -> 69.5, 28672 x 8192 43.5 -> 40.9, 4096 x 14336
    (groups of 2) 16.1 -> 13.9; IQ3_XXS 4096 x 14336 18.5 -> 13.8, 28672 and 57344 x 8192 equal.
    Where it loses: 14336 x 4096 (25 MB in groups of 4) IQ3_S 13.3 -> 13.4, IQ3_XXS 12.5 -> 13.2;
    4096 x 4096 IQ3_S 5.2 -> 6.2; 1024 x 4096 3.1 -> 3.6, 2.9 -> 3.8: with one block per SM the
    next launch's blocks cannot come in early (PDL), and a short launch is mostly ramp. In decode
    (a 70B-class llama with IQ3_S FFN, 8 layers, B=1): 566-572 tok/s with it, 491-540
    without."""
    if type_id not in WIDE_TYPES or matrix_bytes < WIDE_MIN_BYTES or not _wide_ok():
        return False
    return group < RPW or matrix_bytes >= WIDE_ANY_BYTES


def _wide_shape(rows: int, group: int, most_warps: int) -> tuple[int, int, int]:
    """(rows per warp, warps per block, blocks) of mmvq_wide: one block per SM for one wave
    (a block after it would copy the codebook again), every warp whole groups of `group` rows.
    With a block's warps fixed, the last round of groups may leave many warps idle (28672 rows
    in groups of 4 over 132 x 16 warps: 4 rounds, 85% of the slots busy); of most_warps down to
    half as many warps per block, the count that keeps the most slots busy is taken (14 there:
    97%), the most warps where several come within 2%. Fewer warps hide less latency (57344 x
    8192 IQ3_S at 14 warps, 97% busy: 80 us against 16's 69.6), and more than 16 cost the
    compiler registers (20 or 22: 74-81 us): IQ3_S stays at 16."""
    sms, groups = _sm_count(), -(-rows // group)
    best = None
    for warps in range(most_warps, most_warps // 2 - 1, -1):
        rounds = -(-groups // (sms * warps))
        busy = groups / (rounds * sms * warps)
        if best is None or busy > best[0] + 0.02:
            best = (busy, warps, rounds)
    _, warps, rounds = best
    rpw = rounds * group
    return rpw, warps, -(-rows // (rpw * warps))


def _group_rows(rows: int, resident: int, matrix_bytes: int) -> int:
    """Rows a warp works on together at one column: RPW, or 2 where groups of RPW would leave
    over a quarter of the device's warp slots empty on a matrix of at least GROUP2_BYTES (few
    long rows, like an FFN down projection); each warp then takes one group of 2. A row's sum
    does not depend on it (stream_rows). Measured on the H200 (1 column, us, groups of
    4 -> 2): 4096 x 14336 Q4_K 14.7 -> 12.9, Q6_K 29.0 -> 18.1, IQ4_NL 20.9 -> 16.4, Q2_0 13.5 ->
    10.6, IQ3_S 25.8 -> 19.3; 4096 x 4096 Q4_K 5.5 -> 4.7, Q6_K 9.3 -> 6.1, IQ3_S 8.6 -> 6.5, but
    Q2_0 (4.7 MB) 4.0 -> 4.1-4.6; 1024 x 4096 (latency-bound, 2-3 MB) Q2_0 2.2 -> 2.3, IQ3_S
    3.1 -> 3.6. Groups of 1 lost to 4 at 1024 rows (Q4_K 2.8 -> 3.1, Q2_0 2.1 -> 2.8)."""
    if matrix_bytes >= GROUP2_BYTES and 4 * rows < 3 * RPW * resident:
        return 2
    return RPW


GROUP2_BYTES = 6 << 20


# One column of a type with much decode work per byte runs RPW rows per warp (every row group a
# warp of its own, past one wave) rather than the one-wave rule: more warps hide the decode's
# latency. Those are the types below 4.5 bits per weight and the 4-bit lookup types.
# Measured (14336 x 4096, twice, against 8 rows per warp): Q2_0 10.5 -> 9.3 us, Q2_K 12.2 -> 11.0, Q3_K
# 18.5 -> 16.4, IQ3_S 19.3 -> 17.8, IQ3_XXS 17.9 -> 16.0, IQ2_XS 17.2 -> 16.3, MXFP4 18.0 -> 16.7,
# IQ4_NL 18.0 -> 17.35; but Q4_0 12.3 -> 12.7, Q4_K 12.7 -> 12.9 and Q8_0 19.0 -> 21.6.
# Where decode graphs launch with PDL (sm_90+, launch.enabled()), every quantized type takes RPW
# at one column (Q6_K too: 16.2 against 18.4 us at 14336 x 4096): the one-wave rule left
# slots that the next launch's blocks filled early, their prefetches competing with the running
# kernel (us, rule -> RPW: 57344 x 8192 Q4_0 72.2
# -> 65.2, Q4_1 78.8 -> 71.2, Q5_1 98.9 -> 86.6, Q8_0 134.0 -> 122.0, Q4_K 72.4 -> 65.3, Q5_K
# 90.8 -> 81.4, 97-99% of copy; 14336 x 4096 Q8_0 23.3 -> 19.7, Q5_0 14.4 -> 13.7, Q5_K 14.5
# -> 13.9, the rest equal). Without PDL (GPUs before sm_90) the measurements above stand.
LOW_BIT_BYTES_PER_32 = 18  # 4.5 bits per weight: types below it


def _decode_heavy(type_id: int) -> bool:
    if type_id in FLOAT_TYPES:
        return False
    t = type_by_id(type_id)
    return t.type_size * 32 < LOW_BIT_BYTES_PER_32 * t.block_size or type_id in LOOKUP_4BIT


def _column_groups(ncols: int) -> list[tuple[int, int, int]]:
    """(first column, columns per group, groups): whole groups of MAX_COLS, then the rest."""
    full, rest = divmod(ncols, MAX_COLS)
    return [(c0, nc, g) for c0, nc, g in ((0, MAX_COLS, full), (full * MAX_COLS, rest, 1)) if nc and g]


@functools.cache
def _sm_count() -> int:
    return int(_cp().cuda.Device().attributes["MultiProcessorCount"])


def mmvq(type_id: int, w_dev, rows: int, k: int, x_dev, out=None, q8: Q8Buffer | None = None,
         split: bool = True):
    """W (rows, k) of GGML type `type_id` times x (ncols, k) -> float32 (ncols, rows).

    x_dev: float32 columns (quantized here) or a Q8Buffer already quantized. More than
    MAX_COLS columns run as several launches. `out` (ncols, rows) float32 may be given.
    split: a small matrix's columns may run in parallel (split_columns; same bits either way).
    """
    cp = _cp()
    t, w = _weights(type_id, w_dev, k)
    row_bytes = t.row_bytes(k)
    _check_matrix_bytes("mmvq", rows, row_bytes)
    if w.size != rows * row_bytes:
        raise ValueError(f"mmvq: {t.name} {rows} x {k} needs {rows * row_bytes} bytes, got {w.size}")
    if isinstance(x_dev, Q8Buffer):
        if t.id in FLOAT_TYPES:
            raise ValueError("mmvq: float weights take float activations, not a Q8Buffer")
        act, ncols = x_dev, x_dev.ncols
    else:
        x = _columns(x_dev)
        if x.shape[1] != k:
            raise ValueError(f"mmvq: activations have {x.shape[1]} values per column, weights {k}")
        ncols = x.shape[0]
        act = x if t.id in FLOAT_TYPES else quantize_q8_1(x, q8)
    if out is None:
        out = cp.empty((ncols, rows), dtype=cp.float32)
    if t.id in FLOAT_TYPES:  # a group of columns per grid row, as the quantized kernels
        vec = np.int32(row_bytes % 16 == 0 and (k * t.type_size) % 16 == 0)
        for c0, nc, groups in _column_groups(ncols):
            launch(_function(t.id, f"mmvf<{t.id}, {nc}>"), ((rows + WARPS - 1) // WARPS, groups), (WARPS * 32,), (
                w, np.int32(rows), np.int32(row_bytes), np.int32(k), act[c0:], out[c0:], vec))
        return out
    for ln in column_launches(t.id, rows, ncols, split, rows_aligned(w, row_bytes), k):
        launch(_function(t.id, ln.name), ln.grid, ln.block, (
            w, np.int32(rows), np.int32(row_bytes), np.int32(k), np.int32(ln.rpw),
            act.q[ln.c0:], act.meta[ln.c0:], out[ln.c0:]), shared_mem=ln.smem)
    return out


def mmvq_experts(type_id: int, w_dev, expert_ids_dev, x_dev, out=None, q8: Q8Buffer | None = None):
    """Experts mat-vec: w (n_expert, rows, row_bytes) uint8, expert_ids (ncols, n_used) int32
    on the device, x (ncols, k) -> float32 (ncols, n_used, rows). Ids stay on the device: an
    id outside 0..n_expert-1 yields NaN rows instead of a host round trip. q8: x already
    quantized (shared by several expert weights), skipping the quantization here."""
    cp = _cp()
    w3 = cp.asarray(w_dev)
    if w3.ndim != 3:
        raise ValueError(f"mmvq_experts: weights must be (n_expert, rows, row_bytes), got {w3.shape}")
    n_expert, rows, row_bytes = w3.shape
    _check_matrix_bytes("mmvq experts", rows, row_bytes)
    t = type_by_id(type_id)
    if t is None:
        raise ValueError(f"mmvq_experts: unknown GGML type {type_id}")
    k = row_bytes // t.type_size * t.block_size
    t, w = _weights(type_id, w3, k)
    ids = cp.ascontiguousarray(cp.asarray(expert_ids_dev, dtype=cp.int32))
    x = _columns(x_dev)
    if ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"mmvq_experts: expert_ids must be (ncols={x.shape[0]}, n_used), got {ids.shape}")
    ncols, n_used = ids.shape
    if out is None:
        out = cp.empty((ncols, n_used, rows), dtype=cp.float32)
    if ncols * n_used == 0:
        return out
    grid = ((rows + WARPS - 1) // WARPS, ncols * n_used)
    common = (w, np.int64(rows * row_bytes), np.int32(n_expert), ids, np.int32(n_used),
              np.int32(rows), np.int32(row_bytes), np.int32(k))
    if t.id in FLOAT_TYPES:
        vec = np.int32(row_bytes % 16 == 0)
        launch(_function(t.id, f"mmvf_ids<{t.id}>"), grid, (WARPS * 32,), common + (x, out, vec))
    else:
        act = q8 if q8 is not None else quantize_q8_1(x)
        name = _ids_name(t.id, rows_aligned(w, row_bytes))
        rpw = _rows_per_warp(t.id, name, rows, ncols * n_used)
        qgrid = (-(-rows // (rpw * WARPS)), ncols * n_used)
        launch(_function(t.id, name), qgrid, (WARPS * 32,), common + (np.int32(rpw), act.q, act.meta, out))
    return out


def mmvq_experts_pair(id1: int, w1_dev, id2: int, w2_dev, expert_ids_dev, q8: Q8Buffer):
    """Two quantized expert matrices over the same quantized activations (gate and up) in one
    launch: w1 (n_expert, rows1, row_bytes1) of type id1, w2 likewise, both with rows of q8.k
    weights. -> (out1 (ncols, n_used, rows1), out2 (ncols, n_used, rows2))."""
    cp = _cp()
    ids = cp.ascontiguousarray(cp.asarray(expert_ids_dev, dtype=cp.int32))
    ncols, n_used = ids.shape
    parts = []
    for tid, w_dev in ((id1, w1_dev), (id2, w2_dev)):
        if tid in FLOAT_TYPES:
            raise ValueError("mmvq_experts_pair: quantized weights only")
        w3 = cp.asarray(w_dev)
        n_expert, rows, row_bytes = w3.shape
        _check_matrix_bytes("mmvq experts", rows, row_bytes)
        t, w = _weights(tid, w3, q8.k)
        if row_bytes != t.row_bytes(q8.k):
            raise ValueError(f"mmvq_experts_pair: {t.name} rows are not {q8.k} weights long")
        parts.append((w, n_expert, rows, row_bytes))
    if parts[0][1] != parts[1][1] or ids.shape[0] != q8.ncols:
        raise ValueError("mmvq_experts_pair: the two matrices must have the same experts and activations")
    fn = _pair_function(id1, id2, all(rows_aligned(w, row_bytes) for w, _, _, row_bytes in parts))
    resident = _resident_warps_of(fn)
    outs, lead = [], []
    for w, n_expert, rows, row_bytes in parts:
        rpw = _rows_per_warp(0, "", rows, ncols * n_used, resident=resident)
        nb = -(-rows // (rpw * WARPS))
        out = cp.empty((ncols, n_used, rows), dtype=cp.float32)
        outs.append(out)
        lead.append((w, np.int64(rows * row_bytes), np.int32(rows), np.int32(row_bytes), np.int32(rpw), nb, out))
    if ncols * n_used:
        (w1, eb1, r1, rb1, rpw1, nb1, o1), (w2, eb2, r2, rb2, rpw2, nb2, o2) = lead
        launch(fn, (nb1 + nb2, ncols * n_used), (WARPS * 32,), (
            w1, eb1, r1, rb1, rpw1, np.int32(nb1), o1, w2, eb2, r2, rb2, rpw2, o2,
            np.int32(parts[0][1]), ids, np.int32(n_used), np.int32(q8.k), q8.q, q8.meta))
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
        _plain_function("expert_plan_build")((1,), (PLAN_THREADS,), (
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


def _grouped_function(type_id: int):
    """mmvq_grouped<type_id>: experts grouped by expert (prefill only)."""
    return _named_function(f"mmvq_grouped<{type_id}>")


@dataclass
class _GroupedCall:
    """A grouped experts call, checked: its type, weights, shape, output and sorted activations."""

    t: object  # the GGML type
    w: object  # the weights as the kernel reads them (_weights)
    n_expert: int
    rows: int
    row_bytes: int
    k: int
    out: object  # float32 (pairs, rows), pair order
    qg: object = None  # activations in the plan's sorted order (None: no pairs)
    mg: object = None


def _grouped_call(name: str, type_id: int, w_dev, plan: ExpertPlan, q8: Q8Buffer, per_pair: bool,
                  cols_ok: bool, cols_want: str) -> _GroupedCall:
    """The checks mmvq_experts_grouped and mmq_experts_grouped share (a clear error naming the
    call and what is wrong), the output, and the activations gathered in sorted order."""
    cp = _cp()
    if type_id in FLOAT_TYPES:
        raise ValueError(f"{name}: quantized weights only")
    w3 = cp.asarray(w_dev)
    n_expert, rows, row_bytes = w3.shape
    _check_matrix_bytes(name, rows, row_bytes)
    if n_expert != plan.n_expert or not cols_ok:
        raise ValueError(f"{name}: the plan is for {plan.n_expert} experts in tiles of {plan.cols}, "
                         f"the weights have {n_expert} (tiles of {cols_want})")
    k = q8.k
    t, w = _weights(type_id, w3, k)
    if row_bytes != t.row_bytes(k):
        raise ValueError(f"{name}: {t.name} rows are not {k} weights long")
    want = plan.pairs if per_pair else plan.pairs // max(1, plan.n_used)
    if q8.ncols != want:
        raise ValueError(f"{name}: {q8.ncols} activation columns, the plan needs {want}")
    call = _GroupedCall(t, w, n_expert, rows, row_bytes, k, cp.empty((plan.pairs, rows), dtype=cp.float32))
    if plan.pairs:
        call.qg, call.mg = _gathered(plan, q8, per_pair)
    return call


def _scatter_sorted(sorted_out, plan: ExpertPlan, c: _GroupedCall):
    """The kernel's rows (sorted order) back to pair order in c.out."""
    _plain_function("scatter_rows")((plan.pairs,), (128,), (sorted_out, plan.order, np.int32(c.rows), c.out))
    return c.out


def mmvq_experts_grouped(type_id: int, w_dev, plan: ExpertPlan, q8: Q8Buffer, per_pair: bool = False):
    """Experts mat-vec for many pairs, one weight pass per tile of pairs sharing an expert:
    w (n_expert, rows, row_bytes); q8 the quantized activations, one column per token
    (per_pair=False: a token's n_used experts read its column) or one per pair (per_pair=True).
    -> float32 (pairs, rows) in pair order, bitwise what mmvq_experts gives."""
    c = _grouped_call("mmvq_experts_grouped", type_id, w_dev, plan, q8, per_pair, plan.cols == GROUP_COLS,
                      str(GROUP_COLS))
    if plan.pairs == 0:
        return c.out
    fn = _grouped_function(c.t.id)
    rows = c.rows
    # a few row blocks per tile: many short blocks, several waves (a prefill window is long
    # enough that the tail of the last wave matters less than idle warps in wide blocks)
    rpw = max(RPW, -(-(-(-rows // (WARPS * GROUP_ROW_BLOCKS))) // RPW) * RPW)
    sorted_out = _cp().empty((plan.pairs, rows), dtype=np.float32)
    fn((-(-rows // (rpw * WARPS)), plan.max_tiles), (WARPS * 32,), (
        c.w, np.int64(rows * c.row_bytes), np.int32(c.n_expert), plan.tiles, plan.n_tiles, np.int32(rows),
        np.int32(c.row_bytes), np.int32(c.k), np.int32(rpw), c.qg, c.mg, sorted_out))
    return _scatter_sorted(sorted_out, plan, c)


MMQ_ROWS_PER_BLOCK = 128  # mmq_grouped: MMQ_WARPS x MMQ_ROWS (mmvq_kernels.cuh)
MMQ_THREADS = 128  # mmq_grouped's block: MMQ_WARPS x 32


def _mmq_geometry(type_id: int) -> tuple[int, int]:
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
    sch, smem = _mmq_geometry(type_id)
    if k % (QK * sch):
        return False
    return smem + 16 * 1024 <= _device_smem_optin()  # + the static tiles and codebook


def _device_smem_optin() -> int:
    cp = _cp()
    return _smem_optin_of(cp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _smem_optin_of(device: int) -> int:
    """cudaDevAttrMaxSharedMemoryPerBlockOptin (97) of a device, asked once."""
    return int(_cp().cuda.runtime.deviceGetAttribute(97, device))


def mmq_experts_grouped(type_id: int, w_dev, plan: ExpertPlan, q8: Q8Buffer, per_pair: bool = False):
    """mmvq_experts_grouped's result on int8 tensor cores (mmq_grouped), on a plan of MMQ_COLS
    columns a tile: the same chunks, scaled the same way, summed in chunk order instead of
    MMVQ's lane order (other bits: for long prompts' rows only). A pair's row depends only on
    its own activations, never on its tile. mmq_supports(type_id, k) must hold."""
    c = _grouped_call("mmq_experts_grouped", type_id, w_dev, plan, q8, per_pair, plan.cols <= MMQ_COLS,
                      f"at most {MMQ_COLS}")
    if not mmq_supports(c.t.id, c.k):
        raise ValueError(f"mmq_experts_grouped: {c.t.name} rows of {c.k} weights are not taken on this device")
    if plan.pairs == 0:
        return c.out
    _, smem = _mmq_geometry(c.t.id)
    fn = _mmq_function(c.t.id, smem)
    rows = c.rows
    sorted_out = _cp().empty((plan.pairs, rows), dtype=np.float32)
    fn((-(-rows // MMQ_ROWS_PER_BLOCK), plan.max_tiles), (MMQ_THREADS,), (
        c.w, np.int64(rows * c.row_bytes), np.int32(c.n_expert), plan.tiles, plan.n_tiles, np.int32(rows),
        np.int32(c.row_bytes), np.int32(c.k), c.qg, c.mg, sorted_out), shared_mem=smem)
    return _scatter_sorted(sorted_out, plan, c)


def _mmq_name(type_id: int) -> str:
    return f"mmq_grouped<{type_id}, {MMQ_N8}>"


def _mmq_function(type_id: int, smem: int):
    fn = _named_function(_mmq_name(type_id))
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
    _plain_function("gather_q8_rows")((total,), (128,), (
        q, meta, plan.order, np.int32(1 if per_pair else plan.n_used), np.int32(plan.pairs), np.int32(k), qg, mg))
    plan.gathered = (q8, per_pair, qg, mg)
    return qg, mg


# ------------------------------------------------------------------ native table
def _table_impl(type_id: int):
    def impl(w, x):
        """w uint8 (rows, row_bytes), x float32 (ncols, k) (host or device) -> cupy (ncols, rows)."""
        cp = _cp()
        w_dev = cp.asarray(w)
        x_dev = _columns(x)
        return mmvq(type_id, w_dev, w_dev.shape[0], x_dev.shape[1], x_dev)

    impl.__qualname__ = f"cuda.mmvq[{type_by_id(type_id).name}]"
    return impl


def register(table) -> None:
    """Add one "cuda" row per supported type to a strata.kernels.native_table.NativeTable."""
    for type_id in supported_types():
        table.register("cuda", type_id, MAX_COLS, _table_impl(type_id), "strata.kernels.cuda.mmvq")
