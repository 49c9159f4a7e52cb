"""Synthetic packs: read back shapes/types/metadata, shards, MTP drafts, flag errors,
and (when llama-cpp-python is installed) llama.cpp itself loading and running them."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.gguf import GGUFFile
from strata.pack import open_pack
from strata.pack.presets import PRESETS, TINY
from strata.pack.synth import synth_pack, smollm_model_path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_KEYS_SAMPLE = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
                         "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id")


def _strata(*args):
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def _synth(tmp_path, spec, **kw):
    out = tmp_path / "pack"
    files = synth_pack(spec, out, progress=lambda line: None, **kw)
    return out, files


def _expected_block(arch, e, q, kv, hd, ff, n_exp=0):
    """Tensor -> ne, written out by hand from llama.cpp's tensor layouts (independent of synth)."""
    t = {"attn_norm.weight": (e,), "attn_q.weight": (e, q), "attn_k.weight": (e, kv), "attn_v.weight": (e, kv),
         "attn_output.weight": (q, e), "ffn_norm.weight": (e,)}
    if arch == "qwen2":
        t |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if arch in ("qwen3", "qwen3moe"):
        t |= {"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)}
    if n_exp:
        t |= {"ffn_gate_inp.weight": (e, n_exp), "ffn_gate_exps.weight": (e, ff, n_exp),
              "ffn_up_exps.weight": (e, ff, n_exp), "ffn_down_exps.weight": (ff, e, n_exp)}
    else:
        t |= {"ffn_gate.weight": (e, ff), "ffn_up.weight": (e, ff), "ffn_down.weight": (ff, e)}
    return t


@pytest.fixture(scope="module")
def test_model():
    path = smollm_model_path()
    if not path.exists():
        pytest.skip("test model not installed")
    return GGUFFile(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
def test_each_arch_reads_back(arch, tmp_path, test_model):
    spec = TINY[arch]
    out, files = _synth(tmp_path, spec)
    assert [f.name for f in files] == ["model.gguf"]
    pack = open_pack(str(out))
    m = pack.metadata
    assert pack.arch == arch
    e, hd = spec.n_embd, spec.head_dim
    q, kv = spec.n_head * hd, spec.n_head_kv * hd
    assert m[f"{arch}.block_count"] == spec.n_layer and m[f"{arch}.embedding_length"] == e
    assert m[f"{arch}.attention.head_count"] == spec.n_head and m[f"{arch}.attention.head_count_kv"] == spec.n_head_kv
    assert m[f"{arch}.attention.key_length"] == hd and m[f"{arch}.attention.value_length"] == hd
    assert m[f"{arch}.context_length"] > 0 and m[f"{arch}.rope.freq_base"] > 0
    assert 0 < m[f"{arch}.attention.layer_norm_rms_epsilon"] < 1e-3
    for key in TOKENIZER_KEYS_SAMPLE:
        assert m[key] == test_model.metadata[key], key
        assert pack.metadata_types[key] == test_model.metadata_types[key]
    assert {k for k in m if k.startswith("tokenizer.")} == {k for k in test_model.metadata if k.startswith("tokenizer.")}

    if arch == "qwen3moe":
        assert m[f"{arch}.expert_count"] == spec.n_expert and m[f"{arch}.expert_used_count"] == spec.n_expert_used
        assert m[f"{arch}.expert_feed_forward_length"] == spec.expert_ff
        block = _expected_block(arch, e, q, kv, hd, spec.expert_ff, spec.n_expert)
    else:
        assert m[f"{arch}.feed_forward_length"] == spec.n_ff
        block = _expected_block(arch, e, q, kv, hd, spec.n_ff)
    expected = {"token_embd.weight": (e, 49152), "output_norm.weight": (e,), "output.weight": (e, 49152)}
    for layer in range(spec.n_layer):
        expected |= {f"blk.{layer}.{k}": v for k, v in block.items()}
    assert {n: t.shape for n, t in pack.tensors.items()} == expected
    for name, info in pack.tensors.items():
        if "norm" in name or name.endswith(".bias") or "gate_inp" in name:
            assert info.type.name == "F32", name
    norm = pack.tensor("blk.0.attn_norm.weight").data().view(np.float32)
    assert abs(float(norm.mean()) - 1.0) < 0.05 and norm.std() > 0


def test_seed_moe_types_alternate(tmp_path):
    spec = PRESETS["seed-moe"]
    out, _ = _synth(tmp_path, spec)
    pack = open_pack(str(out))
    kinds = {n: t.type.name for n, t in pack.tensors.items()}
    assert [kinds[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == ["Q2_0", "IQ4_NL", "Q2_0", "IQ4_NL"]
    assert all(kinds[f"blk.{i}.ffn_gate_exps.weight"] == "IQ3_S" for i in range(4))
    assert all(kinds[f"blk.{i}.ffn_up_exps.weight"] == "IQ3_XXS" for i in range(4))
    assert all(kinds[f"blk.{i}.attn_{r}.weight"] == "Q4_K" for i in range(4) for r in ("q", "k", "v", "output"))
    assert kinds["token_embd.weight"] == "Q8_0" and kinds["output.weight"] == "Q6_K"
    assert pack.tensor("blk.1.ffn_down_exps.weight").shape == (640, 256, 16)


def test_weight_scale_is_sane(tmp_path):
    gguf = pytest.importorskip("gguf")
    out, _ = _synth(tmp_path, TINY["llama"])
    info = open_pack(str(out)).tensor("blk.0.ffn_down.weight")  # Q4_K, rows of 512
    w = gguf.quants.dequantize(info.data(), gguf.GGMLQuantizationType(info.ggml_type)).astype(np.float64)
    assert np.isfinite(w).all()
    rms = np.sqrt(np.mean(w**2))
    assert 0.5 / np.sqrt(512) < rms < 2.0 / np.sqrt(512)


def test_shards_match_single_file(tmp_path):
    spec = TINY["qwen3moe"]
    single, _ = _synth(tmp_path / "a", spec, seed=5)
    split, files = _synth(tmp_path / "b", spec, seed=5, shards=3, name="IQ3_S")
    assert [f.name for f in files] == [f"IQ3_S-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    one, three = open_pack(str(single)), open_pack(str(split))
    assert len(three.files) == 3
    assert list(one.tensors) == list(three.tensors)
    for name, info in one.tensors.items():
        assert np.array_equal(info.data(), three.tensors[name].data()), name
    assert three.metadata["split.count"] == 3 and three.metadata["split.no"] == 0
    assert three.metadata["split.tensors.count"] == len(one.tensors)
    second = GGUFFile(files[1])
    assert second.metadata == {"split.no": 1, "split.count": 3, "split.tensors.count": len(one.tensors)}
    # the seed config's flag form over a synthetic split pack
    seed_form = open_pack(pack=str(split), native=files[0].name, ple_gguf=[files[1].name])
    assert set(seed_form.tensors) == set(one.tensors)


def test_mtp_draft(tmp_path):
    spec = TINY["qwen3moe"]
    out, files = _synth(tmp_path, spec, mtp_dir=tmp_path / "mtp")
    assert files[-1] == tmp_path / "mtp" / "mtp.gguf"
    draft = GGUFFile(files[-1])
    assert draft.metadata["general.architecture"] == "strata-mtp"
    assert draft.metadata["strata-mtp.target_architecture"] == "qwen3moe"
    assert draft.metadata["strata-mtp.embedding_length"] == spec.n_embd
    e = spec.n_embd
    shapes = {n: t.shape for n, t in draft.tensors.items()}
    assert shapes["mtp.enorm.weight"] == (e,) and shapes["mtp.hnorm.weight"] == (e,)
    assert shapes["mtp.output_norm.weight"] == (e,) and shapes["mtp.eh_proj.weight"] == (2 * e, e)
    target = open_pack(str(out))
    for name, info in target.tensors.items():
        if name.startswith("blk.0."):
            mine = draft.tensors["mtp.blk." + name[len("blk.0."):]]
            assert (mine.shape, mine.ggml_type) == (info.shape, info.ggml_type), name
    assert len([n for n in draft.tensors if n.startswith("mtp.blk.")]) == len(
        [n for n in target.tensors if n.startswith("blk.0.")])


def test_vocab_override_shrinks_tokenizer(tmp_path):
    from dataclasses import replace
    out, _ = _synth(tmp_path, replace(TINY["llama"], vocab=2000, n_layer=1))
    pack = open_pack(str(out))
    tokens = pack.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 2000 and len(pack.metadata["tokenizer.ggml.token_type"]) == 2000
    vocab = set(tokens)
    merges = pack.metadata["tokenizer.ggml.merges"]
    assert merges and all(a in vocab and b in vocab and a + b in vocab for a, b in (m.split(" ", 1) for m in merges))
    assert pack.tensor("token_embd.weight").shape == (256, 2000)


def test_cli_synth_and_inspect(tmp_path):
    out = tmp_path / "p"
    proc = _strata("pack", "synth", "--out", str(out), "--arch", "qwen3", "--layers", "1", "--n-embd", "128",
                   "--heads", "2", "--kv-heads", "1", "--n-ff", "256", "--vocab", "1000", "--type", "attn=Q8_0",
                   "--type", "ffn_gate=Q8_0", "--type", "ffn_up=Q8_0", "--type", "output=Q8_0",
                   "--type", "ffn_down=Q4_0/Q5_0", "--shards", "2", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("wrote ") == 2
    report = json.loads(_strata("inspect", str(out), "--json").stdout)
    assert report["metadata"]["layers"] == 1 and report["metadata"]["embedding"] == 128
    types = {t["name"]: t["type"] for t in report["tensors"]}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "Q4_0"


@pytest.mark.parametrize("flags, words", [
    (["--type", "attn=Q9_9"], ["attn=Q9_9", "unknown type Q9_9"]),
    (["--type", "wings=Q4_K"], ["wings", "unknown role"]),
    (["--type", "attn"], ["--type attn", "ROLE=TYPE"]),
    (["--preset", "seed-moe", "--type", "ffn_down_exps=Q4_K"], ["ffn_down_exps=Q4_K", "640", "Q4_K"]),
    (["--heads", "3", "--kv-heads", "2"], ["--heads 3", "--kv-heads 2"]),
])
def test_cli_bad_flags_one_line(tmp_path, flags, words):
    proc = _strata("pack", "synth", "--out", str(tmp_path / "p"), *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: ")
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not list((tmp_path / "p").glob("*.gguf"))  # nothing written


def test_llama_cpp_loads_synthetic_packs(tmp_path):
    """llama.cpp (an independent implementation) accepts our metadata, names and layouts."""
    pytest.importorskip("llama_cpp")
    paths = []
    for arch in ("llama", "qwen2", "qwen3"):
        paths.append(str(_synth(tmp_path / arch, TINY[arch])[1][0]))
    # seed-moe (Q2_0, IQ3_S, IQ3_XXS, IQ4_NL experts) as a split pack: llama.cpp opens shard 1
    paths.append(str(_synth(tmp_path / "moe", PRESETS["seed-moe"], shards=2, name="IQ3_S")[1][0]))
    code = (
        "import sys, llama_cpp\n"
        "for p in sys.argv[1:]:\n"
        "    m = llama_cpp.Llama(model_path=p, n_ctx=32, n_threads=2, verbose=False)\n"
        "    ids = m.tokenize(b'Hello there')\n"
        "    m.eval(ids)\n"
        "    print(p, m.n_vocab(), m.scores[len(ids) - 1].argmax())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4 and all(line.split()[1] == "49152" for line in lines)


def test_presets_plan_cleanly_and_smollm_matches_the_test_model(test_model):
    from strata.pack.synth import check_spec, plan_tensors
    for name, spec in PRESETS.items():
        check_spec(spec, plan_tensors(spec))  # every preset's types fit its rows
    plans = {p.name: (p.ne, p.gtype.name) for p in plan_tensors(PRESETS["smollm"])}
    real = {n: (t.shape, t.type.name) for n, t in test_model.tensors.items()}
    assert plans == real
    full = PRESETS["seed-moe-full"]
    assert (full.n_embd, full.n_layer, full.n_expert, full.n_expert_used, full.expert_ff) == (2048, 48, 128, 8, 640)
