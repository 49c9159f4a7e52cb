"""`strata inspect` runs the engine's load check (Pack.model_config: the metadata key table and
every tensor the architecture reads) after its summary, as a real child process: a pack the
engine loads ends with "check: ok (...)" and exit 0; one it refuses still gets its listing, then
the engine's own one line on stderr (the very line `strata generate` prints) and exit 2, with
--json a "check" field. Packs are a tiny synthetic qwen3moe rewritten with our writer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from strata.gguf.constants import ValueType as V
from tests.fuzz.mutate import Seed, rewrite
from tests.support.model_fixtures import synth_model

REPO = Path(__file__).resolve().parents[1]
ARCH = "qwen3moe"
Q8 = {r: "Q8_0" for r in ("embed", "output", "attn_q", "attn_k", "attn_v", "attn_output",
                          "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
DROPPED = "blk.0.ffn_norm.weight"

# kind -> (metadata changes, the engine's refusal after "pack PATH: ")
BAD = {
    "bad value": ({f"{ARCH}.attention.head_count": (V.UINT32, 0)},
                  f"metadata key {ARCH}.attention.head_count: must be >= 1, found 0"),
    "relation": ({f"{ARCH}.expert_used_count": (V.UINT32, 5)},
                 f"metadata key {ARCH}.expert_used_count: must be in [1, expert_count (4)], found 5"),
    "rope above the head": ({f"{ARCH}.rope.dimension_count": (V.UINT32, 32)},
                            f"metadata key {ARCH}.rope.dimension_count: must be even and <= the head size "
                            f"attention.key_length (16), found 32"),
    "missing tensor": (None, f"missing required tensor {DROPPED}"),
}


def strata(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Seed:
    path = synth_model(tmp_path_factory.mktemp("good"), ARCH, types=Q8, vocab=512, n_layer=1, n_embd=64, n_ff=64,
                       n_head=4, n_head_kv=2, head_dim=16, expert_ff=32, context=256)
    return Seed.open(ARCH, path)


@pytest.fixture(scope="module")
def bad_packs(seed, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """kind -> (the bad pack, the line the engine refuses it with)."""
    out = tmp_path_factory.mktemp("bad")
    packs = {}
    for i, (kind, (changes, what)) in enumerate(BAD.items()):
        tensors = [t for t in seed.tensors if t[0] != DROPPED] if changes is None else None
        path = out / f"bad{i}.gguf"
        path.write_bytes(rewrite(seed, changes, tensors))
        packs[kind] = path, f"pack {path}: {what}"
    return packs


def refusal_line(proc: subprocess.CompletedProcess) -> str:
    """The one stderr line of an exit 2 (no traceback), without its "strata: " tag."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: "), proc.stderr
    return lines[0][len("strata: "):]


def test_good_pack_checks_ok(seed):
    proc = strata("inspect", str(seed.path))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"check: ok (the engine would load it: {ARCH}, 1 layers, "
                           f"{len(seed.tensors)} tensors, "), last
    assert "tensors by role" in proc.stdout


def test_good_pack_json_check(seed):
    proc = strata("inspect", str(seed.path), "--json", "--tensors")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    report = json.loads(proc.stdout)
    assert report["check"] == {"ok": True} and report["tensor_count"] == len(seed.tensors)


@pytest.mark.parametrize("kind", BAD)
def test_refused_pack_summary_then_the_engines_line(bad_packs, kind):
    path, expected = bad_packs[kind]
    proc = strata("inspect", str(path))
    assert refusal_line(proc) == expected
    assert f"pack {path}" in proc.stdout and "tensors by role" in proc.stdout and "by type" in proc.stdout
    assert "check: ok" not in proc.stdout


@pytest.mark.parametrize("kind", BAD)
def test_refused_pack_json(bad_packs, kind):
    path, expected = bad_packs[kind]
    proc = strata("inspect", str(path), "--json")
    assert refusal_line(proc) == expected
    report = json.loads(proc.stdout)  # the whole report still, for a pack that opens
    assert report["check"] == {"ok": False, "problem": expected}
    assert report["metadata"]["arch"] == ARCH and report["tensor_count"] > 0


def test_the_line_is_the_one_generate_prints(bad_packs):
    """Not a copy of the checks: `strata generate` refuses the pack with the same line."""
    path, expected = bad_packs["relation"]
    gen = strata("generate", "--pack", str(path), "--device", "cpu", "--prompt", "hi", "--max-tokens", "1")
    assert gen.returncode == 2 and "Traceback" not in gen.stderr, gen.stderr
    assert gen.stderr.strip().splitlines()[-1] == "strata: " + refusal_line(strata("inspect", str(path)))


def test_no_check_lists_only(bad_packs):
    path, _ = bad_packs["missing tensor"]
    text = strata("inspect", str(path), "--no-check")
    assert text.returncode == 0 and text.stderr == "", text.stderr
    assert "tensors by role" in text.stdout and "check:" not in text.stdout
    report = json.loads(strata("inspect", str(path), "--no-check", "--json").stdout)
    assert report["check"] is None
