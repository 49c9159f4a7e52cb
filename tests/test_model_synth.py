"""The forward pass of every architecture on tiny synthetic packs of random valid blocks,
against the float64 recomputation (tests/support/reference_model.py).

Each pack mixes quantization types (K-quants, IQ4_NL, Q2_0, legacy quants) on rows their
blocks divide, so a wrong dequantizer, a wrong RoPE pairing, a missing bias or a wrong
expert routing shows up as a logits error far above float32 rounding (measured ~1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.model.transformer import Span
from tests.support import reference_model
from tests.support.model_fixtures import load_model, logits_of, new_cache, synth_model

REL_BOUND = 1e-4  # max |ours - ref| / max |ref| over all logits; measured 4e-7 .. 2e-6

# name -> (arch, types, shape overrides, tensors the case must contain)
CASES = {
    "llama-separate-output": ("llama", {"embed": "Q8_0", "output": "Q6_K", "attn": "Q4_K", "ffn_gate": "IQ4_NL",
                                        "ffn_up": "Q2_0", "ffn_down": "Q8_0"}, {}, ["output.weight"]),
    "llama-tied-output": ("llama", {"embed": "Q4_K", "attn": "Q5_0", "ffn_gate": "Q4_1", "ffn_up": "Q6_K",
                                    "ffn_down": "IQ4_NL"}, {"tied_output": True}, []),
    "qwen2-qkv-bias": ("qwen2", {"embed": "Q6_K", "output": "Q8_0", "attn": "Q6_K", "ffn_gate": "Q4_K",
                                 "ffn_up": "Q2_0", "ffn_down": "Q5_K"}, {}, ["blk.0.attn_q.bias", "blk.1.attn_v.bias"]),
    "qwen3-qk-norm": ("qwen3", {"embed": "Q8_0", "attn": "IQ4_NL", "ffn_gate": "Q2_0", "ffn_up": "Q5_K",
                                "ffn_down": "Q4_0"}, {"tied_output": True}, ["blk.0.attn_q_norm.weight"]),
    "qwen3moe": ("qwen3moe", {"embed": "Q8_0", "output": "Q6_K", "attn": "Q4_K", "ffn_gate_exps": "Q4_K",
                              "ffn_up_exps": "IQ4_NL", "ffn_down_exps": "Q2_0/Q6_K"},
                 {"expert_ff": 512}, ["blk.0.ffn_gate_inp.weight", "blk.1.ffn_down_exps.weight"]),
}


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    out = {}
    for name, (arch, types, shape, _) in CASES.items():
        path = synth_model(root / name, arch, types, **shape)
        out[name] = (path, *load_model(path))
    return out


def tokens(n: int, seed: int, vocab: int = 1024) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_float64_recomputation(packs, case):
    path, model, pack = packs[case]
    for name in CASES[case][3]:
        assert name in pack.tensors, f"the {case} pack lacks {name}: the case would not test it"
    tied = CASES[case][2].get("tied_output", False)
    assert ("output.weight" in pack.tensors) != tied, f"{case}: the output head is not {'tied' if tied else 'separate'}"
    toks = tokens(13, 1)
    md, weights = reference_model.load(path)
    ref = reference_model.forward(md, weights, toks)
    ours = logits_of(model, toks, "f32")
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < REL_BOUND, f"{case}: relative logits error {rel:.2e}"
    # the logits are not degenerate: random weights still give distinct, position-dependent rows
    assert np.abs(ref).max() > 0.5 and np.ptp(ref.argmax(axis=1)) > 0


def test_types_in_the_cases_are_the_ones_named(packs):
    """Guard against a synth change silently retyping the tensors these tests rely on."""
    from strata.kernels.ggml_types import type_by_id

    _, _, pack = packs["qwen3moe"]
    got = {n: type_by_id(pack.tensors[n].ggml_type).name for n in
           ("blk.0.ffn_down_exps.weight", "blk.1.ffn_down_exps.weight", "blk.0.ffn_up_exps.weight")}
    assert got == {"blk.0.ffn_down_exps.weight": "Q2_0", "blk.1.ffn_down_exps.weight": "Q6_K",
                   "blk.0.ffn_up_exps.weight": "IQ4_NL"}


@pytest.mark.parametrize("case", ["llama-separate-output", "qwen3moe"])
def test_two_spans_in_one_window_equal_each_sequence_alone(packs, case):
    """Sequence A already holds 5 tokens and adds 3; sequence B starts with 7: one forward
    over both (ragged spans, different start positions) gives each one's logits alone."""
    _, model, _ = packs[case]
    a, b = tokens(8, 2), tokens(7, 3)
    # float32 caches: an f16 cache turns a last-bit difference between two BLAS call shapes
    # into a whole f16 ulp (~1e-4 of the logits), which is storage rounding, not the window
    alone_a = logits_of(model, a, "f32")[5:]
    alone_b = logits_of(model, b, "f32")

    cache_a, cache_b = new_cache(model, "f32", 16), new_cache(model, "f32", 16)
    model.forward(a[:5], [Span(cache_a, 0, 5)])
    window = np.concatenate([a[5:], b])
    hidden = model.forward(window, [Span(cache_a, 5, 3), Span(cache_b, 0, 7)])
    both = np.asarray(model.logits(hidden), dtype=np.float64)
    assert (cache_a.length, cache_b.length) == (8, 7)
    scale = np.abs(alone_b).max()
    assert np.abs(both[:3] - alone_a).max() < 1e-5 * scale
    assert np.abs(both[3:] - alone_b).max() < 1e-5 * scale
