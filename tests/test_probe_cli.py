"""`strata kernels` and `strata probe` as real child processes on real GGUF files."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.gguf.writer import write_gguf
from strata.kernels.ggml_types import BY_NAME
from strata.kernels.random_blocks import random_blocks

SHARED_MIX = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "SmolLM2-135M-Instruct.mix-Q2_0.gguf"
E, FF, VOCAB, LAYERS = 64, 128, 256, 3


def strata(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout)


def _t(name, tname, shape, rng):
    tid = BY_NAME[tname].id
    rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return (name, tid, shape, random_blocks(tid, rows, shape[0], rng, 0.02))


def _moe_pack(path: Path, rng) -> Path:
    tensors = [_t("token_embd.weight", "Q4_K", (256, VOCAB), rng),
               _t("output_norm.weight", "F32", (256,), rng),
               _t("output.weight", "Q6_K", (256, VOCAB), rng)]
    for i in range(LAYERS):
        down = "Q2_0" if i % 2 == 0 else "IQ4_NL"
        tensors += [_t(f"blk.{i}.attn_norm.weight", "F32", (256,), rng),
                    _t(f"blk.{i}.attn_q.weight", "Q4_K", (256, 256), rng),
                    _t(f"blk.{i}.ffn_gate_exps.weight", "IQ3_S", (256, FF, 4), rng),
                    _t(f"blk.{i}.ffn_up_exps.weight", "IQ3_XXS", (256, FF, 4), rng),
                    _t(f"blk.{i}.ffn_down_exps.weight", down, (FF, 256, 4), rng)]
    return write_gguf(path, {"general.architecture": "qwen3moe"}, tensors)


def _draft(path: Path, rng) -> Path:
    tensors = [_t("mtp.enorm.weight", "F32", (256,), rng),
               _t("mtp.hnorm.weight", "F32", (256,), rng),
               _t("mtp.eh_proj.weight", "Q8_0", (512, 256), rng),
               _t("mtp.blk.attn_q.weight", "Q4_K", (256, 256), rng)]
    return write_gguf(path, {"general.architecture": "qwen3moe"}, tensors)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    rng = np.random.default_rng(11)
    return _moe_pack(d / "moe.gguf", rng), _draft(d / "draft.gguf", rng)


def test_kernels_json():
    r = strata("kernels", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    rows = {row["type"]: row for row in data["rows"]}
    for name in ("Q2_0", "IQ4_NL", "IQ3_S", "Q4_K", "MXFP4", "TQ1_0", "F16"):
        assert rows[name]["cpu"] == "native 1..8"
    for name in ("Q8_1", "Q8_K", "I32", "F64"):
        assert rows[name]["cpu"] == "generic"
    assert rows["Q2_0"]["id"] == 42 and rows["Q2_0"]["block"] == 64 and rows["Q2_0"]["bytes"] == 18
    cuda = {row["cuda"] for row in data["rows"]}
    assert cuda == {"not built"} or any(c.startswith("native") for c in cuda)


def test_kernels_text():
    r = strata("kernels")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].split() == ["type", "id", "block", "bytes", "cpu", "cuda"]
    assert any(line.split()[:1] == ["IQ4_NL"] for line in r.stdout.splitlines())


def test_probe_batch_mtp_on_then_off_with_no_native(files):
    pack, draft = files
    base = ["probe", "--pack", str(pack), "--mtp", str(draft), "--device", "cpu",
            "--parallel", "4", "--spec", "2", "--batch-mtp", "--json"]
    on = strata(*base)
    assert on.returncode == 0, on.stderr
    data = json.loads(on.stdout)
    assert [s["batch_mtp"] for s in data["slots"]] == [True] * 4
    assert data["lines"][0].startswith("strata probe: batch-MTP on for slots 0-3")
    assert data["draft"] and "mtp.eh_proj.weight" in {t["name"] for t in data["tensors"]}

    off = strata(*base, "--no-native", "Q2_0")
    assert off.returncode == 0, off.stderr
    data = json.loads(off.stdout)
    assert {s["reason_code"] for s in data["slots"]} == {"no_native_kernel"}
    (line,) = data["lines"]
    assert line.count("blk.*.ffn_down_exps") == 1 and line.count("Q2_0") == 1
    assert "2 tensors blk.*.ffn_down_exps are Q2_0" in line


def test_probe_text_names_every_path(files):
    pack, draft = files
    r = strata("probe", "--pack", str(pack), "--mtp", str(draft), "--device", "cpu",
               "--parallel", "2", "--spec", "1", "--batch-mtp", "--no-native", "IQ3_XXS")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "role" in out and "decode" in out and "verify" in out and "draft" in out
    up = next(line for line in out.splitlines() if line.startswith("blk.*.ffn_up_exps"))
    assert up.split()[1] == "IQ3_XXS" and "generic" in up
    assert "strata probe: batch-MTP off for slots 0-1: 3 tensors blk.*.ffn_up_exps are IQ3_XXS" in out


def test_probe_default_pack_runs():
    r = strata("probe", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "blk.*.ffn_down" in r.stdout and "native" in r.stdout


@pytest.mark.skipif(not SHARED_MIX.is_file(), reason="shared mix-Q2_0 model absent")
def test_probe_shared_bug_model():
    r = strata("probe", "--pack", str(SHARED_MIX), "--device", "cpu", "--no-native", "Q2_0", "--json")
    assert r.returncode == 0, r.stderr
    groups = {(g["role"], g["type"]): g for g in json.loads(r.stdout)["groups"]}
    assert groups[("blk.*.ffn_down", "Q2_0")]["decode"] == "generic"
    assert groups[("blk.*.ffn_up", "IQ4_NL")]["decode"] == "native"


def test_probe_bad_no_native_type(files):
    pack, _ = files
    r = strata("probe", "--pack", str(pack), "--device", "cpu", "--no-native", "Q9_9")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "Q9_9" in r.stderr


def test_probe_unknown_type_exits_2(files, tmp_path):
    pack, _ = files
    raw = bytearray(pack.read_bytes())
    name = b"blk.1.attn_q.weight"
    at = raw.index(name) + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", raw, type_at)[0] == BY_NAME["Q4_K"].id
    struct.pack_into("<I", raw, type_at, 99)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    r = strata("probe", "--pack", str(bad), "--device", "cpu")
    assert r.returncode == 2
    assert "99" in r.stderr and "Traceback" not in r.stderr
