"""The start-up capability probe on a seed-MoE-like tensor map (the original bug's pack shape:
qwen3moe, gate IQ3_S, up IQ3_XXS, down Q2_0 / IQ4_NL alternating, attention Q4_K)."""

from __future__ import annotations

import re

import pytest

from strata.kernels.ggml_types import BY_NAME
from strata.kernels.native_table import cpu_table
from strata.kernels.probe import CANNOT_RUN, GENERIC, NATIVE, role_of, run_probe

N_LAYER, N_EMBD, N_FF, N_EXPERT, N_VOCAB = 8, 256, 128, 16, 1024


def T(name):
    return BY_NAME[name].id


def seed_moe_tensors(n_layer=N_LAYER):
    t = {
        "token_embd.weight": (T("Q4_K"), (N_EMBD, N_VOCAB)),
        "output_norm.weight": (T("F32"), (N_EMBD,)),
        "output.weight": (T("Q6_K"), (N_EMBD, N_VOCAB)),
    }
    for i in range(n_layer):
        b = f"blk.{i}."
        t.update({
            b + "attn_norm.weight": (T("F32"), (N_EMBD,)),
            b + "attn_q.weight": (T("Q4_K"), (N_EMBD, N_EMBD)),
            b + "attn_k.weight": (T("Q4_K"), (N_EMBD, 64)),
            b + "attn_v.weight": (T("Q4_K"), (N_EMBD, 64)),
            b + "attn_output.weight": (T("Q4_K"), (N_EMBD, N_EMBD)),
            b + "attn_q_norm.weight": (T("F32"), (64,)),
            b + "attn_k_norm.weight": (T("F32"), (64,)),
            b + "ffn_norm.weight": (T("F32"), (N_EMBD,)),
            b + "ffn_gate_inp.weight": (T("F32"), (N_EMBD, N_EXPERT)),
            b + "ffn_gate_exps.weight": (T("IQ3_S"), (N_EMBD, N_FF, N_EXPERT)),
            b + "ffn_up_exps.weight": (T("IQ3_XXS"), (N_EMBD, N_FF, N_EXPERT)),
            b + "ffn_down_exps.weight": (T("Q2_0" if i % 2 == 0 else "IQ4_NL"), (N_FF, N_EMBD, N_EXPERT)),
        })
    return t


def mtp_draft():
    return {
        "mtp.enorm.weight": (T("F32"), (N_EMBD,)),
        "mtp.hnorm.weight": (T("F32"), (N_EMBD,)),
        "mtp.eh_proj.weight": (T("Q8_0"), (2 * N_EMBD, N_EMBD)),
        "mtp.blk.attn_q.weight": (T("Q4_K"), (N_EMBD, N_EMBD)),
        "mtp.blk.ffn_down.weight": (T("Q8_0"), (N_FF, N_EMBD)),
    }


def flags(**kw):
    """The engine flags the probe takes (--parallel, --spec, --batch-mtp), as plain values."""
    base = dict(parallel=4, spec=3, batch_mtp=True)
    base.update(kw)
    return base


@pytest.fixture(scope="module")
def table():
    return cpu_table()


def test_roles():
    assert role_of("blk.12.ffn_down_exps.weight") == "blk.*.ffn_down_exps"
    assert role_of("blk.3.nextn.eh_proj.weight") == "blk.*.nextn.eh_proj"
    assert role_of("output.weight") == "output"
    assert role_of("mtp.blk.attn_q.weight") == "mtp.blk.attn_q"


def test_full_table_batch_mtp_on(table):
    rep = run_probe(seed_moe_tensors(), mtp_draft(), "cpu", table, **flags())
    assert rep.can_run
    assert [s.batch_mtp for s in rep.slots] == [True] * 4
    assert all(rep.fallback_reason_code(i) is None for i in range(4))
    lines = rep.startup_lines()
    assert len(lines) == 1 and lines[0].startswith("strata probe: batch-MTP on for slots 0-3 (")
    # every matvec tensor is native on every path it is on
    for t in rep.tensors:
        for p in t.paths.values():
            assert p.status == NATIVE, (t.name, p)
    # 4 slots x (3 + 1) = 16 verify columns: split into 2 launches of <= 8, said in the notes
    assert any("16 columns" in n and "2 native launches" in n for n in rep.notes)
    assert "split into 2 launches" in lines[0]


