"""Bad GGUF files: `strata inspect BAD` as a real child process must exit 2 with one line
on stderr naming the culprit, and no traceback. Files are built with our writer, then cut
or patched."""

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.errors import StrataError
from strata.gguf import GGUFFile, GGUFWriter
from strata.kernels.ggml_types import type_by_name

REPO = Path(__file__).resolve().parents[1]
Q8_0 = type_by_name("Q8_0")


def _good(path: Path) -> Path:
    w = GGUFWriter(path)
    w.add_metadata("general.architecture", "llama")
    w.add_metadata("tokenizer.ggml.tokens", [f"tok{i}" for i in range(100)])
    w.add_tensor("blk.0.attn_q.weight", Q8_0.id, (64, 2), np.full(4 * Q8_0.type_size, 1, np.uint8))
    w.add_tensor("blk.0.attn_k.weight", Q8_0.id, (64, 2), np.full(4 * Q8_0.type_size, 2, np.uint8))
    w.add_tensor("output_norm.weight", 0, (64,), np.ones(64, np.float32))
    return w.write()


def _info_pos(data: bytes, name: str) -> int:
    """Byte position just after a tensor's name in its info record."""
    raw = name.encode()
    at = data.find(struct.pack("<Q", len(raw)) + raw)
    assert at > 0
    return at + 8 + len(raw)


def _patch(path: Path, pos: int, fmt: str, value) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, pos, value)
    path.write_bytes(bytes(data))


def _run_inspect(target, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strata.cli.main", "inspect", str(target), *flags],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )


def _make_bad(kind: str, tmp: Path) -> tuple[Path, list[str]]:
    """(bad file, words the error line must contain)."""
    path = tmp / f"{kind}.gguf"
    if kind == "missing":
        return path, ["missing.gguf", "no such file"]
    _good(path)
    data = path.read_bytes()
    if kind == "bad_magic":
        _patch(path, 0, "4s", b"GGML")
        return path, ["bad_magic.gguf", "not a GGUF file"]
    if kind == "version1":
        _patch(path, 4, "<I", 1)
        return path, ["version1.gguf", "unsupported GGUF version 1"]
    if kind == "version4":
        _patch(path, 4, "<I", 4)
        return path, ["version4.gguf", "unsupported GGUF version 4"]
    if kind == "truncated_header":
        path.write_bytes(data[: _info_pos(data, "blk.0.attn_k.weight") - 3])
        return path, ["truncated_header.gguf", "truncated"]
    if kind == "truncated_data":
        f = GGUFFile(path)
        last = f.tensors["output_norm.weight"]
        f.close()
        path.write_bytes(data[: last.offset + 10])
        return path, ["truncated_data.gguf", "output_norm.weight", "truncated"]
    if kind == "unknown_type":
        pos = _info_pos(data, "blk.0.attn_k.weight") + 4 + 2 * 8  # n_dims, ne0, ne1
        _patch(path, pos, "<I", 99)
        return path, ["unknown_type.gguf", "blk.0.attn_k.weight", "99"]
    if kind == "bad_block":
        _patch(path, _info_pos(data, "blk.0.attn_q.weight") + 4, "<Q", 48)  # ne0 48: not a multiple of 32
        return path, ["bad_block.gguf", "blk.0.attn_q.weight", "Q8_0", "48"]
    if kind == "duplicate":
        at = _info_pos(data, "blk.0.attn_k.weight")
        _patch(path, at - len("attn_k.weight"), "6s", b"attn_q")
        return path, ["duplicate.gguf", "blk.0.attn_q.weight", "duplicate"]
    if kind == "empty":
        path.write_bytes(b"")
        return path, ["empty.gguf", "not a GGUF file"]
    raise AssertionError(kind)


BAD_KINDS = ["missing", "bad_magic", "version1", "version4", "truncated_header", "truncated_data",
             "unknown_type", "bad_block", "duplicate", "empty"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_file_in_process(kind, tmp_path):
    path, words = _make_bad(kind, tmp_path)
    with pytest.raises(StrataError) as err:
        GGUFFile(path)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_file_cli(kind, tmp_path):
    path, words = _make_bad(kind, tmp_path)
    proc = _run_inspect(path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_good_file_cli_and_version2(tmp_path):
    path = _good(tmp_path / "good.gguf")
    proc = _run_inspect(path, "--no-check")  # (three tensors, no model: the listing alone)
    assert proc.returncode == 0, proc.stderr
    assert "blk.*.attn_q" in proc.stdout and "Q8_0 x1" in proc.stdout
    _patch(path, 4, "<I", 2)  # v2 has the same layout as v3
    f = GGUFFile(path)
    assert f.version == 2 and len(f.tensors) == 3
    assert np.array_equal(f.tensors["blk.0.attn_k.weight"].data(), np.full(136, 2, np.uint8))
