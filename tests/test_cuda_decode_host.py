"""The CUDA chunk decoders (strata/kernels/cuda/mmvq_decode.cuh) compiled for the CPU with g++
under a host emulation of the device helpers, checked bit-exact against strata.kernels.dequant
on fresh random valid blocks of every type. Runs without a GPU; skips without g++.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from strata.kernels.dequant import DEQUANTIZERS
from strata.kernels.ggml_types import type_by_id
from strata.kernels.random_blocks import random_blocks

CUDA_DIR = Path(__file__).resolve().parents[1] / "strata" / "kernels" / "cuda"
GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    from strata.kernels.cuda.tables import table_source

    d = tmp_path_factory.mktemp("decode")
    src = "".join([
        (CUDA_DIR / "host_emulation.h").read_text(),
        table_source(),
        (CUDA_DIR / "mmvq_decode.cuh").read_text(),
        (CUDA_DIR / "host_emulation_main.cpp").read_text(),
    ])
    (d / "decode.cpp").write_text(src)
    subprocess.run([GXX, "-O1", "-std=c++17", "-w", "decode.cpp", "-o", "decode"], cwd=d, check=True)
    return d


def test_every_decoder_bit_exact(decoder):
    from strata.kernels.cuda.mmvq_policy import QUANT_TYPES

    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    bad = []
    for tid in QUANT_TYPES:
        t = type_by_id(tid)
        w = random_blocks(tid, 3, 1024, rng)
        path = decoder / f"w{tid}.bin"
        w.tofile(path)
        n_blocks = w.size // t.type_size
        run = subprocess.run([str(decoder / "decode"), str(tid), str(n_blocks), str(path)], capture_output=True)
        got = np.frombuffer(run.stdout, dtype=np.float32)
        ref = DEQUANTIZERS[tid](w.reshape(-1, t.type_size)).reshape(-1)
        if run.returncode or got.shape != ref.shape or not np.array_equal(got, ref):
            bad.append(t.name)
    assert not bad, f"decoders differ from strata.kernels.dequant: {bad}"
