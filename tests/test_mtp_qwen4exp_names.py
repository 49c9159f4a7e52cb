"""The qwen4exp MTP layer's tensor names (strata/pack/mtp_names.py): each writer's layout, as
synthetic name lists, maps onto the one Strata reads; unknown, doubled, mixed and missing names
are one line naming the file and the tensor."""

from __future__ import annotations

import pytest

from strata.errors import StrataError
from strata.pack.mtp_names import CANONICAL, EH_PROJ, LAYER, LAYOUTS, SHARED, map_mtp_names

N = 48  # the nextn block: the target's block_count
LAYER_NAMES = [f"blk.{N}.{s}" for s in sorted(LAYER - {"ffn_gate_up_exps.weight"})]
CANON = sorted(CANONICAL)

# each writer's nextn names, as its files carry them (the module docstring says where each was read)
NEXTN = {
    "ggml-org/llama.cpp#27836": ["eh_proj", "enorm", "hnorm", "hc_head_norm", "hc_head_down", "hc_head_up"],
    "ggml-org/llama.cpp#28610": ["embed_proj", "hidden_proj", "enorm", "hnorm", "hc_head_norm", "hc_head_down", "hc_head_up"],
    "FR-Spec (drluoto)": ["fc_embd", "fc_hidden", "enorm", "hnorm", "hc_norm", "hc_down", "hc_up"],
}
HALVES = {"ggml-org/llama.cpp#28610": ("embed_proj", "hidden_proj"), "FR-Spec (drluoto)": ("fc_embd", "fc_hidden")}


def _file(layout: str, extra=()) -> list[str]:
    return [f"blk.{N}.nextn.{s}.weight" for s in NEXTN[layout]] + LAYER_NAMES + list(extra)


@pytest.mark.parametrize("layout", sorted(NEXTN))
def test_each_layout_maps_onto_the_canonical_names(layout):
    got = map_mtp_names(_file(layout, SHARED), "--mtp m.gguf", mtp_only=True)
    assert got.block == N and layout in got.layouts
    assert got.layer == {s: f"blk.{N}.{s}" for s in LAYER - {"ffn_gate_up_exps.weight"}}
    assert sorted(got.shared) == sorted(SHARED)
    if layout in HALVES:
        embed, hidden = HALVES[layout]
        assert got.eh_proj_halves == {"embed": f"blk.{N}.nextn.{embed}.weight",
                                      "hidden": f"blk.{N}.nextn.{hidden}.weight"}
        assert sorted(got.nextn) == [s for s in CANON if s != EH_PROJ]
    else:
        assert got.eh_proj_halves == {} and sorted(got.nextn) == CANON
    # the canonical names are each file's own names where they agree, whatever the layout
    assert got.nextn["nextn.enorm.weight"] == f"blk.{N}.nextn.enorm.weight"


def test_27836_and_28243_share_their_names():
    got = map_mtp_names(_file("ggml-org/llama.cpp#27836"), "m.gguf", mtp_only=True)
    assert got.layouts == ("ggml-org/llama.cpp#27836", "ggml-org/llama.cpp#28243")
    assert {l.name for l in LAYOUTS} == {"ggml-org/llama.cpp#27836", "ggml-org/llama.cpp#28243", "ggml-org/llama.cpp#28610", "FR-Spec (drluoto)"}


def test_nextn_tensors_inside_a_pack():
    trunk = ["token_embd.weight", "output.weight", "blk.0.attn_qkv.weight", "per_layer_token_embd.weight"]
    got = map_mtp_names(trunk + _file("ggml-org/llama.cpp#28610"), "pack p", mtp_only=False)
    assert got.block == N and got.shared == () and len(got.layer) == len(LAYER_NAMES)
    assert map_mtp_names(trunk, "pack p", mtp_only=False) is None  # no MTP layer: not an error in a pack


