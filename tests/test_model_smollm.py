"""The numpy forward pass on real models, against two independent references.

1. tests/support/reference_model.py: a float64 recomputation (own GGUF parser, the gguf
   package's dequantizers, strata's only for Q2_0).
2. llama.cpp's greedy continuations (../shared/reference/*.json; skipped when absent).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from strata.model.transformer import Span
from tests.support.model_fixtures import (
    MIX_Q2_0_NAME, chat_ids, default_model_or_skip, engine, load_engine, log_softmax, logits_of, reference, run, shared_file,
)
from tests.support import reference_model

MODEL = str(default_model_or_skip())
NEAR_TIE = 0.3  # top-2 log-prob gap under which two exact-enough engines may pick differently


@pytest.fixture(scope="module")
def core():
    return engine(None, 4)


@pytest.fixture(scope="module")
def oracle(core):
    """Templated prompt + 5 continuation tokens, and the float64 logits for all of them."""
    tokens = chat_ids(core, "What is the capital of France?")
    tokens += core.tokenizer.encode("The capital of France", add_special=False)
    md, weights = reference(MODEL)
    return tokens, reference_model.forward(md, weights, tokens)


def test_logits_match_float64_recomputation_exactly_without_cache_rounding(core, oracle):
    """With a float32 KV cache the only differences left are float32 vs float64 arithmetic:
    measured max |d logprob| 8.7e-5 over every position and all 49152 tokens; bound 1e-3."""
    tokens, ref = oracle
    ours = logits_of(core.model, tokens, "f32")
    d = np.abs(log_softmax(ours) - log_softmax(ref))
    assert d.max() < 1e-3, f"max |d logprob| {d.max():.2e} at {np.unravel_index(d.argmax(), d.shape)}"


def test_logits_with_f16_cache_stay_close_to_float64(core, oracle):
    """The engine's real path (f16 KV cache). Over the reference's top-5 tokens per position:
    measured max |d logprob| 0.012, mean 0.0019 (over the whole vocabulary the max is 0.044:
    f16 rounding of K/V, amplified by this model). Bound 0.05 on the top-5, and the top token
    agrees wherever the reference's top-2 gap exceeds that bound."""
    tokens, ref = oracle
    ours = log_softmax(logits_of(core.model, tokens, "f16"))
    ref = log_softmax(ref)
    top5 = np.argsort(-ref, axis=1)[:, :5]
    d = np.abs(np.take_along_axis(ours, top5, 1) - np.take_along_axis(ref, top5, 1))
    assert d.max() < 0.05, f"max |d logprob| over the reference's top-5: {d.max():.3f}"
    gap = np.take_along_axis(ref, top5[:, :1], 1)[:, 0] - np.take_along_axis(ref, top5[:, 1:2], 1)[:, 0]
    clear = gap > 0.05
    assert np.array_equal(ours.argmax(1)[clear], ref.argmax(1)[clear])


def test_greedy_answer_names_paris(core):
    ids = chat_ids(core, "What is the capital of France?")
    events, fin = run(core, ids, max_tokens=16, temperature=0.0)
    text = "".join(e.text for e in events) + fin.text_tail
    assert "Paris" in text, text
    assert fin.reason in ("stop", "length")


# ------------------------------------------------------------------ llama.cpp reference
def _ref_top(entry) -> list[tuple[int, float]]:
    """(id, logprob) best first, from either JSON layout of top_probs_per_position."""
    if isinstance(entry, dict):
        return [(t["id"], t["logprob"]) for t in entry["top"]]
    return [(int(i), float(lp)) for i, lp in entry]


def teacher_forced(model, items, chunk: int = 8):
    """Our log-probs after each prefix of llama.cpp's greedy continuation, up to (and
    including) the first position where our argmax differs from llama.cpp's token. Up to
    that position this is exactly our own greedy continuation, so it finds where the two
    greedy runs part without decoding token by token. All items share each window (one
    span each); an item leaves once it has diverged, so near-ties early cost nothing."""
    caches = [model.new_cache(len(it["prompt_token_ids"]) + len(it["completion_token_ids"]), "f16") for it in items]
    fed = [0] * len(items)  # completion tokens fed so far (the prompt goes with the first window)
    out: list[list[np.ndarray]] = [[] for _ in items]
    active = list(range(len(items)))
    while active:
        pieces = []
        for i in active:
            prompt = items[i]["prompt_token_ids"] if caches[i].length == 0 else []
            pieces.append(prompt + items[i]["completion_token_ids"][fed[i] : fed[i] + chunk])
        spans = [Span(caches[i], caches[i].length, len(p)) for i, p in zip(active, pieces)]
        hidden = model.forward(np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces]), spans)
        off, still = 0, []
        for i, piece in zip(active, pieces):
            comp = items[i]["completion_token_ids"]
            n_prompt = len(piece) - len(comp[fed[i] : fed[i] + chunk])
            # row r predicts the token after it: from the prompt's last token on
            first_row = off + (n_prompt - 1 if n_prompt else 0)
            lp = log_softmax(np.asarray(model.logits(hidden[first_row : off + len(piece)]), dtype=np.float64))
            fed[i] += len(piece) - n_prompt
            diverged = False
            for row in lp:
                if len(out[i]) >= len(comp):
                    break
                out[i].append(row)
                if int(row.argmax()) != comp[len(out[i]) - 1]:
                    diverged = True
                    break
            if not diverged and len(out[i]) < len(comp):
                still.append(i)
            off += len(piece)
        active = still
    return [np.stack(o) for o in out]


