"""Strata against llama.cpp on the same pack files, for every architecture both run.

tests/data/llamacpp/<arch>.json holds llama.cpp's top-8 log-probs per position on the oracle pack
of that architecture (tests/support/oracle.py: the tiny preset, all matrices F16, a fixed seed).
CI rebuilds the pack and checks Strata's log-probs of the same tokens, and its greedy choice
wherever llama.cpp's top two are more than 0.3 nats apart. Where llama-cpp-python is installed,
the recordings are checked against a fresh llama.cpp run (STRATA_ORACLE_RECORD=1 rewrites them).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from strata.backend.cpu import CpuBackend
from strata.model.build import build_model
from strata.model.transformer import Span
from strata.pack.loader import open_pack
from tests.support import oracle

TOLERANCE = 0.05  # nats; measured 0.001-0.025 (llama.cpp rounds activations to F16), a wrong layer ~1


def _strata_logprobs(path) -> np.ndarray:
    pack = open_pack(pack=str(path))
    model = build_model(CpuBackend(), pack.model_config(), lambda n: pack.tensors.get(n))
    cache = model.new_cache(64, "f16")
    n = len(oracle.TOKENS)
    _, logits = model.forward(np.asarray(oracle.TOKENS), [Span(cache, 0, n)], logit_rows=list(range(n)))
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("arch", oracle.ARCHS)
def test_strata_matches_llama_cpp(arch, tmp_path):
    rec = oracle.load(arch)
    assert rec["tokens"] == oracle.TOKENS and rec["seed"] == oracle.SEED and rec["vocab"] == oracle.VOCAB
    got = _strata_logprobs(oracle.write_pack(arch, tmp_path))
    ids, want = np.asarray(rec["ids"]), np.asarray(rec["logprobs"])
    diff = np.abs(np.take_along_axis(got, ids, 1) - want)
    assert diff.max() < TOLERANCE, f"{arch}: max |log p| difference {diff.max():.4f} at position {diff.max(1).argmax()}"
    clear = want[:, 0] - want[:, 1] > 0.3
    assert (got.argmax(1)[clear] == ids[clear, 0]).all()


@pytest.mark.parametrize("arch", oracle.ARCHS)
def test_recordings_match_a_fresh_llama_cpp_run(arch, tmp_path):
    pytest.importorskip("llama_cpp")
    fresh = oracle.record(arch, tmp_path)
    if os.environ.get("STRATA_ORACLE_RECORD") == "1":
        oracle.save(fresh)
    rec = oracle.load(arch)
    assert fresh["ids"] == rec["ids"]
    np.testing.assert_allclose(fresh["logprobs"], rec["logprobs"], atol=1e-4)