def test_without_q2_0_batch_mtp_off_one_line(table):
    rep = run_probe(seed_moe_tensors(), mtp_draft(), "cpu", table.without({"Q2_0"}), **flags())
    assert rep.can_run  # generic path still decodes
    assert [s.batch_mtp for s in rep.slots] == [False] * 4
    assert {rep.fallback_reason_code(i) for i in range(4)} == {"no_native_kernel"}
    q2 = sorted(n for n, (tid, _) in seed_moe_tensors().items() if tid == T("Q2_0"))
    assert sorted(rep.slots[0].tensors) == q2
    lines = rep.startup_lines()
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("strata probe: batch-MTP off for slots 0-3: ")
    assert line.count("blk.*.ffn_down_exps") == 1 and line.count("Q2_0") == 1
    assert f"{len(q2)} tensors blk.*.ffn_down_exps are Q2_0" in line
    assert "IQ4_NL" not in line and "no native MMVQ kernel" in line
    assert line.endswith("each drafts only in windows where no other slot is busy, and adds one token per "
                         "window shared with other slots")
    downs = [t for t in rep.tensors if t.role == "blk.*.ffn_down_exps" and t.type_name == "Q2_0"]
    assert {t.paths["decode"].status for t in downs} == {GENERIC}
    assert {t.paths["verify"].status for t in downs} == {GENERIC}


def test_several_groups_listed_compactly(table):
    rep = run_probe(seed_moe_tensors(), mtp_draft(), "cpu", table.without({"Q2_0", "IQ4_NL", "Q8_0"}), **flags())
    line = rep.startup_lines()[0]
    assert "blk.*.ffn_down_exps are Q2_0" in line and "blk.*.ffn_down_exps are IQ4_NL" in line
    assert "mtp.eh_proj is Q8_0" in line and "mtp.blk.ffn_down is Q8_0" in line
    assert len(rep.startup_lines()) == 1


def test_draft_path_blocks_on_shared_output_head(table):
    tensors = seed_moe_tensors()
    tensors["output.weight"] = (T("MXFP4"), (N_EMBD, N_VOCAB))
    rep = run_probe(tensors, mtp_draft(), "cpu", table.without({"MXFP4"}), **flags())
    assert rep.slots[0].reason_code == "no_native_kernel"
    assert rep.slots[0].tensors == ["output.weight"]
    out = next(t for t in rep.tensors if t.name == "output.weight")
    assert set(out.paths) == {"decode", "verify", "draft"}


@pytest.mark.parametrize("kw,probe_kw,code", [
    (dict(parallel=1), {}, "single_slot"),
    (dict(spec=0), {}, "no_draft"),
    ({}, dict(n_gpus=2), "multi_gpu"),
])
def test_reasons_for_all_slots(table, kw, probe_kw, code):
    rep = run_probe(seed_moe_tensors(), mtp_draft(), "cpu", table, **flags(**kw), **probe_kw)
    assert all(not s.batch_mtp and s.reason_code == code for s in rep.slots)
    assert len(rep.slots) == flags(**kw)["parallel"]
    lines = rep.startup_lines()
    assert len(lines) == 1 and "batch-MTP off for slot" in lines[0]
    assert rep.slots[0].reason in lines[0]


def test_no_draft_tensors_means_no_draft(table):
    rep = run_probe(seed_moe_tensors(), None, "cpu", table, **flags())
    assert {s.reason_code for s in rep.slots} == {"no_draft"}
    assert not any("draft" in t.paths for t in rep.tensors)


def test_nextn_tensors_in_the_pack_are_the_draft(table):
    tensors = seed_moe_tensors()
    tensors[f"blk.{N_LAYER}.nextn.eh_proj.weight"] = (T("Q8_0"), (2 * N_EMBD, N_EMBD))
    rep = run_probe(tensors, None, "cpu", table, **flags())
    assert all(s.batch_mtp for s in rep.slots)
    nextn = next(t for t in rep.tensors if "nextn" in t.name)
    assert nextn.draft and set(nextn.paths) == {"draft"}


def test_whole_nextn_layer_is_draft_only(table):
    tensors = seed_moe_tensors()
    n = N_LAYER
    tensors[f"blk.{n}.nextn.eh_proj.weight"] = (T("Q8_0"), (2 * N_EMBD, N_EMBD))
    tensors[f"blk.{n}.attn_q.weight"] = (T("IQ2_XXS"), (N_EMBD, N_EMBD))
    rep = run_probe(tensors, None, "cpu", table.without({"IQ2_XXS"}), **flags())
    q = next(t for t in rep.tensors if t.name == f"blk.{n}.attn_q.weight")
    assert q.draft and set(q.paths) == {"draft"}  # not on the main model's decode path
    assert rep.slots[0].reason_code == "no_native_kernel" and rep.slots[0].tensors == [q.name]


