"""--ple-io mmap|ram|direct: the n-gram table read on the host by rows (strata/gguf/row_source.py).

- Each source hands back, for any indices (duplicates, unsorted, the first and last rows), the
  bytes the file holds there: on an IQ4_NL table of 90-byte rows whose data starts off a page
  boundary (so direct's aligned spans cut rows), through every file reader (O_DIRECT where the
  file system takes it, plain positional reads, and the Windows seek + readinto path).
- The tiny qwen4exp model decodes the same greedy tokens in every mode, from one file and from
  a split whose second shard (the table alone) is named with --ple-gguf from another folder.
- The start-up lines: the table's size and mode; the flag on a pack without a table is a
  warning; ram's progress and its refusal; direct's O_DIRECT refusal falls back and says so.
- `strata generate --ple-io bogus` is one line naming --ple-io and exit code 2.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.errors import StrataError
from strata.gguf import row_source
from strata.gguf.reader import GGUFFile
from strata.gguf.row_source import DirectRows, HostTables, MappedRows, PositionalFile, RamRows, SeekingFile
from strata.gguf.writer import GGUFWriter
from strata.kernels.ggml_types import BY_NAME
from strata.pack.split_writer import split_gguf
from tests.support.engines import greedy, load_engine, run_all

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "qwen4exp" / "qwen4exp-tiny-f16.gguf"
TABLE = "per_layer_token_embd.weight"
MODES = ("mmap", "ram", "direct")
ROW_VALUES, N_ROWS = 160, 5003  # the real table's rows (IQ4_NL: 5 blocks of 18 bytes)
EOS = 511  # the tiny model's ple.eos_token_id
PROMPTS = [[1, 2, 3, 4, 5], [300, 7, EOS, 7, 300, 7, EOS, 42], [9] * 12, [EOS, EOS, 100, 200]]


@pytest.fixture(scope="module")
def table_file(tmp_path_factory) -> Path:
    """A GGUF of one IQ4_NL table of N_ROWS rows after a small leading tensor: its data offset is
    32-byte aligned, not page aligned."""
    rng = np.random.default_rng(45)
    iq4 = BY_NAME["IQ4_NL"]
    w = GGUFWriter(tmp_path_factory.mktemp("ple-io") / "table.gguf")
    w.add_metadata("general.architecture", "qwen4exp")
    w.add_tensor("lead.weight", BY_NAME["F32"].id, (24,), rng.standard_normal(24).astype(np.float32))
    w.add_tensor(TABLE, iq4.id, (ROW_VALUES, N_ROWS),
                 rng.integers(0, 256, iq4.nbytes(ROW_VALUES * N_ROWS), dtype=np.uint8))
    return w.write()


def _expected(info, rows: np.ndarray) -> np.ndarray:
    row_bytes = info.nbytes // N_ROWS
    raw = np.fromfile(info.path, np.uint8, count=info.nbytes, offset=info.offset).reshape(N_ROWS, row_bytes)
    return raw[rows]


def _sources(info, row_bytes: int) -> dict[str, object]:
    """Every source and every file reader direct can use here (plain positional reads: POSIX)."""
    out = {"mmap": MappedRows(info, row_bytes), "ram": RamRows(info, row_bytes, "n-gram table", "--ple-io"),
           "direct": DirectRows(info, row_bytes),
           "direct-seek": DirectRows(info, row_bytes, opener=lambda p, first: (SeekingFile(p), "seek"))}
    if os.name != "nt":
        out["direct-plain"] = DirectRows(info, row_bytes, opener=lambda p, first: (PositionalFile(p, False), "plain"))
    return out


def test_every_source_reads_the_bytes_the_file_holds(table_file):
    f = GGUFFile(table_file)
    info = f.tensors[TABLE]
    row_bytes = info.nbytes // N_ROWS
    assert row_bytes == 90 and info.offset % row_source.ALIGN
    rng = np.random.default_rng(7)
    picks = rng.integers(0, N_ROWS, 200)
    cases = [np.concatenate([picks, picks[:40], [N_ROWS - 1, 0, N_ROWS - 1, N_ROWS - 2]]),  # duplicates, ends
             np.arange(N_ROWS - 60, N_ROWS)[::-1],  # adjacent rows, one run, read back to front
             np.array([N_ROWS - 1]), np.array([3, 3, 3]), np.zeros(0, np.int64)]
    for name, src in _sources(info, row_bytes).items():
        for rows in cases:
            got = src.rows(rows)
            assert got.dtype == np.uint8 and got.shape == (rows.size, row_bytes), name
            np.testing.assert_array_equal(got, _expected(info, rows), err_msg=name)
        with pytest.raises(IndexError):
            src.rows(np.array([N_ROWS]))


def test_direct_says_how_it_reads(table_file):
    info = GGUFFile(table_file).tensors[TABLE]
    src = DirectRows(info, 90)
    assert src.where.startswith("on disk, read per window via direct: ")
    if os.name != "nt" and row_source.O_DIRECT:
        assert "O_DIRECT" in src.where  # taken, or refused and named


@pytest.mark.skipif(os.name == "nt" or not row_source.O_DIRECT, reason="no O_DIRECT on this platform")
def test_direct_falls_back_to_plain_reads_when_o_direct_is_refused(table_file, monkeypatch):
    class Refusing(PositionalFile):
        def __init__(self, path, direct):
            if direct:
                raise OSError(errno.EINVAL, "Invalid argument")
            super().__init__(path, direct)

    monkeypatch.setattr(row_source, "PositionalFile", Refusing)
    info = GGUFFile(table_file).tensors[TABLE]
    src = DirectRows(info, 90)
    assert src.where.endswith("plain positional reads through the page cache (O_DIRECT refused: Invalid argument)")
    rows = np.array([5, 4999, 5, 17])
    np.testing.assert_array_equal(src.rows(rows), _expected(info, rows))


def test_ram_says_its_progress_and_refuses_what_memory_cannot_hold(table_file, monkeypatch):
    info = GGUFFile(table_file).tensors[TABLE]
    lines: list[str] = []
    monkeypatch.setattr(row_source, "PROGRESS_FROM", 0)
    monkeypatch.setattr(row_source, "COPY_CHUNK", 4096)
    HostTables("ram", say=lines.append).open(info, 90, "n-gram table")
    assert len(lines) == 10 and lines[-1].startswith("strata: n-gram table: copying into memory: 100% (439.7 KiB of")
    assert [int(line.split(": ")[3].split("%")[0]) for line in lines] == list(range(10, 101, 10))
    monkeypatch.setattr(row_source, "available_host_bytes", lambda: 1000)
    with pytest.raises(StrataError) as e:
        HostTables("ram").open(info, 90, "n-gram table")
    assert str(e.value) == ("--ple-io ram: the n-gram table takes 439.7 KiB of host memory, and 1000 B is "
                            "available (--ple-io mmap or direct read it from the file instead)")


def _decode(args: list[str]) -> tuple[list[list[int]], list[str]]:
    core, lines = load_engine(["--device", "cpu", "--parallel", "2", *args])
    try:
        return [ids for ids, _, _ in run_all(core, PROMPTS, greedy(8), threaded=False)], lines
    finally:
        core.pack.close()


@pytest.fixture(scope="module")
def split_pack(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model as a split of two: shard 1 in one folder, shard 2 (the table alone) in another."""
    d = tmp_path_factory.mktemp("ple-split")
    names = [n for n in GGUFFile(TINY).tensors if n != TABLE]
    first, second = split_gguf(TINY, d, [names, [TABLE]], "tiny")
    (d / "table").mkdir()
    moved = second.rename(d / "table" / second.name)
    return first, moved