def divergences(model, items):
    """Per item: (first diverging position or None, llama.cpp's top-2 gap there, ours there,
    max |d logprob| of the chosen token before it)."""
    rows = []
    for it, lp in zip(items, teacher_forced(model, items)):
        theirs = it["completion_token_ids"]
        ours = lp.argmax(axis=1)
        bad = np.nonzero(ours != np.asarray(theirs[: len(ours)]))[0]
        j = int(bad[0]) if bad.size else None
        agree = []
        for i in range(len(ours) if j is None else j):
            ref_lp = dict(_ref_top(it["top_probs_per_position"][i]))
            agree.append(abs(ref_lp[theirs[i]] - lp[i, theirs[i]]))
        ref_gap = our_gap = None
        if j is not None:
            top = _ref_top(it["top_probs_per_position"][j])
            ref_gap = top[0][1] - top[1][1]
            s = np.sort(lp[j])[::-1]
            our_gap = float(s[0] - s[1])
        rows.append((j, ref_gap, our_gap, max(agree, default=0.0)))
    return rows


@pytest.fixture(scope="module")
def q4_1_divergences(core):
    items = json.loads(shared_file("reference", "smollm2-greedy.json").read_text())["items"]
    return divergences(core.model, items)


@pytest.mark.parametrize("item", range(4))
def test_greedy_matches_llama_cpp_until_a_near_tie(q4_1_divergences, item):
    """Our greedy tokens equal llama.cpp's up to the first position where the two engines'
    choices nearly tie. Our logits equal the float64 recomputation (test above), while
    llama.cpp (f16 flash-attention accumulation, Q8 activations) differs from it by ~0.1
    log-prob, so a near-tie is: llama.cpp's own top-2 gap < 0.3 OR ours < 0.3 there.
    Measured (position: llama.cpp gap / ours): item 0 at 0: 0.24 / 0.086; item 1 at 29:
    0.107 / 0.34; item 2 at 22: 0.067 / 0.066; item 3 at 6: 0.039 / 0.17. Before the
    divergence the chosen token's log-prob agrees within 0.25 (bound 0.5)."""
    j, ref_gap, our_gap, agree = q4_1_divergences[item]
    assert agree < 0.5, f"chosen-token log-prob differs from llama.cpp's by {agree:.3f}"
    if j is not None:
        assert ref_gap < NEAR_TIE or our_gap < NEAR_TIE, (
            f"diverged at {j} with llama.cpp's top-2 gap {ref_gap:.3f} and ours {our_gap:.3f}"
        )


# ------------------------------------------------------------------ the Q2_0 + IQ4_NL model
@pytest.fixture(scope="module")
def mix_core():
    return load_engine(str(shared_file("models", MIX_Q2_0_NAME)), 1)


@pytest.fixture(scope="module")
def mix_items():
    return json.loads(shared_file("reference", "smollm2-mixq2_0-greedy.json").read_text())["items"]


def test_mix_q2_0_model_matches_float64_recomputation(mix_core, mix_items):
    """Q2_0 ffn_gate/ffn_down, IQ4_NL ffn_up, Q4_0 elsewhere, from llama.cpp's quantizer:
    with a float32 KV cache, measured max |d logprob| 3.6e-3 (this 2-bit model amplifies
    float32 rounding ~50x more than the Q4_1 one); bound 2e-2."""
    tokens = mix_items[1]["prompt_token_ids"][:16]  # 16 tokens: the float64 matmuls dominate
    md, weights = reference(str(shared_file("models", MIX_Q2_0_NAME)))
    ref = reference_model.forward(md, weights, tokens)
    ours = logits_of(mix_core.model, tokens, "f32")
    d = np.abs(log_softmax(ours) - log_softmax(ref))
    assert d.max() < 2e-2, f"max |d logprob| {d.max():.2e}"


@pytest.fixture(scope="module")
def mix_divergences(mix_core, mix_items):
    return divergences(mix_core.model, mix_items)


_CHAOTIC = pytest.mark.xfail(strict=True, reason=(
    "2-bit FFN model is rounding-chaotic: strata agrees with the float64 recomputation "
    "(3.6e-3 with f32 KV) but f16 KV alone moves log-probs by ~0.4 and Q8_0 activation "
    "rounding (llama.cpp's) flips the whole top-5 at position 0; not a strata bug"))


@pytest.mark.parametrize("item", [0, pytest.param(1, marks=_CHAOTIC), pytest.param(2, marks=_CHAOTIC),
                                  pytest.param(3, marks=_CHAOTIC)])
def test_mix_q2_0_greedy_vs_llama_cpp(mix_divergences, item):
    """Same criterion as the Q4_1 model. Measured (position: llama.cpp gap / ours): item 0 at
    0: 0.169 / 0.60 (near-tie: passes); item 1 at 0: 1.95 / 2.01; item 2 at 1: 0.98 / 0.63;
    item 3 at 0: 1.64 / 0.92 (strict xfail: see the reason)."""
    j, ref_gap, our_gap, _ = mix_divergences[item]
    if j is not None:
        assert ref_gap < NEAR_TIE or our_gap < NEAR_TIE, (
            f"diverged at {j} with llama.cpp's top-2 gap {ref_gap:.3f} and ours {our_gap:.3f}"
        )
