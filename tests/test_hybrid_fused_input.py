"""qwen3next packs whose DeltaNet layers hold one fused `ssm_in.weight` (q, k, v and z per key
group, as earlier llama.cpp converters wrote them) instead of attn_qkv + attn_gate, on the CPU.

The split pack compared against is made here from the fused one by numpy reshapes of its byte
rows written from llama.cpp's qwen3next.cpp (build_qkvz's views), not by the loader's own split
(strata/model/layers/fused_qkvz.py); the float64 reference reads ssm_in by its own reshape too.
tests/test_llamacpp_oracle_fused.py has llama.cpp itself on such a pack.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata.backend.cpu import CpuBackend
from strata.cli import main as cli_main
from strata.errors import StrataError
from strata.gguf.reader import GGUFFile
from strata.gguf.writer import GGUFWriter
from strata.model.build import build_model
from strata.model.transformer import Span
from strata.pack.loader import open_pack
from strata.pack.presets import TINY
from strata.pack.synth import synth_pack
from strata.pack.synth_plan import with_delta_net_input
from tests.support import reference_hybrid, reference_model

IDS = [1, 200, 300, 4000, 50, 60, 70, 80, 9, 1234]


def _rewrite(src, dst, change):
    """dst: src's metadata and tensors, each passed through change(name, type, ne, raw bytes)
    -> [(name, type, ne, bytes)] (several, one or none)."""
    with GGUFFile(src) as g:
        w = GGUFWriter(dst)
        w.add_all_metadata(g.metadata, g.metadata_types)
        for t in g.tensors.values():
            for name, type_id, ne, data in change(t.name, t.ggml_type, tuple(t.shape), np.array(t.data())):
                w.add_tensor(name, type_id, ne, data)
        w.write()
    return dst


def split_copy(src, dst):
    """The fused pack with each ssm_in rewritten as attn_qkv + attn_gate. Its ne1 rows are, per
    key group g, [q (S) | k (S) | v (r S) | z (r S)]; attn_qkv is every group's q, then every k,
    then every v; attn_gate every group's z (llama.cpp's qwen3next.cpp, build_qkvz)."""
    md = GGUFFile(src).metadata
    S, Hk, Hv = (int(md[f"qwen3next.ssm.{k}"]) for k in ("state_size", "group_count", "time_step_rank"))
    r = Hv // Hk

    def change(name, type_id, ne, raw):
        if not name.endswith(".ssm_in.weight"):
            return [(name, type_id, ne, raw)]
        rows = raw.reshape(Hk, 2 * S + 2 * r * S, -1)  # byte rows by key group
        q, k, v, z = np.split(rows, [S, 2 * S, 2 * S + r * S], axis=1)
        p = name.removesuffix("ssm_in.weight")
        qkv = np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
        return [(p + "attn_qkv.weight", type_id, (ne[0], 2 * S * Hk + S * Hv), qkv),
                (p + "attn_gate.weight", type_id, (ne[0], S * Hv), z.reshape(-1))]

    return _rewrite(src, dst, change)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused-input")
    spec = with_delta_net_input(replace(TINY["qwen3next"], vocab=4096), "fused")  # a small head: fast
    (fused,) = synth_pack(spec, root / "fused", progress=lambda *a: None)
    return fused, split_copy(fused, root / "split" / "model.gguf")


def _model(path):
    pack = open_pack(pack=str(path))
    return build_model(CpuBackend(), pack.model_config(), lambda n: pack.tensors.get(n))


def _logits(model):
    cache = model.new_cache(64, "f16")
    _, logits = model.forward(np.asarray(IDS), [Span(cache, 0, len(IDS))], logit_rows=list(range(len(IDS))))
    return np.asarray(logits)


def test_synth_writes_the_fused_form(packs):
    fused, split = packs
    names = set(GGUFFile(fused).tensors)
    assert "blk.0.ssm_in.weight" in names and "blk.0.ssm_ba.weight" in names
    assert not any(n.endswith(("attn_gate.weight", "attn_qkv.weight")) for n in names if n.startswith("blk.0."))
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight"} <= set(GGUFFile(split).tensors)


def test_fused_and_split_packs_give_the_same_logits(packs):
    fused, split = (_model(p) for p in packs)
    assert {layer.mixer.input_form for layer in fused.recurrent_layers} == {"fused"}
    assert {layer.mixer.input_form for layer in split.recurrent_layers} == {"split"}
    np.testing.assert_array_equal(_logits(fused), _logits(split))


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_fused_pack_matches_the_float64_reference(packs):
    md, W = reference_model.load(packs[0])
    want = _log_softmax(reference_hybrid.forward(md, W, IDS, kv_round="f16"))
    got = _log_softmax(_logits(_model(packs[0])))
    top = np.argsort(-want, axis=1)[:, :5]
    assert np.abs(np.take_along_axis(got, top, 1) - np.take_along_axis(want, top, 1)).max() < 2e-3


def test_a_bad_ssm_in_shape_is_one_line_naming_file_and_tensor(packs, tmp_path, capsys):
    def shorter(name, type_id, ne, raw):  # one key group's rows too few
        if name != "blk.0.ssm_in.weight":
            return [(name, type_id, ne, raw)]
        keep = ne[1] - ne[1] // 2
        return [(name, type_id, (ne[0], keep), raw[: raw.size // ne[1] * keep])]

    bad = _rewrite(packs[0], tmp_path / "bad.gguf", shorter)
    assert cli_main.main(["generate", "--pack", str(bad), "--prompt", "hi", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"strata: pack {bad}: tensor blk.0.ssm_in.weight has shape [256, 192] but the metadata implies [256, 384]"]


def test_no_input_projection_names_both_forms(packs, tmp_path):
    bad = _rewrite(packs[0], tmp_path / "none.gguf",
                   lambda name, *rest: [] if name == "blk.1.ssm_in.weight" else [(name, *rest)])
    with pytest.raises(StrataError, match=r"^pack: missing required tensor blk\.1\.attn_qkv\.weight "
                                          r"\(or blk\.1\.ssm_in\.weight in its place\)$"):
        _model(bad)


def test_the_fused_form_is_for_qwen3next_only(tmp_path, capsys):
    assert cli_main.main(["pack", "synth", "--arch", "qwen35", "--delta-net-input", "fused",
                          "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "strata: --delta-net-input fused: only qwen3next packs hold a fused ssm_in, not --arch qwen35")


def test_the_start_up_line_names_the_fused_form(packs):
    from tests.support.engines import load_engine

    lines = [ln for p in packs for ln in load_engine(["--pack", str(p), "--device", "cpu", "--max-context", "64"])[1]
             if ln.startswith("strata: recurrent state: ")]
    assert len(lines) == 2 and "input projection from the fused ssm_in in 3" in lines[0], lines
    assert "fused" not in lines[1], lines
