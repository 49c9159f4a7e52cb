"""`strata mtp train` end to end on a tiny synthetic pack (needs PyTorch; skipped without it).

A real child process trains a few steps; the draft it writes must load with --mtp and leave
greedy outputs equal to plain decoding (a draft, good or bad, never changes the tokens).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

from strata.gguf.reader import GGUFFile  # noqa: E402
from strata.pack.presets import TINY  # noqa: E402
from strata.pack.synth import synth_pack  # noqa: E402
from tests.support.engines import chat_prompts, greedy, load_engine, run_all  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen3")
    synth_pack(TINY["qwen3"], d, progress=lambda *a: None)
    out = d / "draft" / "mtp.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "strata.cli.main", "mtp", "train", "--pack", str(d / "model.gguf"), "--out", str(out),
         "--steps", "3", "--prompts", "4", "--max-new", "8", "--slots", "4", "--batch-tokens", "256",
         "--held-out-per-kind", "1", "--no-measure"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return d, out, proc.stdout


def test_train_prints_progress_and_writes_the_format(trained):
    d, out, stdout = trained
    assert "step 3/3" in stdout and "loss1" in stdout
    assert "held-out acceptance" in stdout
    f = GGUFFile(out)
    assert f.metadata["general.architecture"] == "strata-mtp"
    assert f.metadata["strata-mtp.target_architecture"] == "qwen3"
    assert f.metadata["strata-mtp.embedding_length"] == 256
    names = set(f.tensors)
    for n in ("mtp.enorm.weight", "mtp.hnorm.weight", "mtp.eh_proj.weight", "mtp.output_norm.weight",
              "mtp.blk.attn_q_norm.weight", "mtp.blk.ffn_down.weight"):
        assert n in names
    assert tuple(f.tensors["mtp.eh_proj.weight"].shape) == (512, 256)
    f.close()


def test_trained_draft_loads_and_is_lossless(trained):
    d, out, _ = trained
    plain, _ = load_engine(["--pack", str(d / "model.gguf"), "--device", "cpu"])
    prompts = chat_prompts(plain, ["Hello there", "List three colors."])
    want = [ids for ids, _, _ in run_all(plain, prompts, greedy(12), threaded=False)]
    core, lines = load_engine(["--pack", str(d / "model.gguf"), "--mtp", str(out), "--spec", "2", "--device", "cpu"])
    assert core.draft is not None
    assert any("strata mtp: slot 0" in ln for ln in lines)
    got = [ids for ids, _, _ in run_all(core, prompts, greedy(12), threaded=False)]
    assert got == want
    assert core.metrics()["slots"][0]["mtp_drafted"] > 0


def test_train_without_torch_is_one_clear_line(tmp_path):
    """The error a user without the extra sees when asking for the torch trainer (simulated by
    hiding torch from the child; `--trainer auto` then trains with the xp trainer instead)."""
    code = ("import sys; sys.modules['torch'] = None; from strata.cli.main import main; "
            f"sys.exit(main(['mtp', 'train', '--out', {str(tmp_path / 'x.gguf')!r}, '--steps', '1', '--trainer', 'torch']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("strata: strata mtp train needs PyTorch")
    assert np.all([ln.startswith("strata") for ln in proc.stderr.strip().splitlines()])


def test_init_continues_a_draft_and_rejects_a_missing_one(trained, tmp_path):
    """--init starts from an existing draft (here the one trained above) and trains it 3 passes deep."""
    d, out, _ = trained
    again = tmp_path / "again.gguf"
    base = [sys.executable, "-m", "strata.cli.main", "mtp", "train", "--pack", str(d / "model.gguf"), "--steps", "2",
            "--prompts", "4", "--max-new", "8", "--slots", "4", "--batch-tokens", "256", "--held-out-per-kind", "1",
            "--no-measure", "--passes", "3"]
    proc = subprocess.run(base + ["--out", str(again), "--init", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "loss3" in proc.stdout and "pos3|pos1..2" in proc.stdout
    assert again.is_file()
    missing = tmp_path / "nope.gguf"
    proc = subprocess.run(base + ["--out", str(tmp_path / "x.gguf"), "--init", str(missing)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"strata: --init {missing}: no such file"
