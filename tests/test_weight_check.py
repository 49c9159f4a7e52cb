"""NaN and Inf in a pack's weights are found at load (float values, block scales), one line
naming the tensor, exit 2; the check reads the whole of small tensors and a sample of rows of
big ones."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from strata.errors import StrataError
from strata.gguf.reader import GGUFFile
from strata.pack.loader import open_pack
from strata.pack.presets import TINY
from strata.pack.weight_check import FULL_CHECK_BYTES, SAMPLE_ROWS, SCALE_FIELDS, _rows_to_read, check_weights
from support.model_fixtures import default_model_or_skip

REPO = Path(__file__).resolve().parents[1]
F16_NAN, F16_INF = 0x7E00, 0x7C00


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from strata.pack.synth import synth_pack

    out = tmp_path_factory.mktemp("tiny-mixed")
    spec = TINY["llama"].with_types({"ffn_down": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "output": "Q6_K"})
    (path,) = synth_pack(spec, out, progress=lambda *a: None)
    return path


def _poke(src: Path, dst: Path, tensor: str, byte: int, raw: bytes) -> Path:
    """A copy of src with `raw` written at byte `byte` of the tensor's data."""
    shutil.copyfile(src, dst)
    g = GGUFFile(src)
    offset = g.tensors[tensor].offset
    g.close()
    with open(dst, "r+b") as f:
        f.seek(offset + byte)
        f.write(raw)
    return dst


def _block_scale(tiny: Path, tensor: str, block: int, field: int = 0) -> int:
    g = GGUFFile(tiny)
    gtype = g.tensors[tensor].type
    g.close()
    return block * gtype.type_size + SCALE_FIELDS[gtype.name][field][0]


# (tensor, byte offset of the poke inside its data (a function of the pack), bytes, what the line says)
CASES = {
    "f32 norm value NaN": ("blk.1.attn_norm.weight", lambda t: 4 * 200, struct.pack("<f", float("nan")), "row 0"),
    "f32 norm value Inf": ("output_norm.weight", lambda t: 4 * 3, struct.pack("<f", float("-inf")), "row 0"),
    "Q8_0 scale NaN": ("blk.0.attn_q.weight", lambda t: _block_scale(t, "blk.0.attn_q.weight", 8 * 77),
                       struct.pack("<H", F16_NAN), "row 77"),
    "Q4_K d Inf": ("blk.1.ffn_down.weight", lambda t: _block_scale(t, "blk.1.ffn_down.weight", 2 * 100),
                   struct.pack("<H", F16_INF), "row 100"),
    "Q4_K dmin NaN": ("blk.0.ffn_up.weight", lambda t: _block_scale(t, "blk.0.ffn_up.weight", 5, field=1),
                      struct.pack("<H", F16_NAN), "row 5"),
    # output.weight (10 MiB) is read in sampled rows; its first row is always among them
    "Q6_K scale NaN": ("output.weight", lambda t: _block_scale(t, "output.weight", 0),
                       struct.pack("<H", F16_NAN), "row 0"),
    # token_embd (13 MiB) is read in sampled rows; its last row is always among them
    "big tensor, last row": ("token_embd.weight", lambda t: _block_scale(t, "token_embd.weight", 49151 * 8 + 3),
                             struct.pack("<H", F16_INF), "row 49151"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nan_and_inf_are_found_and_named(tiny, tmp_path, case):
    tensor, where, raw, row = CASES[case]
    bad = _poke(tiny, tmp_path / "bad.gguf", tensor, where(tiny), raw)
    pack = open_pack(pack=str(bad))
    try:
        with pytest.raises(StrataError) as e:
            check_weights(pack)
    finally:
        pack.close()
    msg = e.value.message
    assert f"tensor {tensor} (" in msg and "holds NaN or Inf" in msg and f"in {row})" in msg, msg
    assert "\n" not in msg


def test_a_clean_pack_and_the_test_model_pass(tiny):
    for path in (tiny, default_model_or_skip()):
        pack = open_pack(pack=str(path))
        try:
            check_weights(pack)
        finally:
            pack.close()


def test_big_tensors_are_sampled_small_ones_read_whole():
    rows = _rows_to_read(49152, 272)  # token_embd of the tiny pack: 13 MiB
    assert len(rows) == SAMPLE_ROWS and rows[0] == 0 and rows[-1] == 49151
    assert len(_rows_to_read(FULL_CHECK_BYTES // 272, 272)) == FULL_CHECK_BYTES // 272


def test_generate_refuses_the_pack_in_one_line(tiny, tmp_path):
    bad = _poke(tiny, tmp_path / "bad.gguf", "blk.0.attn_q.weight", 0, struct.pack("<H", F16_NAN))
    proc = subprocess.run([sys.executable, "-m", "strata", "generate", "--pack", str(bad), "--prompt", "Hi",
                           "--max-tokens", "2", "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.strip().splitlines() if line.startswith("strata: ") and "NaN" in line]
    assert errors == [f"strata: pack {bad}: tensor blk.0.attn_q.weight (Q8_0) holds NaN or Inf (a block scale in "
                      f"row 0); the file is damaged or was written wrong"], proc.stderr
    assert proc.stdout == ""


def test_inspect_does_not_call_such_a_pack_loadable(tiny, tmp_path):
    bad = _poke(tiny, tmp_path / "bad.gguf", "blk.1.attn_norm.weight", 0, struct.pack("<f", float("nan")))
    proc = subprocess.run([sys.executable, "-m", "strata", "inspect", str(bad)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert "check: ok" not in proc.stdout and "Traceback" not in proc.stderr
    assert "tensor blk.1.attn_norm.weight (F32) holds NaN or Inf" in proc.stdout + proc.stderr
