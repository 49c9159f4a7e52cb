"""Device dequantization (strata.kernels.cuda.dequant) and the prefill GEMM path
(strata.backend.cuda_prefill) on a GPU, against independent host references.

Every type the CUDA backend runs natively, on fresh random valid blocks each run:
- dequantize_rows float32 == strata.kernels.dequant.dequantize bit for bit; float16 == that
  reference rounded to f16 (numpy's round-to-nearest-even) bit for bit;
- get_rows with int32 and int64 ids on the device (repeats, unsorted) == the reference rows
  bit for bit; an out-of-range id gives a NaN row; replayed from a CUDA graph with new ids;
- PrefillPath.linear vs float64 numpy: against the exact weights, ||y - ref|| / ||ref|| < 2e-3
  (weights and activations rounded to f16: <= 2^-11 relative each); against the f16-rounded
  operands < 1e-4, which float32 accumulation meets and f16 accumulation would not;
  several row tiles (small scratch) give the result of one (to 1e-6: cuBLAS may order sums
  differently per tile shape);
- to_f16 (the GEMMs' activations) == numpy's float16 rounding bit for bit, padding rows zero.
Outputs are poisoned with NaN before each run so an unwritten element fails.
Skips cleanly without CuPy or a device.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support.gpu import require_cuda

cp = require_cuda()

from strata.backend.cuda_prefill import PrefillPath  # noqa: E402
from strata.kernels.cuda import dequant as gpu  # noqa: E402
from strata.kernels.dequant import dequantize  # noqa: E402
from strata.kernels.ggml_types import type_by_id  # noqa: E402
from strata.kernels.random_blocks import random_blocks  # noqa: E402

ROWS = 37  # not a multiple of anything the kernels group by: exercises the tails
K = 4352  # 17 super-blocks of 256
SEED = int.from_bytes(os.urandom(4), "little")
TYPES = list(gpu.supported_types())
NAMES = [type_by_id(t).name for t in TYPES]
LINEAR_REL = 2e-3
ACCUM_REL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def compiled():
    gpu.compile_all(threads=16)


def _rng(*salt):
    return np.random.default_rng([SEED, *salt])


def _weights(tid, rows, k, salt):
    blocks = random_blocks(tid, rows, k, _rng(tid, salt))
    return blocks, dequantize(tid, blocks, rows * k).reshape(rows, k)


def _poisoned(shape, dtype):
    return cp.full(shape, np.nan, dtype=dtype)


@pytest.mark.parametrize("tid", TYPES, ids=NAMES)
def test_dequantize_rows_exact(tid):
    blocks, ref = _weights(tid, ROWS, K, 1)
    w = cp.asarray(blocks)
    out32 = _poisoned((ROWS, K), cp.float32)
    got32 = gpu.dequantize_rows(tid, w, ROWS, K, out=out32, dtype=np.float32)
    assert got32 is out32
    np.testing.assert_array_equal(cp.asnumpy(out32), ref)
    out16 = _poisoned((ROWS, K), cp.float16)
    gpu.dequantize_rows_f16(tid, w, ROWS, K, out=out16)
    np.testing.assert_array_equal(cp.asnumpy(out16), ref.astype(np.float16))


@pytest.mark.parametrize("tid", TYPES, ids=NAMES)
def test_get_rows_device_ids(tid):
    n_vocab, k = 50, 576 if 576 % type_by_id(tid).block_size == 0 else 512
    blocks, ref = _weights(tid, n_vocab, k, 2)
    table = cp.asarray(blocks)
    host_ids = np.array([3, 49, 0, 3, 17, 17, 8, 41, 0], dtype=np.int64)
    for dt in (cp.int32, cp.int64):
        ids = cp.asarray(host_ids, dtype=dt)
        out = _poisoned((len(host_ids), k), cp.float32)
        gpu.get_rows(tid, table, ids, k, out=out)
        np.testing.assert_array_equal(cp.asnumpy(out), ref[host_ids])
    bad = cp.asarray([1, 50, -1], dtype=cp.int32)
    out = cp.asnumpy(gpu.get_rows(tid, table, bad, k))
    np.testing.assert_array_equal(out[0], ref[1])
    assert np.isnan(out[1:]).all()


def test_get_rows_in_cuda_graph():
    tid = type_by_id(8).id  # Q8_0, the test model's embedding type
    n_vocab, k = 300, 576
    blocks, ref = _weights(tid, n_vocab, k, 3)
    table = cp.asarray(blocks)
    ids = cp.asarray([5, 6, 7, 8], dtype=cp.int32)
    out = _poisoned((4, k), cp.float32)
    gpu.get_rows(tid, table, ids, k, out=out)  # compiled and warm before capture
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        gpu.get_rows(tid, table, ids, k, out=out)
        graph = stream.end_capture()
    for step_ids in ([0, 299, 150, 0], [42, 43, 44, 45]):
        with stream:  # the graph's stream: the new ids land before the replay reads them
            ids[...] = cp.asarray(step_ids, dtype=cp.int32)
            out.fill(np.nan)
        graph.launch(stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), ref[step_ids])


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("tid", TYPES, ids=NAMES)
def test_prefill_linear_vs_float64(tid):
    rows, k, n = ROWS, K, 40
    blocks, wref = _weights(tid, rows, k, 4)
    x = _rng(tid, 5).standard_normal((n, k)).astype(np.float32)
    path = PrefillPath()
    out = _poisoned((n, rows), cp.float32)
    got = path.linear(tid, cp.asarray(blocks), rows, k, cp.asarray(x), out=out)
    assert got is out
    y = cp.asnumpy(out).astype(np.float64)
    exact = x.astype(np.float64) @ wref.astype(np.float64).T
    rounded = (x.astype(np.float16).astype(np.float64)
               @ wref.astype(np.float16).astype(np.float64).T)
    assert _rel(y, exact) < LINEAR_REL
    assert _rel(y, rounded) < ACCUM_REL


def test_prefill_tiles_match_one_tile():
    tid = type_by_id(12).id  # Q4_K
    rows, k, n = 301, 1024, 33
    blocks, _ = _weights(tid, rows, k, 6)
    w = cp.asarray(blocks)
    x = cp.asarray(_rng(7).standard_normal((n, k)).astype(np.float32))
    whole = PrefillPath(scratch_bytes=rows * k * 2).linear(tid, w, rows, k, x)
    small = PrefillPath(scratch_bytes=40 * k * 2)  # 40-row tiles: 8 tiles, the last one short
    assert small.tile_rows(rows, k) == 40
    out = _poisoned((n, rows), cp.float32)
    small.linear(tid, w, rows, k, x, out=out)
    # same products; cuBLAS may pick another reduction order for 40-row tiles
    assert _rel(cp.asnumpy(out).astype(np.float64), cp.asnumpy(whole).astype(np.float64)) < 1e-6


@pytest.mark.parametrize("tid", [12, 14, 1], ids=["Q4_K", "Q6_K", "F16"])
def test_fixed_row_tiles_make_rows_independent_of_the_window(tid):
    """tile_m: every GEMM runs on exactly tile_m rows, so a row's result is the same bits in a
    window of 150, 70 or 5 rows (and at any offset within its tile); still the exact products
    to f16 rounding."""
    rows, k = 96, 512
    blocks, wref = _weights(tid, rows, k, 8)
    w = cp.asarray(blocks)
    x = _rng(tid, 9).standard_normal((150, k)).astype(np.float32)
    path = PrefillPath()
    full = cp.asnumpy(path.linear(tid, w, rows, k, cp.asarray(x), tile_m=64))
    for a, b in ((0, 70), (70, 75), (75, 150), (3, 100)):
        out = _poisoned((b - a, rows), cp.float32)
        path.linear(tid, w, rows, k, cp.asarray(x[a:b]), out=out, tile_m=64)
        np.testing.assert_array_equal(cp.asnumpy(out), full[a:b], err_msg=f"rows {a}..{b}")
    exact = x.astype(np.float64) @ wref.astype(np.float64).T
    assert _rel(full.astype(np.float64), exact) < LINEAR_REL


def test_activations_to_f16_round_to_nearest_and_pad_with_zeros():
    """dequant.to_f16 (the prefill GEMMs' activations): rows < n numpy's float16 rounding bit for
    bit (halfway cases, subnormals, overflow to inf included), the padding rows zero."""
    n, m, k = 13, 16, 96
    x = _rng(5).standard_normal((n, k)).astype(np.float32) * np.float32(1000)
    x[0, :6] = [65520.0, 65519.0, 6e-8, 3e-8, -1e-7, 2049.0]  # inf, max f16, subnormals, a tie
    x[1, :3] = [np.inf, -np.inf, np.nan]
    out = _poisoned((m, k), cp.float16)
    gpu.to_f16(type_by_id(12).id, cp.asarray(x), n, out)  # the Q4_K module's kernel
    got = cp.asnumpy(out)
    with np.errstate(over="ignore"):  # 65520 and 1000 x normals past 65504: inf, as on the device
        ref = x.astype(np.float16)
    np.testing.assert_array_equal(got[:n].view(np.uint16)[~np.isnan(ref)], ref.view(np.uint16)[~np.isnan(ref)])
    assert np.isnan(got[1, 2]) and (got[n:] == 0).all() and not np.signbit(got[n:]).any()