def _line(names, mtp_only=True) -> str:
    with pytest.raises(StrataError) as e:
        map_mtp_names(names, "--mtp m.gguf", mtp_only=mtp_only)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_unknown_names():
    assert _line(_file("ggml-org/llama.cpp#27836", [f"blk.{N}.nextn.mystery.weight"])) == (
        f"--mtp m.gguf: tensor blk.{N}.nextn.mystery.weight: not a tensor of the MTP layer in any known layout "
        "(ggml-org/llama.cpp#27836, ggml-org/llama.cpp#28243, ggml-org/llama.cpp#28610, FR-Spec (drluoto))")
    assert _line(_file("ggml-org/llama.cpp#27836", [f"blk.{N}.ssm_out.weight"])).startswith(
        f"--mtp m.gguf: tensor blk.{N}.ssm_out.weight: not a tensor of the MTP layer")
    assert _line(_file("ggml-org/llama.cpp#27836", ["blk.3.attn_q.weight"])).startswith(
        "--mtp m.gguf: tensor blk.3.attn_q.weight: not a tensor of an MTP-only file")
    assert _line(_file("FR-Spec (drluoto)", ["d2t"])) == (
        "--mtp m.gguf: tensor d2t: the FR-Spec head's vocabulary map (a head trimmed to part of the vocabulary)")
    assert _line(_file("ggml-org/llama.cpp#27836", [f"blk.{N}.nextn.shared_head_norm.weight"])).startswith(
        f"--mtp m.gguf: tensor blk.{N}.nextn.shared_head_norm.weight: a head whose exit mixer is split")


def test_doubled_names():
    assert _line(_file("ggml-org/llama.cpp#27836", [f"blk.{N}.nextn.hc_norm.weight"])) == (
        f"--mtp m.gguf: tensors blk.{N}.nextn.hc_head_norm.weight and blk.{N}.nextn.hc_norm.weight "
        "are both nextn.hc_head_norm.weight")
    assert _line(_file("ggml-org/llama.cpp#27836", [f"blk.{N}.nextn.fc_embd.weight"])) == (
        f"--mtp m.gguf: tensors blk.{N}.nextn.eh_proj.weight and blk.{N}.nextn.fc_embd.weight "
        "are both the embed half of nextn.eh_proj.weight")
    assert _line(_file("ggml-org/llama.cpp#27836", [f"blk.{N}.nextn.enorm.weight"])) == (
        f"--mtp m.gguf: tensor blk.{N}.nextn.enorm.weight appears twice")
    assert _line(_file("ggml-org/llama.cpp#27836", [f"blk.{N}.attn_q.weight"])) == (
        f"--mtp m.gguf: tensor blk.{N}.attn_q.weight appears twice")
    assert _line(_file("ggml-org/llama.cpp#27836", ["output.weight", "output.weight"])) == (
        "--mtp m.gguf: tensor output.weight appears twice")


def test_names_of_two_layouts():
    names = [n.replace("hidden_proj", "fc_hidden") for n in _file("ggml-org/llama.cpp#28610")]
    assert _line(names) == (f"--mtp m.gguf: tensor blk.{N}.nextn.fc_hidden.weight is named as in FR-Spec (drluoto), "
                            f"blk.{N}.nextn.embed_proj.weight as in ggml-org/llama.cpp#28610; a file uses one layout")


def test_missing_names():
    names = [n for n in _file("ggml-org/llama.cpp#27836") if not n.endswith("nextn.hnorm.weight")]
    assert _line(names) == f"--mtp m.gguf: the MTP layer lacks blk.{N}.nextn.hnorm.weight"
    names = [n for n in _file("ggml-org/llama.cpp#27836") if not n.endswith("nextn.hc_head_up.weight")]
    assert _line(names) == f"--mtp m.gguf: the MTP layer lacks blk.{N}.nextn.hc_head_up.weight (or nextn.hc_up.weight)"
    names = [n for n in _file("ggml-org/llama.cpp#28610") if not n.endswith("hidden_proj.weight")]
    assert _line(names) == (f"--mtp m.gguf: tensor blk.{N}.nextn.embed_proj.weight is the embed half of the input "
                            "projection, and its hidden half is missing")
    assert _line(LAYER_NAMES) == "--mtp m.gguf: no MTP layer (no blk.N.nextn.* tensor)"
    two = _file("ggml-org/llama.cpp#27836") + [f"blk.49.nextn.enorm.weight"]
    assert _line(two) == "--mtp m.gguf: MTP layers in blocks 48, 49; qwen4exp has one"
