"""Strata against llama.cpp on a qwen3next oracle pack whose DeltaNet layers hold one fused ssm_in
(earlier llama.cpp converters' form, which llama.cpp's qwen3next.cpp still reads), as
tests/test_llamacpp_oracle.py does for the split form: the recording tests/data/llamacpp/
qwen3next-fused.json (llama.cpp's top-8 log-probs, llama-cpp-python 0.3.36) is checked in CI and
re-checked against a fresh llama.cpp run where llama-cpp-python is installed
(STRATA_ORACLE_RECORD=1 rewrites it). Measured: 0.012 nats apart at most. The pack's ssm_in has
its own random weights, so its routers differ from the split pack's: their smallest top-2 margin
at these tokens is 0.018 logits (seed 1; the best of seeds 1-11), far above F16 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from strata.pack.synth import synth_pack
from strata.pack.synth_plan import with_delta_net_input
from tests.support import oracle
from tests.test_llamacpp_oracle import TOLERANCE, _strata_logprobs

NAME = "qwen3next-fused"
RECORDING = oracle.DATA / f"{NAME}.json"


def write_pack(out):
    spec = with_delta_net_input(oracle.oracle_spec("qwen3next"), "fused")
    (path,) = synth_pack(spec, out, name=NAME, seed=oracle.SEED, force=True, progress=lambda *a: None)
    return path


def test_strata_matches_llama_cpp_on_a_fused_pack(tmp_path):
    rec = json.loads(RECORDING.read_text())
    assert (rec["tokens"], rec["seed"], rec["vocab"], rec["delta_net_input"]) == (oracle.TOKENS, oracle.SEED,
                                                                                 oracle.VOCAB, "fused")
    got = _strata_logprobs(write_pack(tmp_path))
    ids, want = np.asarray(rec["ids"]), np.asarray(rec["logprobs"])
    diff = np.abs(np.take_along_axis(got, ids, 1) - want)
    assert diff.max() < TOLERANCE, f"max |log p| difference {diff.max():.4f} at position {diff.max(1).argmax()}"
    clear = want[:, 0] - want[:, 1] > 0.3
    assert (got.argmax(1)[clear] == ids[clear, 0]).all()


def test_the_recording_matches_a_fresh_llama_cpp_run(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write_pack(tmp_path)
    proc = subprocess.run([sys.executable, "-c", oracle._CHILD, str(path), json.dumps(oracle.TOKENS), str(oracle.TOP)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-1500:]
    fresh = {"arch": "qwen3next", "delta_net_input": "fused", "seed": oracle.SEED, "vocab": oracle.VOCAB,
             "types": "F16", "tokens": oracle.TOKENS, "llama_cpp_python": llama_cpp.__version__,
             **json.loads(proc.stdout.strip().splitlines()[-1])}
    if os.environ.get("STRATA_ORACLE_RECORD") == "1":
        RECORDING.write_text(json.dumps(fresh, separators=(",", ":")) + "\n")
    rec = json.loads(RECORDING.read_text())
    assert fresh["ids"] == rec["ids"]
    np.testing.assert_allclose(fresh["logprobs"], rec["logprobs"], atol=1e-4)