def test_every_mode_decodes_the_same_tokens_from_one_file_and_from_a_split(split_pack):
    first, second = split_pack
    baseline = None
    for mode in MODES:
        for args in (["--pack", str(TINY)], ["--pack", str(first), "--ple-gguf", str(second)]):
            tokens, lines = _decode([*args, "--ple-io", mode])
            said = [line for line in lines if line.startswith("strata: n-gram table: ")]
            where = "in host memory" if mode != "direct" else "on disk, read per window"
            assert len(said) == 1 and said[0].startswith(f"strata: n-gram table: 38.0 KiB {where} via {mode}"), lines
            assert all(len(t) == 8 for t in tokens)
            baseline = baseline or tokens
            assert tokens == baseline, (mode, args)


def test_the_flag_on_a_pack_without_a_table_is_a_warning(tmp_path):
    from strata.pack.presets import TINY as PRESETS
    from strata.pack.synth import synth_pack

    synth_pack(PRESETS["llama"], tmp_path, progress=lambda *a, **k: None)
    core, lines = load_engine(["--pack", str(tmp_path), "--device", "cpu", "--ple-io", "direct"])
    core.pack.close()
    warned = [line for line in lines if "--ple-io" in line]
    assert len(warned) == 1 and warned[0].startswith("strata: warning: --ple-io direct has no effect: pack "), lines
    assert warned[0].endswith("has no n-gram table")
    assert not any("n-gram table:" in line for line in lines)


def test_a_bad_mode_is_one_line_naming_the_flag():
    done = subprocess.run([sys.executable, "-m", "strata", "generate", "--device", "cpu", "--pack", str(TINY),
                           "--prompt", "x", "--ple-io", "bogus"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ple-io" in lines[0] and "bogus" in lines[0] and "Traceback" not in done.stderr


def test_the_device_room_check_leaves_the_table_out():
    """A pack is refused when its weights cannot fit the device: the table never goes there."""
    from types import SimpleNamespace

    from strata.backend.cuda_weights import weight_bytes

    q8 = BY_NAME["Q8_0"]
    table = SimpleNamespace(name=TABLE, shape=(160, 1 << 20), ggml_type=q8.id, nbytes=q8.nbytes(160 << 20))
    layer = SimpleNamespace(name="blk.0.ffn_up.weight", shape=(64, 32), ggml_type=q8.id, nbytes=q8.nbytes(64 * 32))
    assert weight_bytes([table, layer], {q8.id}) == layer.nbytes
