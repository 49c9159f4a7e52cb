"""qwen4exp (Qwen3.8-Flash-Next) on the CPU against transformers' own records.

tests/data/qwen4exp/ holds a tiny transformers qwen4_exp model converted by llama.cpp's converter
(qwen4exp-tiny-f16.gguf) and transformers' float32 logits for six cases (records.npz; meta.json
says what each covers: the n-gram EOS cut, prompts far past the indexer's budget, a chunked
prefill, cached decode). The records run a float32 KV cache; with it Strata agrees to float32
noise (measured <= 3.1e-5 on logits and log-probs, every case). The engine's f16 KV cache rounds
k and v, which costs up to 1.7e-3 here, and no greedy token.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from strata.backend.cpu import CpuBackend
from strata.errors import StrataError
from strata.model import kv_cache
from strata.model.build import build_model
from strata.model.config import config_from_metadata
from strata.model.hyper_transformer import HyperTransformer
from strata.model.transformer import Span
from strata.pack.loader import open_pack

DATA = Path(__file__).parent / "data" / "qwen4exp"
GGUF = DATA / "qwen4exp-tiny-f16.gguf"
META = json.loads((DATA / "meta.json").read_text())
CASES = {c["name"]: c for c in META["cases"]}
F32_TOL = 1e-4  # float32 noise is ~3e-5 here; a wrong piece shows as 0.1-1
F16_TOL = 5e-3  # the f16 KV cache's rounding


@pytest.fixture(scope="module")
def pack():
    return open_pack(pack=str(GGUF))


@pytest.fixture(scope="module")
def records():
    return np.load(DATA / "records.npz")


@pytest.fixture
def f32_kv(monkeypatch):
    """A float32 KV cache, as the records ran (the engine offers f16 and int8 only)."""
    monkeypatch.setattr(kv_cache.KVCache, "_rows", lambda self, cap: self.xp.zeros((self.n_kv, cap, self.d),
                                                                                  self.xp.float32))


def _model(pack, md=None, **kw):
    cfg = pack.model_config() if md is None else config_from_metadata(md, label="test")
    return (HyperTransformer(CpuBackend(), cfg, pack.tensors.get, **kw) if kw else
            build_model(CpuBackend(), cfg, pack.tensors.get))


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _worst(m, records, name):
    """Max abs difference per part of the case (logits, top log-probs, last row, decode) and
    whether greedy decoding picks the recorded tokens."""
    case = CASES[name]
    ids = records[f"{name}/prompt"].astype(np.int64)
    cache = m.new_cache(4096, "f16")
    rows, start = [], 0
    for n in case["chunks"] or [len(ids)]:
        rows.append(m.forward(ids[start : start + n], [Span(cache, start, n)], logit_rows=list(range(n)))[1])
        start += n
    logits = np.concatenate(rows)
    out = {}
    if f"{name}/logits" in records:
        out["logits"] = float(np.abs(logits - records[f"{name}/logits"]).max())
    if f"{name}/top_ids" in records:
        got = np.take_along_axis(_log_softmax(logits), records[f"{name}/top_ids"].astype(np.int64), 1)
        out["top"] = float(np.abs(got - records[f"{name}/top_logprobs"]).max())
        out["last"] = float(np.abs(logits[-1] - records[f"{name}/last_logits"]).max())
    if f"{name}/decode_tokens" in records:
        want, rows_want = records[f"{name}/decode_tokens"], records[f"{name}/decode_logits"]
        picked, worst, row = [int(np.argmax(logits[-1]))], 0.0, None
        for i, t in enumerate(want):
            row = m.forward(np.asarray([t]), [Span(cache, len(ids) + i, 1)], logit_rows=[0])[1][0]
            worst = max(worst, float(np.abs(row - rows_want[i]).max()))
            picked.append(int(np.argmax(row)))
        out["decode"] = worst
        assert picked[: len(want)] == [int(t) for t in want]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers_with_a_float32_kv_cache(pack, records, f32_kv, name):
    worst = _worst(_model(pack), records, name)
    assert max(worst.values()) < F32_TOL, worst


@pytest.mark.parametrize("name", ["eos_short", "long_176_eos", "decode_long"])
def test_matches_transformers_with_the_f16_kv_cache(pack, records, name):
    worst = _worst(_model(pack), records, name)
    assert max(worst.values()) < F16_TOL, worst


def test_config_reads_every_key(pack):
    h = pack.model_config().hybrid
    assert (h.hc_count, h.hc_rank, h.idx_heads, h.idx_dim, h.idx_top_k) == (4, 16, 4, 16, 32)
    assert h.compress_ratios == (0, 0, 0, 4, 0, 0, 0, 4) and h.ple_layers == (1,)
    assert (h.ple_ngram, h.ple_heads_per_ngram, h.ple_conv_kernel, h.ple_eos, h.ple_image, h.ple_row) == \
        (3, 8, 4, 511, 509, 4)
    assert h.ple_head_offsets[1] == 257 and h.ple_table_rows == 4806 and h.ple_embed_dim == 64
    assert h.recurrent == (True, True, True, False) * 2 and h.traits.output_gate == "sigmoid"


@pytest.mark.parametrize("key, value, words", [
    ("qwen4exp.ple.head_offsets", [0, 257], "one entry per head"),
    ("qwen4exp.ple.head_vocab_sizes", [300] * 16, "apart from the next head"),
    ("qwen4exp.ple.layer_multipliers", [2**62, 3, 5], "below 2^63"),
    ("qwen4exp.attention.compress_ratios", [4] * 3, "one entry per block"),
    ("qwen4exp.attention.compress_ratios", [3] * 8, "divide attention.indexer.top_k"),
    ("qwen4exp.ple.layers", [9], "below block_count"),
    ("qwen4exp.hyper_connection.count", 0, ">= 1"),
])
def test_a_bad_key_is_one_line_naming_it(pack, key, value, words):
    md = dict(pack.metadata)
    md[key] = np.asarray(value) if isinstance(value, list) else value
    with pytest.raises(StrataError) as e:
        config_from_metadata(md, label="P")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"pack P: metadata key {key}:") and words in msg


def test_a_missing_ple_key_is_named(pack):
    md = {k: v for k, v in pack.metadata.items() if k != "qwen4exp.ple.head_offsets"}
    with pytest.raises(StrataError, match=r"^pack test: metadata key qwen4exp.ple.head_offsets: missing"):
        config_from_metadata(md, label="test")


def test_all_zero_compress_ratios_run_dense_and_say_so_once(pack, records):
    md = dict(pack.metadata)
    md["qwen4exp.attention.compress_ratios"] = np.zeros(8, np.int32)
    said: list[str] = []
    dense = _model(pack, md, say=said.append)
    assert len(said) == 1 and "compress_ratios are 0" in said[0]
    sparse_said: list[str] = []
    sparse = _model(pack, say=sparse_said.append)
    assert not sparse_said
    ids = records["long_112/prompt"].astype(np.int64)
    a = dense.forward(ids, [Span(dense.new_cache(256, "f16"), 0, len(ids))], logit_rows=list(range(len(ids))))[1]
    b = sparse.forward(ids, [Span(sparse.new_cache(256, "f16"), 0, len(ids))], logit_rows=list(range(len(ids))))[1]
    # the same up to position 34 (no query sees more than the budget's blocks before), then not
    assert np.array_equal(a[:35], b[:35]) and np.abs(a[35:] - b[35:]).max() > 1e-3


def test_rollback_restores_every_piece_bit_equal(pack, records):
    """A window of drafts past a prompt, cut back (to its start and inside it), then the right
    tokens: logits equal a sequence that never saw the drafts (QSA KV and indexer keys, DeltaNet
    states, the n-gram ids and PLE history all go back)."""
    m = _model(pack)
    ids = records["decode_long/prompt"].astype(np.int64)
    nxt = records["decode_long/decode_tokens"].astype(np.int64)
    clean = m.new_cache(512, "f16")
    m.forward(ids, [Span(clean, 0, len(ids))])
    want = m.forward(nxt[:4], [Span(clean, len(ids), 4)], logit_rows=[0, 1, 2, 3])[1]
    for keep in (0, 2):
        cut = m.new_cache(512, "f16")
        m.forward(ids, [Span(cut, 0, len(ids))])
        drafts = np.concatenate([nxt[:keep], [511, 7, 200][: 3 - keep]])  # an EOS among the wrong drafts
        m.forward(drafts, [Span(cut, len(ids), 3)])
        cut.truncate(len(ids) + keep)
        got = m.forward(nxt[keep:4], [Span(cut, len(ids) + keep, 4 - keep)], logit_rows=list(range(4 - keep)))[1]
        assert np.array_equal(got, want[keep:])


def test_generate_through_the_engine_gives_the_recorded_tokens(records):
    from tests.support.engines import greedy, load_engine, run_all

    core, lines = load_engine(["--pack", str(GGUF), "--device", "cpu"])
    for name in ("decode_cross", "decode_long"):
        want = [int(t) for t in records[f"{name}/decode_tokens"]]
        toks, _, _ = run_all(core, [records[f"{name}/prompt"].tolist()], greedy(len(want)), threaded=False)[0]
        assert toks == want[: len(toks)] and len(toks) >= min(len(want), want.index(511) if 511 in want else 99)


def test_synthetic_pack_loads_and_runs(tmp_path):
    from strata.pack.presets import PRESETS, TINY
    from strata.pack.synth import synth_pack

    assert PRESETS["qwen4exp-tiny"] == TINY["qwen4exp"] and "qwen4exp-flash" in PRESETS
    synth_pack(replace(TINY["qwen4exp"], vocab=512), tmp_path, progress=lambda *a: None)
    p = open_pack(pack=str(tmp_path / "model.gguf"))
    m = build_model(CpuBackend(), p.model_config(), p.tensors.get)
    logits = m.forward(np.arange(1, 60), [Span(m.new_cache(128, "f16"), 0, 59)], logit_rows=[58])[1]
    assert logits.shape == (1, 512) and np.isfinite(logits).all()


def test_sequences_batched_in_one_window_equal_each_alone(pack, records):
    m = _model(pack)
    a, c = records["long_112/prompt"][:50].astype(np.int64), records["eos_short/prompt"].astype(np.int64)
    ca, cc, sa, sc = (m.new_cache(256, "f16") for _ in range(4))
    both = m.forward(np.concatenate([a, c]), [Span(ca, 0, 50), Span(cc, 0, 40)], logit_rows=[49, 89])[1]
    alone = [m.forward(a, [Span(sa, 0, 50)], logit_rows=[49])[1][0],
             m.forward(c, [Span(sc, 0, 40)], logit_rows=[39])[1][0]]
    assert np.array_equal(both, np.stack(alone))
    step = m.forward(np.asarray([5, 6]), [Span(ca, 50, 1), Span(cc, 40, 1)], logit_rows=[0, 1])[1]
    assert np.array_equal(step[0], m.forward(np.asarray([5]), [Span(sa, 50, 1)], logit_rows=[0])[1][0])
    assert np.array_equal(step[1], m.forward(np.asarray([6]), [Span(sc, 40, 1)], logit_rows=[0])[1][0])


def test_an_embedding_request_averages_the_heads_mix_of_the_streams(pack):
    """An embedding is the mean of what the head reads (the mix of the four streams, n_embd wide),
    L2-normalised, as for every other family."""
    from strata.protocol import GenerationRequest, SamplingParams
    from tests.support.engines import load_engine

    core, _ = load_engine(["--pack", str(GGUF), "--device", "cpu"])
    ids = list(range(3, 43))
    m = _model(pack)
    streams = m.forward(np.asarray(ids), [Span(m.new_cache(64, "f16"), 0, len(ids))])
    want = np.asarray(m.head_input(streams), np.float64).mean(axis=0)
    want /= np.linalg.norm(want)
    handle = core.submit(GenerationRequest(ids, SamplingParams(max_tokens=1), embed=True))
    core.scheduler.run_until_idle()
    fin = handle.collect(10)[2]
    v = np.asarray(fin.embedding)
    assert v.shape == (pack.model_config().n_embd,) and fin.reason == "stop"
    assert float(v @ want) > 1 - 1e-6
