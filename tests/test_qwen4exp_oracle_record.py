"""The recorded transformers oracle for `qwen4exp` (tests/data/qwen4exp, made by
tests/support/qwen4exp_oracle.py): the files are there, consistent with each other and with the
GGUF the converter wrote; where torch and transformers are importable, the records regenerate."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parent / "data" / "qwen4exp"
GGUF = DATA / "qwen4exp-tiny-f16.gguf"
RECORDS = DATA / "records.npz"
LLAMACPP = DATA / "llamacpp.npz"
META = DATA / "meta.json"
ARCH = "qwen4exp"


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads(META.read_text())


@pytest.fixture(scope="module")
def records() -> dict:
    with np.load(RECORDS) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def reader():
    gguf = pytest.importorskip("gguf")
    return gguf.GGUFReader(str(GGUF))


def _kv(reader, key):
    field = reader.fields.get(key)
    assert field is not None, f"{GGUF.name}: no key {key}"
    return field.contents()


def _tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


# ----------------------------------------------------------------------------- files


def test_files_present_and_small():
    for p in (GGUF, RECORDS, META):
        assert p.is_file(), p
    assert GGUF.stat().st_size < 2 * 1024 * 1024
    total = RECORDS.stat().st_size + META.stat().st_size + (LLAMACPP.stat().st_size if LLAMACPP.exists() else 0)
    assert total < 1024 * 1024


def test_meta_names_versions_and_cases(meta):
    assert meta["pinned"]["transformers"] == "5.23.0"
    assert meta["pinned"]["llama_cpp_commit"].startswith("0c1e57098")
    assert meta["versions"]["transformers"] == "5.23.0"
    assert meta["versions"]["torch"].startswith("2.13.0")
    assert hashlib.sha256(GGUF.read_bytes()).hexdigest() == meta["gguf_sha256"]
    names = [c["name"] for c in meta["cases"]]
    assert len(names) == len(set(names)) >= 4
    cfg = meta["config"]
    kinds = {c["keep"] for c in meta["cases"]}
    assert kinds <= {"full", "top"}
    # what the cases promise to cover
    budget = cfg["indexer_budget"]
    assert any(c["eos_at"] for c in meta["cases"])
    assert any(c["length"] > 3 * budget and not c["decode"] for c in meta["cases"])
    assert any(c["decode"] and c["length"] < budget < c["length"] + c["decode"] for c in meta["cases"])
    assert any(c["decode"] and c["length"] > 3 * budget for c in meta["cases"])
    for c in meta["cases"]:
        # the prompt seeds were chosen so selection and routing have no (near) ties
        if c["indexer_min_gap"] is not None:
            assert c["indexer_min_gap"] >= meta["thresholds"]["indexer_gap"]
        assert c["indexer_zero_score_boundaries"] == 0
        assert c["router_min_gap"] >= meta["thresholds"]["router_gap"]
        if c["decode"]:
            assert c["decode_min_top2_gap"] >= meta["thresholds"]["decode_top2_gap"]
            assert c["cached_vs_full_max_abs"] < 1e-3


def test_records_consistent(meta, records):
    vocab = meta["config"]["vocab_size"]
    eos = meta["eos_token_id"]
    top = meta["top"]
    lo, hi = meta["prompt_ids_from"]
    for c in meta["cases"]:
        n = c["name"]
        ids = records[f"{n}/prompt"]
        assert ids.dtype == np.int32 and ids.shape == (c["length"],)
        eos_pos = set(np.flatnonzero(ids == eos).tolist())
        assert eos_pos == set(c["eos_at"])
        rest = np.delete(ids, list(eos_pos))
        assert rest.min() >= lo and rest.max() < hi
        if c["keep"] == "full":
            logits = records[f"{n}/logits"]
            assert logits.dtype == np.float32 and logits.shape == (c["length"], vocab)
            assert np.isfinite(logits).all()
            last = logits[-1]
        else:
            tid, tlp, last = records[f"{n}/top_ids"], records[f"{n}/top_logprobs"], records[f"{n}/last_logits"]
            assert tid.shape == tlp.shape == (c["length"], top)
            assert last.shape == (vocab,) and np.isfinite(last).all()
            assert ((tid >= 0) & (tid < vocab)).all()
            assert all(len(set(r)) == top for r in tid.tolist())
            assert (tlp <= 0).all() and (np.diff(tlp, axis=1) <= 0).all()
            assert (np.exp(tlp).sum(1) <= 1 + 1e-5).all()
            # the last row's log-softmax is the last top-16 row
            x = last.astype(np.float64)
            ls = x - x.max() - np.log(np.exp(x - x.max()).sum())
            assert np.allclose(ls[tid[-1]], tlp[-1], atol=1e-5)
        if c["decode"]:
            toks, rows = records[f"{n}/decode_tokens"], records[f"{n}/decode_logits"]
            assert toks.shape == (c["decode"],) and rows.shape == (c["decode"], vocab)
            # the greedy chain: the last prompt row picks token 0, decode row i picks token i+1
            chain = [int(np.argmax(last))] + [int(np.argmax(r)) for r in rows[:-1]]
            assert chain == toks.tolist()


def test_llamacpp_records_where_present(meta, records):
    if not LLAMACPP.exists():
        pytest.skip("no llama.cpp records")
    with np.load(LLAMACPP) as z:
        lc = {k: z[k] for k in z.files}
    same_before = meta["config"]["indexer_budget"] + meta["config"]["indexer_compress_ratio"] - 1
    for c in meta["cases"]:
        n = c["name"]
        if c["keep"] == "full":
            a, b = lc[f"{n}/logits"], records[f"{n}/logits"]
            la = a - np.log(np.exp(a - a.max(1, keepdims=True)).sum(1, keepdims=True)) - a.max(1, keepdims=True)
            lb = b - np.log(np.exp(b - b.max(1, keepdims=True)).sum(1, keepdims=True)) - b.max(1, keepdims=True)
            d = np.abs(la - lb).max(1)
        else:
            d = np.abs(lc[f"{n}/top_logprobs"] - records[f"{n}/top_logprobs"]).max(1)
        # F16 weights: llama.cpp rounds activations to F16, a few hundredths of a nat at most
        assert d[:same_before].max() < 0.05, n
        if c["length"] > same_before + 8:
            # past budget + ratio - 1 its wider selection shows (QWEN4EXP.md 0.1)
            assert d[same_before:].max() > 0.05, n


def test_llamacpp_rerun_matches_where_installed(meta, records):
    """Where llama-cpp-python 0.3.36 is installed (`pip install -e .[oracle]`), it reproduces its own
    stored records on this machine (its F16 paths differ slightly across CPUs: a loose bound)."""
    if not LLAMACPP.exists():
        pytest.skip("no llama.cpp records")
    llama_cpp = pytest.importorskip("llama_cpp")
    if llama_cpp.__version__ != meta["pinned"]["llama_cpp_python_sdist"]:
        pytest.skip(f"llama-cpp-python {llama_cpp.__version__}")
    from tests.support import qwen4exp_oracle as O

    with np.load(LLAMACPP) as z:
        stored = {k: z[k] for k in z.files}
    again, _ = O.record_llamacpp(GGUF, records)
    assert set(again) == set(stored)
    for key, want in stored.items():
        assert np.abs(again[key] - want).max() < 0.02, key


# ----------------------------------------------------------------------------- the GGUF


def test_gguf_arch_and_hparams(reader, meta):
    cfg = meta["config"]
    assert _kv(reader, "general.architecture") == ARCH
    p = ARCH + "."
    n_layer = cfg["num_hidden_layers"]
    assert _kv(reader, p + "block_count") == n_layer
    assert _kv(reader, p + "embedding_length") == cfg["hidden_size"]
    assert _kv(reader, p + "expert_count") == cfg["num_experts"]
    assert _kv(reader, p + "expert_used_count") == cfg["num_experts_per_tok"]
    assert _kv(reader, p + "hyper_connection.count") == cfg["hc_count"] == 4
    assert _kv(reader, p + "hyper_connection.low_rank") == cfg["hc_lowrank"]
    assert _kv(reader, p + "attention.indexer.head_count") == cfg["indexer_n_heads"]
    assert _kv(reader, p + "attention.indexer.key_length") == cfg["indexer_head_dim"]
    assert _kv(reader, p + "attention.indexer.top_k") == cfg["indexer_budget"]
    sparse = [t == "full_attention" for t in cfg["layer_types"]]
    assert any(sparse) and not all(sparse)
    recurrent = _kv(reader, p + "attention.recurrent_layers")
    assert [bool(x) for x in recurrent] == [not s for s in sparse]
    # the converter pitfall (QWEN4EXP.md 0.2): the ratios must survive on the sparse layers
    ratios = _kv(reader, p + "attention.compress_ratios")
    assert ratios == [cfg["indexer_compress_ratio"] if s else 0 for s in sparse]
    assert _kv(reader, p + "rope.dimension_count") == int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"])


def test_gguf_ple_keys(reader, meta):
    cfg = meta["config"]
    p = ARCH + ".ple."
    assert _kv(reader, p + "layers") == [i - 1 for i in cfg["ple_layer_ids"]]
    assert _kv(reader, p + "ngram_size") == cfg["ngram_size"]
    assert _kv(reader, p + "heads_per_ngram") == cfg["heads_per_ngram"]
    assert _kv(reader, p + "conv_kernel") == cfg["ple_conv_kernel_size"]
    assert _kv(reader, p + "eos_token_id") == meta["eos_token_id"]
    assert _kv(reader, p + "image_token_id") == meta["image_token_id"]
    n_heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
    row = _kv(reader, ARCH + ".embedding_length_per_layer_input")
    assert row * n_heads == cfg["hidden_size"]
    mults = _kv(reader, p + "layer_multipliers")
    assert len(mults) == cfg["ngram_size"]
    assert all(m % 2 == 1 and 0 < m * (cfg["vocab_size"] - 1) < 2**63 for m in mults)
    offsets, sizes = _kv(reader, p + "head_offsets"), _kv(reader, p + "head_vocab_sizes")
    assert len(offsets) == len(sizes) == n_heads
    assert offsets == [int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]])]
    assert all(s >= cfg["ngram_vocab_size_base"] and all(s % d for d in range(2, int(s**0.5) + 1)) for s in sizes)
    table = _tensors(reader)["per_layer_token_embd.weight"]
    assert [int(x) for x in table.shape] == [row, table.shape[1]]
    assert table.shape[1] >= offsets[-1] + sizes[-1] and table.shape[1] % cfg["make_ngram_vocab_size_divisible_by"] == 0


def test_gguf_tensors(reader, meta):
    cfg = meta["config"]
    t = _tensors(reader)
    h, hc, r = cfg["hidden_size"], cfg["hc_count"], cfg["hc_lowrank"]
    shape = {name: [int(x) for x in ten.shape] for name, ten in t.items()}
    assert shape["token_embd.weight"] == [h, cfg["vocab_size"]]
    assert shape["output.weight"] == [h, cfg["vocab_size"]]
    assert shape["output_hc_norm.weight"] == [hc * h]
    assert shape["output_hc_down.weight"] == [hc * h, r] and shape["output_hc_up.weight"] == [r, hc * h]
    assert "output_norm.weight" not in t
    ple_layer = cfg["ple_layer_ids"][0] - 1
    for il, kind in enumerate(cfg["layer_types"]):
        b = f"blk.{il}."
        for mod in ("attn", "ffn"):
            assert shape[b + f"hc_{mod}_norm.weight"] == [hc * h]
            assert shape[b + f"hc_{mod}_down.weight"] == [hc * h, r]
            assert shape[b + f"hc_{mod}_up.weight"] == [r, hc * h]
            assert shape[b + f"hc_{mod}_inject.weight"] == [hc * h, hc]
        assert shape[b + "ffn_gate_inp.weight"] == [h, cfg["num_experts"]]
        assert shape[b + "ffn_down_exps.weight"] == [cfg["moe_intermediate_size"], h, cfg["num_experts"]]
        assert shape[b + "ffn_gate_inp_shexp.weight"][0] == h
        if kind == "full_attention":
            nq = cfg["num_attention_heads"] * cfg["head_dim"]
            assert shape[b + "attn_q.weight"] == [h, 2 * nq]
            assert shape[b + "indexer.q_proj.weight"] == [h, cfg["indexer_n_heads"] * cfg["indexer_head_dim"]]
            assert shape[b + "indexer.k_proj.weight"] == [h, cfg["indexer_head_dim"]]
            assert b + "ssm_out.weight" not in t
        else:
            nv = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
            assert shape[b + "ssm_out.weight"] == [nv, h]
            assert shape[b + "ssm_a"] == [cfg["linear_num_value_heads"]]
            assert b + "attn_q.weight" not in t
        has_ple = b + "ple_key.weight" in t
        assert has_ple == (il == ple_layer)
    b = f"blk.{ple_layer}."
    assert shape[b + "ple_key.weight"] == [h, hc * h] and shape[b + "ple_value.weight"] == [h, h]
    assert shape[b + "ple_conv1d.weight"] == [cfg["ple_conv_kernel_size"], hc * h]
    for n in ("key", "query", "conv"):
        assert shape[b + f"ple_norm_{n}.weight"] == [hc * h]
    for name, ten in t.items():
        assert np.isfinite(np.asarray(ten.data, dtype=np.float32)).all(), name


# ----------------------------------------------------------------------------- regeneration


@pytest.fixture(scope="module")
def regenerated(meta):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if transformers.__version__ != meta["pinned"]["transformers"]:
        pytest.skip(f"transformers {transformers.__version__}, records made with {meta['pinned']['transformers']}")
    from tests.support import qwen4exp_oracle as O

    torch.set_num_threads(2)
    model = O.build_model(meta["weight_seed"])
    seeds = {c["name"]: c["seed"] for c in meta["cases"]}
    arrays, infos = O.record_all(model, seeds, log=lambda *a: None)
    return O, model, arrays, infos


def test_regenerated_weights_match(meta, regenerated):
    O, model, _, _ = regenerated
    assert O.weights_digest(model) == meta["weights_sha256"]
    assert O.CONFIG == meta["config"]


def test_regenerated_records_match(meta, records, regenerated):
    _, _, arrays, infos = regenerated
    assert set(arrays) == set(records)
    for key, want in records.items():
        got = arrays[key]
        assert got.shape == want.shape and got.dtype == want.dtype, key
        if want.dtype.kind == "i" and not key.endswith("top_ids"):
            assert np.array_equal(got, want), key
        elif key.endswith("top_ids"):
            # top-16 membership may swap only between (near) equal log-probs
            assert (got == want).mean() > 0.99, key
        else:
            # float32 CPU numerics across BLAS builds: ~1e-6 relative; leave room
            assert np.allclose(got, want, atol=2e-4, rtol=1e-4), (key, float(np.abs(got - want).max()))
    for c in meta["cases"]:
        info = infos[c["name"]]
        assert info["indexer_zero_score_boundaries"] == 0
        if info["indexer_min_gap"] is not None:
            assert abs(info["indexer_min_gap"] - c["indexer_min_gap"]) < 1e-4


def test_gguf_holds_the_regenerated_weights(reader, regenerated):
    """The stored GGUF is this model: the tensors the converter copies unchanged are equal."""
    _, model, _, _ = regenerated
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    t = _tensors(reader)

    def g(name):
        ten = t[name]
        return np.asarray(ten.data, dtype=np.float32).reshape([int(x) for x in reversed(ten.shape)])

    assert np.array_equal(g("token_embd.weight"), sd["model.embed_tokens.weight"])
    assert np.array_equal(g("output.weight"), sd["lm_head.weight"])
    assert np.array_equal(g("per_layer_token_embd.weight"),
                          sd["model.layers.1.ple.ple_embedding.ngram_embedding.weight"])
    assert np.array_equal(g("blk.0.ffn_gate_inp.weight"), sd["model.layers.0.mlp.gate.weight"])
    qk = sd["model.layers.3.self_attn.indexer.index_qk_proj.weight"]
    nq = g("blk.3.indexer.q_proj.weight").shape[0]
    assert np.array_equal(g("blk.3.indexer.q_proj.weight"), qk[:nq])
    assert np.array_equal(g("blk.3.indexer.k_proj.weight"), qk[nq:])
    # gammas are stored as 1 + w (QWEN4EXP.md 2)
    assert np.allclose(g("blk.0.hc_attn_norm.weight"), 1 + sd["model.layers.0.attn_hyper_connection.hc_norm.weight"])
    assert np.array_equal(g("blk.1.ple_conv1d.weight"), sd["model.layers.1.ple.conv1d.weight"][:, 0, :])
    # the hash constants come from the checkpoint's int64 buffers, exactly
    ple = "model.layers.1.ple.ple_embedding."
    assert _kv(reader, "qwen4exp.ple.layer_multipliers") == sd[ple + "layer_multipliers"].tolist()
    assert _kv(reader, "qwen4exp.ple.head_offsets") == sd[ple + "ngram_heads_offsets"].tolist()
    assert _kv(reader, "qwen4exp.ple.head_vocab_sizes") == sd[ple + "ngram_heads_vocab_sizes"].tolist()
    # GDN v-heads in GGUF's tiled order: GGUF head j is HF head (j mod n_k) * (n_v / n_k) + j // n_k
    cfg = model.config
    n_k, n_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    hf_a = -np.exp(sd["model.layers.0.linear_attn.A_log"].astype(np.float64))
    order = [(j % n_k) * (n_v // n_k) + j // n_k for j in range(n_v)]
    assert np.allclose(g("blk.0.ssm_a"), hf_a[order], rtol=1e-6)
    assert np.array_equal(g("blk.0.ssm_dt.bias"), sd["model.layers.0.linear_attn.dt_bias"][order])