def test_room_runs_out_after_three_slots(table):
    rep = run_probe(seed_moe_tensors(), mtp_draft(), "cpu", table, **flags(),
                    mtp_state_bytes_per_slot=100 << 20, free_bytes=350 << 20)
    assert [s.batch_mtp for s in rep.slots] == [True, True, True, False]
    assert rep.fallback_reason_codes == {0: None, 1: None, 2: None, 3: "no_room"}
    lines = rep.startup_lines()
    assert len(lines) == 1
    assert re.match(r"strata probe: batch-MTP on for slots 0-2; batch-MTP off for slot 3: no room", lines[0])
    assert "100.0 MiB per slot" in lines[0] and "350.0 MiB free" in lines[0]
    assert lines[0].endswith("it drafts only in windows where no other slot is busy, and adds one token per "
                             "window shared with other slots")


def test_room_enough_for_all(table):
    rep = run_probe(seed_moe_tensors(), mtp_draft(), "cpu", table, **flags(),
                    mtp_state_bytes_per_slot=100, free_bytes=400)
    assert all(s.batch_mtp for s in rep.slots)


def test_unknown_type_cannot_run(table):
    tensors = seed_moe_tensors()
    tensors["blk.3.attn_q.weight"] = (99, (N_EMBD, N_EMBD))
    rep = run_probe(tensors, mtp_draft(), "cpu", table, **flags())
    assert rep.can_run is False
    bad = next(t for t in rep.tensors if t.name == "blk.3.attn_q.weight")
    assert bad.paths["decode"].status == CANNOT_RUN and "99" in bad.paths["decode"].why
    assert all(not s.batch_mtp for s in rep.slots)
    assert any("cannot run" in line and "blk.*.attn_q" in line for line in rep.startup_lines())


def test_generic_only_types_still_run(table):
    tensors = seed_moe_tensors()
    tensors["blk.0.attn_v.weight"] = (T("Q8_1"), (N_EMBD, 64))  # no native kernel anywhere
    rep = run_probe(tensors, mtp_draft(), "cpu", table, **flags(batch_mtp=False))
    assert rep.can_run
    v = next(t for t in rep.tensors if t.name == "blk.0.attn_v.weight")
    assert v.paths["decode"].status == GENERIC
    assert rep.startup_lines() == []  # batch-MTP not asked for: nothing to say
    assert {s.reason_code for s in rep.slots} == {"not_requested"}


def test_json_round_trip(table):
    import json

    rep = run_probe(seed_moe_tensors(), mtp_draft(), "cpu", table.without({"Q2_0"}), **flags())
    data = json.loads(json.dumps(rep.to_json()))
    assert data["can_run"] is True and data["backend"] == "cpu"
    assert [s["reason_code"] for s in data["slots"]] == ["no_native_kernel"] * 4
    group = [g for g in data["groups"] if g["role"] == "blk.*.ffn_down_exps" and g["type"] == "Q2_0"]
    assert group and group[0]["count"] == N_LAYER // 2 and group[0]["verify"] == GENERIC
    assert data["lines"] == rep.startup_lines()


def test_float_matrices_never_block_and_unbuilt_backend_is_named():
    from strata.kernels.native_table import NativeTable

    table = NativeTable()  # a backend with no native rows at all
    table.register("cuda", T("Q4_K"), 8, lambda w, x: None, "test")
    tensors = {"blk.0.ffn_gate_inp.weight": (T("F32"), (N_EMBD, N_EXPERT)),
               "blk.0.attn_q.weight": (T("Q4_K"), (N_EMBD, N_EMBD)),
               "output.weight": (T("F16"), (N_EMBD, N_VOCAB))}
    draft = {"mtp.eh_proj.weight": (T("BF16"), (2 * N_EMBD, N_EMBD))}
    rep = run_probe(tensors, draft, "cuda", table, **flags())
    assert all(s.batch_mtp for s in rep.slots)
    router = next(t for t in rep.tensors if t.role == "blk.*.ffn_gate_inp")
    assert router.paths["verify"].status == NATIVE and router.paths["verify"].why == "float matmul"

    empty = NativeTable()
    empty.unavailable["cuda"] = "not built: no CUDA device"
    rep = run_probe(tensors, draft, "cuda", empty, **flags())
    assert rep.slots[0].tensors == ["blk.0.attn_q.weight"]
    assert "cuda kernels not built: no CUDA device" in rep.startup_lines()[0]
