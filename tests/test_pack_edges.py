"""Where `strata pack synth` and `strata mtp train` write: the out path and the disk's room are
checked before any work, and a bad one is one line naming the flag (exit 2), not a traceback or
gigabytes written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from strata.errors import StrataError
from strata.gguf.out_path import DISK_RESERVE, check_room, out_dir, out_file
from strata.pack.presets import TINY
from strata.pack.synth import synth_pack

REPO = Path(__file__).resolve().parents[1]


def _strata(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: "), lines
    return lines[0]


def test_synth_out_that_is_a_device_a_file_or_beyond_reach(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for flags, words in [(["--out", "/dev/null"], "--out /dev/null: /dev/null exists and is not a folder"),
                         (["--out", str(a_file)], f"--out {a_file}: {a_file} exists and is not a folder"),
                         (["--out", "/proc/nope/x"], "--out /proc/nope/x: cannot create the folder"),
                         (["--out", str(tmp_path / "p"), "--mtp", "/dev/null"], "--mtp /dev/null: ")]:
        assert words in _one_line(_strata("pack", "synth", *flags))
    assert not list(tmp_path.rglob("*.gguf"))


def test_synth_refuses_a_pack_larger_than_the_free_disk_before_writing(tmp_path):
    # Q8_0 ffn matrices (over a byte a weight) sized so that one layer alone takes 4x the free disk
    free = shutil.disk_usage(tmp_path).free
    n_embd = 4096
    n_ff = (4 * free // (3 * n_embd) // 32 + 1) * 32
    out = tmp_path / "p"
    line = _one_line(_strata("pack", "synth", "--out", str(out), "--layers", "1", "--n-embd", str(n_embd),
                             "--n-ff", str(n_ff), "--type", "ffn_gate=Q8_0", "--type", "ffn_up=Q8_0",
                             "--type", "ffn_down=Q8_0"))
    m = re.fullmatch(rf"strata: --out {re.escape(str(out))}: the output would take ([\d.]+) GiB and its disk "
                     r"has ([\d.]+) (GiB|MiB) free, .*", line)
    assert m and float(m.group(1)) * 2**30 > free, line
    assert not list(out.glob("*"))  # nothing written


def test_synth_layers_beyond_what_a_model_holds_are_refused_at_once(tmp_path):
    line = _one_line(_strata("pack", "synth", "--out", str(tmp_path / "p"), "--layers", "100000"))
    assert line == "strata: --layers 100000: at most 512 (llama.cpp's LLAMA_MAX_LAYERS)"
    line = _one_line(_strata("pack", "synth", "--out", str(tmp_path / "p"), "--n-ff", str(2**40)))
    assert line.startswith(f"strata: --n-ff {2**40}: must be in 0..4294967295")


def test_the_size_announced_is_the_size_written(tmp_path):
    lines: list[str] = []
    files = synth_pack(replace(TINY["llama"], vocab=2000, n_layer=1), tmp_path / "p", shards=2,
                       mtp_dir=tmp_path / "m", progress=lines.append)
    m = re.fullmatch(r"writing 3 file\(s\), ([\d.]+) MiB in all", lines[0])
    assert m and float(m.group(1)) == round(sum(f.stat().st_size for f in files) / 2**20, 1)


def test_out_path_checks(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in [(fifo, "not a regular file"), ("/dev/null", "not a regular file"),
                        (tmp_path, "is a folder"), ("/proc/nope/x.gguf", "cannot create the folder /proc/nope")]:
        with pytest.raises(StrataError, match=words) as e:
            out_file(path, "--out")
        assert e.value.message.startswith(f"--out {path}: ")
    assert out_file(tmp_path / "new" / "d.gguf", "--out") == tmp_path / "new" / "d.gguf"
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "d.gguf").exists()
    with pytest.raises(StrataError, match="exists and is not a folder"):
        out_dir(fifo, "--out")
    free = shutil.disk_usage(tmp_path).free
    check_room("--out", tmp_path, 1 << 20)
    with pytest.raises(StrataError, match=f"--out {tmp_path}: the output would take"):
        check_room("--out", tmp_path, free - DISK_RESERVE + (1 << 30))


@pytest.mark.parametrize("out, words", [
    ("/proc/nope/x.gguf", "--out /proc/nope/x.gguf: cannot create the folder /proc/nope"),
    ("/dev/null", "--out /dev/null: not a regular file"),
])
def test_mtp_train_checks_its_out_before_any_work(out, words):
    # before: the data and the training ran first (minutes), then a traceback from open()
    assert words in _one_line(_strata("mtp", "train", "--out", out, "--steps", "1", timeout=60))
