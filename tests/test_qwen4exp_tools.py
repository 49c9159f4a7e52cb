"""qwen4exp through the tools: `strata pack synth` (tiny, and the presets at the real widths, the
full one planned only), `strata inspect`, `strata probe` and `strata kernels` on a tiny pack with
the IQ3_S-like type plan (`streams-iq3s`: IQ3_S experts with IQ4_NL downs, the n-gram table's
IQ4_NL rows, F16 indexer projections, F32 norms and conv taps), each naming the new tensor roles.

The full preset's plan against QWEN4EXP.md section 1 (what llama-quantize writes for IQ3_S):
experts 53.32 GiB (53.3), n-gram table 26.82 GiB (26.8), total 83.72 GiB (82.6: the plan keeps
the embedding at Q8_0 and the DeltaNet projections at Q4_K, about 1.1 GiB more than IQ3_S).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from strata.cli import main as cli_main
from strata.pack.loader import open_pack
from strata.pack.presets import PRESETS, TINY, TYPE_PLANS
from strata.pack.synth import synth_pack
from strata.pack.synth_plan import check_spec, plan_tensors, spec_config

GIB = 2**30
# llama-quantize's IQ3_S on Qwen3.8-Flash-Next (QWEN4EXP.md section 1), GiB
IQ3S_GIB = {"experts": 53.3, "ple": 26.8, "total": 82.6}
REAL_TABLE_ROWS = 320001536  # 16 prime vocabularies 20000003..20000171 (320001446), padded to 128
# the roles qwen4exp adds to the hybrid family's, with the type the plan gives them
NEW_ROLES = {"per_layer_token_embd": "IQ4_NL", "blk.*.ffn_down_exps": "IQ4_NL", "blk.*.ffn_gate_exps": "IQ3_S",
             "blk.*.hc_attn_norm": "F32", "blk.*.hc_attn_down": "Q8_0", "blk.*.hc_ffn_inject": "Q8_0",
             "output_hc_norm": "F32", "output_hc_up": "Q8_0", "blk.*.indexer.q_proj": "F16",
             "blk.*.indexer.k_proj": "F16", "blk.*.indexer.k_norm": "F32", "blk.*.ple_key": "Q8_0",
             "blk.*.ple_conv1d": "F32", "blk.*.ple_norm_query": "F32"}


def _part(name: str) -> str:
    return "experts" if "_exps" in name else "ple" if name.startswith("per_layer_token_embd") else "other"


@pytest.fixture(scope="module")
def iq3s_pack(tmp_path_factory):
    """The tiny shapes with streams-iq3s, where its types fit the tiny rows (the DeltaNet output
    and the attention output rows are 96 and 128 wide: Q8_0 there)."""
    plan = {**TYPE_PLANS["streams-iq3s"], "ssm_out": "Q8_0", "attn_output": "Q8_0", "attn_q": "Q8_0",
            "attn_k": "Q8_0", "attn_v": "Q8_0", "ssm_in": "Q4_K"}
    out = tmp_path_factory.mktemp("qwen4exp-iq3s")
    synth_pack(replace(TINY["qwen4exp"], vocab=2048, types=plan), out, mtp_dir=out / "mtp",
               progress=lambda *a, **k: None)
    return out


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli_main.main(list(argv))
    got = capsys.readouterr()
    return rc, got.out, got.err


def test_pack_synth_arch_qwen4exp_writes_a_pack_the_engine_loads(tmp_path, capsys):
    rc, out, err = _cli(capsys, "pack", "synth", "--arch", "qwen4exp", "--vocab", "1024", "--out", str(tmp_path))
    assert rc == 0 and err == "" and "wrote" in out
    cfg = open_pack(pack=str(tmp_path)).model_config()
    assert cfg.arch == "qwen4exp" and cfg.n_layer == 4 and cfg.hybrid.compress_ratios == (0, 0, 0, 4)


@pytest.mark.parametrize("name, layers", [("qwen4exp-flash", 12), ("qwen4exp-full", 48)])
def test_presets_at_the_real_widths_plan_and_pass_the_key_table(name, layers):
    spec = PRESETS[name]
    plans = plan_tensors(spec)
    check_spec(spec, plans)  # every type fits its rows
    cfg = spec_config(spec)  # the synthetic pack's metadata through the key table
    h = cfg.hybrid
    assert (cfg.n_layer, cfg.n_embd, h.hc_count, h.hc_rank, h.idx_top_k, h.ple_row) == (layers, 2560, 4, 320, 2048, 160)
    assert h.compress_ratios[:4] == (0, 0, 0, 4) and sum(h.recurrent) == layers * 3 // 4
    types = {p.name.split(".", 2)[-1] if p.name.startswith("blk.") else p.name: p.gtype.name for p in plans}
    assert types["ffn_down_exps.weight"] == "IQ4_NL" and types["per_layer_token_embd.weight"] == "IQ4_NL"
    assert types["ffn_gate_exps.weight"] == types["ffn_up_exps.weight"] == "IQ3_S"


def test_the_full_preset_plans_the_real_model_s_bytes():
    """48 layers and the real n-gram table, never written: the plan's bytes per part against
    QWEN4EXP.md section 1 (module doc for the numbers)."""
    plans = plan_tensors(PRESETS["qwen4exp-full"])
    table = next(p for p in plans if p.name == "per_layer_token_embd.weight")
    assert table.ne == (160, REAL_TABLE_ROWS) and table.gtype.name == "IQ4_NL"
    parts = {"experts": 0, "ple": 0, "other": 0}
    for p in plans:
        parts[_part(p.name)] += p.nbytes
    got = {"experts": parts["experts"] / GIB, "ple": parts["ple"] / GIB, "total": sum(parts.values()) / GIB}
    assert got["experts"] == pytest.approx(IQ3S_GIB["experts"], rel=0.01)
    assert got["ple"] == pytest.approx(IQ3S_GIB["ple"], rel=0.01)
    assert got["total"] == pytest.approx(IQ3S_GIB["total"], rel=0.03)
    assert not any(p.name.startswith("blk.48.") for p in plans)  # no MTP layer: a hub pack has none


def test_inspect_names_every_new_role_and_key(iq3s_pack, capsys):
    rc, out, err = _cli(capsys, "inspect", str(iq3s_pack))
    assert rc == 0 and err == ""
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and " tensors " in line}
    for role, type_name in NEW_ROLES.items():
        assert f"{type_name} x" in rows[role], (role, rows.get(role))
    assert "\nqwen4exp keys\n" in out and "attention.compress_ratios" in out and "ple.head_vocab_sizes" in out
    assert "hyper_connection.count" in out and "check: ok (the engine would load it: qwen4exp, 4 layers" in out
    rc, out, _ = _cli(capsys, "inspect", str(iq3s_pack), "--json")
    report = json.loads(out)
    assert report["arch_keys"]["attention.compress_ratios"] == [0, 0, 0, 4]
    assert len(report["arch_keys"]["ple.head_offsets"]) == 16 and report["check"] == {"ok": True}
    assert {r["role"] for r in report["roles"]} >= set(NEW_ROLES)


def test_probe_reads_the_table_and_the_conv_taps_as_what_they_are(iq3s_pack, capsys):
    rc, out, err = _cli(capsys, "probe", "--pack", str(iq3s_pack), "--mtp", str(iq3s_pack / "mtp"), "--spec", "2",
                        "--parallel", "2", "--batch-mtp", "--device", "cpu", "--json")
    assert rc == 0, err
    rep = json.loads(out)
    ops = {g["role"]: (g["type"], g["op"]) for g in rep["groups"]}
    assert ops["per_layer_token_embd"] == ("IQ4_NL", "lookup")
    assert ops["blk.*.ple_conv1d"] == ("F32", "elementwise")
    assert ops["blk.*.ffn_down_exps"] == ("IQ4_NL", "matvec") and ops["blk.*.indexer.q_proj"] == ("F16", "matvec")
    assert set(NEW_ROLES) <= set(ops) and "blk.*.nextn.hc_head_down" in ops
    assert all(s["batch_mtp"] for s in rep["slots"])


def test_kernels_lists_the_types_the_pack_uses_with_their_roles(iq3s_pack, capsys):
    rc, out, err = _cli(capsys, "kernels", "--pack", str(iq3s_pack), "--json")
    assert rc == 0 and err == ""
    rows = {r["type"]: r for r in json.loads(out)["rows"]}
    assert set(rows) == {"F32", "F16", "Q8_0", "Q4_K", "Q6_K", "IQ3_S", "IQ4_NL"}
    for role, type_name in NEW_ROLES.items():
        assert role in rows[type_name]["roles"], (role, type_name)
    assert rows["IQ4_NL"]["cpu"] == rows["IQ3_S"]["cpu"] == "native 1..8"
    rc, out, _ = _cli(capsys, "kernels", "--pack", str(iq3s_pack))
    assert rc == 0 and "the 7 types its tensors use" in out
    assert "blk.*.ffn_down_exps, blk.*.ffn_down_shexp, per_layer_token_embd" in out


def test_the_tools_read_a_pack_split_over_shards(tmp_path, capsys):
    """Two shards (split.* keys): each tool finds the other shard from the one named."""
    synth_pack(replace(TINY["qwen4exp"], vocab=1024, types={**TINY["qwen4exp"].types, "ple_table": "IQ4_NL"}),
               tmp_path, shards=2, progress=lambda *a, **k: None)
    first = str(tmp_path / "model-00001-of-00002.gguf")
    rc, out, _ = _cli(capsys, "inspect", "--native", first)
    assert rc == 0 and out.count("  file  ") == 2 and "check: ok" in out and "145 tensors" in out
    rc, out, _ = _cli(capsys, "kernels", "--native", first, "--json")
    rows = {r["type"]: r["roles"] for r in json.loads(out)["rows"]}
    assert rc == 0 and "per_layer_token_embd" in rows["IQ4_NL"] and "blk.*.hc_ffn_norm" in rows["F32"]
    rc, out, _ = _cli(capsys, "probe", "--native", first, "--device", "cpu", "--json")
    assert rc == 0 and len(json.loads(out)["tensors"]) == 145


@pytest.mark.parametrize("spec", [0, 3])
def test_probe_sizes_the_rollback_copy_as_the_engine_does(iq3s_pack, spec):
    """The probe's state-checkpoint plan counts what the engine counts per slot: the DeltaNet
    states and, for qwen4exp, the n-gram conv history with its replay rows."""
    from strata.cli.probe import checkpoint_plan
    from strata.engine.core import EngineCore
    from strata.engine.options import parse_engine_args
    from strata.model.transformer import Transformer

    flags = ["--pack", str(iq3s_pack), "--device", "cpu", "--parallel", "2", "--spec", str(spec)]
    opts = parse_engine_args(flags, serving=False)
    pack = open_pack(pack=str(iq3s_pack))
    try:
        plan = checkpoint_plan(pack, opts, "cpu")
    finally:
        pack.close()
    core = EngineCore.load(parse_engine_args(flags, serving=False), log=lambda line: None)
    try:
        model = core.model
        assert plan.per_slot == model.checkpoint_bytes() > 0
        assert model.checkpoint_bytes() > Transformer.checkpoint_bytes(model)  # the n-gram history's rows count
    finally:
        core.stop()
