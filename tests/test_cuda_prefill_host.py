"""The device dequantizer's chunk expansion (strata/kernels/cuda/dequant_chunk.cuh) compiled for
the CPU with g++ under the host emulation of the device helpers, checked bit-exact against
strata.kernels.dequant on fresh random valid blocks of every type it serves (quantized and
F32/F16/BF16), whole rows through Dequant<ID>::chunk (skips without g++). Runs without a GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from strata.kernels.dequant import dequantize
from strata.kernels.ggml_types import type_by_id
from strata.kernels.random_blocks import random_blocks

CUDA_DIR = Path(__file__).resolve().parents[1] / "strata" / "kernels" / "cuda"
GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ not found")

# What mmvq_common.cuh provides beyond host_emulation.h, for the chunk expansion.
EXTRA = """
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }
"""

# usage: prog TYPE_ID ROWS K ROW_BYTES FILE -> float32 (ROWS, K) on stdout
MAIN = """
template <int ID> static void run(const u8* d, int rows, int k, long rb) {
    float* out = (float*)malloc(sizeof(float) * (size_t)rows * k);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < k / 32; c++)
            Dequant<ID>::chunk(d + r * rb, c, Dequant<ID>::table(), out + (size_t)r * k + 32 * c);
    fwrite(out, sizeof(float), (size_t)rows * k, stdout);
}
int main(int argc, char** argv) {
    if (argc != 6) return 2;
    const int id = atoi(argv[1]), rows = atoi(argv[2]), k = atoi(argv[3]);
    const long rb = atol(argv[4]);
    FILE* f = fopen(argv[5], "rb");
    if (!f) return 2;
    u8* d = (u8*)aligned_alloc(16, ((size_t)rows * rb + 31) / 16 * 16);
    if (fread(d, 1, (size_t)rows * rb, f) != (size_t)rows * rb) return 2;
    switch (id) {
#define C(X) case X: run<X>(d, rows, k, rb); break;
        C(0) C(1) C(30) C(2) C(3) C(6) C(7) C(8) C(10) C(11) C(12) C(13) C(14) C(16) C(17) C(18) C(19)
        C(20) C(21) C(22) C(23) C(29) C(34) C(35) C(39) C(40) C(41) C(42)
        default: return 3;
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def expander(tmp_path_factory):
    from strata.kernels.cuda.tables import table_source

    d = tmp_path_factory.mktemp("dequant_chunk")
    src = "".join([
        (CUDA_DIR / "host_emulation.h").read_text(), EXTRA, table_source(),
        (CUDA_DIR / "mmvq_decode.cuh").read_text(), (CUDA_DIR / "dequant_chunk.cuh").read_text(), MAIN,
    ])
    (d / "chunk.cpp").write_text(src)
    subprocess.run([GXX, "-O1", "-std=c++17", "-w", "chunk.cpp", "-o", "chunk"], cwd=d, check=True)
    return d


@needs_gxx
def test_chunk_expansion_bit_exact(expander):
    from strata.kernels.cuda.dequant import supported_types

    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    rows, k = 3, 1024
    bad = []
    for tid in supported_types():
        t = type_by_id(tid)
        w = random_blocks(tid, rows, k, rng)
        path = expander / f"w{tid}.bin"
        w.tofile(path)
        run = subprocess.run([str(expander / "chunk"), str(tid), str(rows), str(k), str(t.row_bytes(k)), str(path)],
                             capture_output=True)
        got = np.frombuffer(run.stdout, dtype=np.float32)
        ref = dequantize(tid, w, rows * k)
        if run.returncode or got.shape != ref.shape or not np.array_equal(got, ref, equal_nan=True):
            bad.append(t.name)
    assert not bad, f"chunk expansion differs from strata.kernels.dequant: {bad}"
