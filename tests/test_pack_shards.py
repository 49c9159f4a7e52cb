"""A pack split over GGUF shards, in the bug report's form (`--pack DIR --native X-00001-of-00002.gguf
--ple-gguf X-00002-of-00002.gguf`): the same tensors, metadata and greedy tokens as the one file,
and one line naming the file for each way a split can be wrong."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from strata.errors import StrataError
from strata.gguf.constants import ValueType
from strata.gguf.reader import GGUFFile
from strata.gguf.writer import GGUFWriter
from strata.model.archs import ARCHS
from strata.pack.loader import open_pack
from strata.pack.presets import TINY
from strata.pack.split_writer import split_gguf
from strata.pack.synth import synth_pack
from tests.support.engines import greedy, load_engine, request

REPO = Path(__file__).resolve().parents[1]
QWEN4EXP = REPO / "tests" / "data" / "qwen4exp" / "qwen4exp-tiny-f16.gguf"
PLE_TABLE = "per_layer_token_embd.weight"  # the n-gram table's name (llama.cpp conversion/qwen4exp.py:171)
PROMPT = [1, 200, 300, 4000, 50, 60, 70, 80, 9, 1234]


def _quiet(*_a, **_k) -> None:
    pass


def _groups(path: Path, n: int, last: list[str] | None = None) -> list[list[str]]:
    """n contiguous groups of the file's tensors in file order; `last` (if given) alone in the last."""
    with GGUFFile(path) as f:
        names = [t for t in f.tensors if t not in (last or [])]
    k = n - 1 if last else n
    cuts = np.linspace(0, len(names), k + 1).astype(int)
    groups = [names[a:b] for a, b in zip(cuts, cuts[1:])]
    return groups + [last] if last else groups


def _greedy_tokens(args: list[str], n: int = 12, prompt=PROMPT) -> list[int]:
    core, _ = load_engine(args + ["--device", "cpu", "--parallel", "1"])
    handle = core.submit(request(prompt, greedy(n)))
    core.scheduler.run_until_idle()
    return handle.collect(timeout=120)[0]


def _same_metadata(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
                                        for k in a)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny qwen35moe pack (the GDN + MoE family qwen4exp grows from) as one file, and the same
    file split in three with its last tensor alone in shard 3, as the report's table is."""
    root = tmp_path_factory.mktemp("shards")
    spec = replace(TINY["qwen35moe"], vocab=4096)
    (one,) = synth_pack(spec, root / "one", progress=_quiet)
    with GGUFFile(one) as f:
        table = [list(f.tensors)[-1]]
    split_gguf(one, root / "split", _groups(one, 3, last=table), "M")
    return one, root / "split"


def test_a_split_is_the_one_file(hybrid):
    one, split = hybrid
    whole = open_pack(pack=str(one))
    for form in (dict(pack=str(split)),
                 dict(pack=str(split), native="M-00002-of-00003.gguf"),
                 dict(pack=str(split), native="M-00001-of-00003.gguf", ple_gguf=["M-00003-of-00003.gguf"])):
        pack = open_pack(**form)
        assert [f.path.name for f in pack.files] == [f"M-0000{k}-of-00003.gguf" for k in (1, 2, 3)], form
        assert set(pack.tensors) == set(whole.tensors)
        for name, t in whole.tensors.items():
            assert pack.tensor(name).shape == t.shape and np.array_equal(pack.tensor(name).data(), t.data()), name
        assert _same_metadata({k: v for k, v in pack.metadata.items() if not k.startswith("split.")}, whole.metadata)
        pack.close()
    whole.close()


def test_greedy_tokens_through_the_report_form_equal_the_one_file(hybrid):
    one, split = hybrid
    want = _greedy_tokens(["--pack", str(one)])
    got = _greedy_tokens(["--pack", str(split), "--native", "M-00001-of-00003.gguf",
                          "--ple-gguf", "M-00003-of-00003.gguf"])
    assert len(want) == 12 and got == want


def test_a_shard_the_folder_lacks_comes_from_ple_gguf(hybrid, tmp_path):
    _, split = hybrid
    here = tmp_path / "main"
    here.mkdir()
    for k in (1, 2):
        (here / f"M-0000{k}-of-00003.gguf").symlink_to(split / f"M-0000{k}-of-00003.gguf")
    with pytest.raises(StrataError, match=r"^pack .*: shard M-00003-of-00003\.gguf is missing$"):
        open_pack(pack=str(here))
    pack = open_pack(pack=str(here), ple_gguf=[str(split / "M-00003-of-00003.gguf")])
    assert len(pack.files) == 3 and pack.files[2].path.parent == split


@pytest.mark.skipif("qwen4exp" not in ARCHS, reason="the qwen4exp architecture is not registered yet")
def test_qwen4exp_oracle_split_at_its_table(tmp_path):
    split_gguf(QWEN4EXP, tmp_path / "iq3_s", _groups(QWEN4EXP, 2, last=[PLE_TABLE]), "IQ3_S")
    report = ["--pack", str(tmp_path / "iq3_s"), "--native", "IQ3_S-00001-of-00002.gguf",
              "--ple-gguf", "IQ3_S-00002-of-00002.gguf"]
    prompt = [7, 300, 41, 5, 90, 211, 3, 17]  # (the oracle's vocabulary is 512 tokens)
    want = _greedy_tokens(["--pack", str(QWEN4EXP)], prompt=prompt)
    assert len(want) == 12 and _greedy_tokens(report, prompt=prompt) == want


def test_qwen4exp_oracle_split_and_a_separate_table(tmp_path):
    """The report's pack (the table alone in shard 2) and a pack written without its table plus the
    table as a file of its own: the oracle's tensors, byte for byte, whichever file holds them."""
    split_gguf(QWEN4EXP, tmp_path / "iq3_s", _groups(QWEN4EXP, 2, last=[PLE_TABLE]), "IQ3_S")
    with GGUFFile(QWEN4EXP) as f:
        _copy(f, tmp_path / "main.gguf", [n for n in f.tensors if n != PLE_TABLE], f.metadata)
        _copy(f, tmp_path / "ngram.gguf", [PLE_TABLE], {"general.architecture": "qwen4exp"})
        _copy(f, tmp_path / "bare.gguf", [PLE_TABLE], {})
        _copy(f, tmp_path / "other.gguf", [PLE_TABLE], {"general.architecture": "qwen35moe"})
        forms = (dict(pack=str(tmp_path / "iq3_s"), native="IQ3_S-00001-of-00002.gguf",
                      ple_gguf=["IQ3_S-00002-of-00002.gguf"]),
                 dict(pack=str(tmp_path / "main.gguf"), ple_gguf=["ngram.gguf"]),
                 dict(pack=str(tmp_path / "main.gguf"), ple_gguf=["bare.gguf"]))
        for form in forms:
            pack = open_pack(**form)
            assert pack.arch == "qwen4exp" and len(pack.tensors) == len(f.tensors), form
            assert pack.tensor(PLE_TABLE).path.name in ("IQ3_S-00002-of-00002.gguf", "ngram.gguf", "bare.gguf")
            for name, t in f.tensors.items():
                assert np.array_equal(pack.tensor(name).data(), t.data()), (form, name)
            pack.close()
    with pytest.raises(StrataError) as e:
        open_pack(pack=str(tmp_path / "main.gguf"), ple_gguf=["other.gguf"])
    assert str(e.value) == "--ple-gguf other.gguf: architecture qwen35moe, but the pack's is qwen4exp"
    with pytest.raises(StrataError) as e:  # the table twice: in the pack and in the extra file
        open_pack(pack=str(tmp_path / "iq3_s"), native="IQ3_S-00001-of-00002.gguf", ple_gguf=["../ngram.gguf"])
    assert f"tensor {PLE_TABLE} is in both" in str(e.value) and "ngram.gguf" in str(e.value)


def _copy(f: GGUFFile, out: Path, names: list[str], metadata: dict, split: tuple[int, int, int] | None = None) -> Path:
    w = GGUFWriter(out)
    w.add_all_metadata(metadata, f.metadata_types)
    if split is not None:
        for key, value in zip(("split.no", "split.count", "split.tensors.count"), split):
            w.add_metadata(key, value, ValueType.INT32 if key == "split.tensors.count" else ValueType.UINT16)
    for name in names:
        t = f.tensors[name]
        w.add_tensor(name, t.ggml_type, t.shape, lambda t=t: (t.data(),))
    return w.write()


# ------------------------------------------------------------------ one line for each mistake
@pytest.fixture()
def two(tmp_path):
    """Two packs of the qwen4exp oracle in two shards each (A and B, table in shard 2), and B in three."""
    groups = _groups(QWEN4EXP, 2, last=[PLE_TABLE])
    split_gguf(QWEN4EXP, tmp_path / "a", groups, "A")
    split_gguf(QWEN4EXP, tmp_path / "b", groups, "B")
    split_gguf(QWEN4EXP, tmp_path / "b3", _groups(QWEN4EXP, 3, last=[PLE_TABLE]), "B")
    return tmp_path


def _line(**form) -> str:
    with pytest.raises(StrataError) as e:
        open_pack(**form)
    text = str(e.value)
    assert "\n" not in text
    return text


def test_a_missing_shard(two):
    (two / "a" / "A-00002-of-00002.gguf").unlink()
    for form in (dict(pack=str(two / "a")), dict(pack=str(two / "a"), native="A-00001-of-00002.gguf"),
                 dict(pack=str(two / "a"), native="A-00001-of-00002.gguf", ple_gguf=["A-00002-of-00002.gguf"])):
        line = _line(**form)
        assert line in (f"pack {two / 'a'}: shard A-00002-of-00002.gguf is missing",
                        "--ple-gguf A-00002-of-00002.gguf: no such file"), form


def test_a_shard_that_disagrees_with_its_name(two, tmp_path):
    a = two / "a"
    with GGUFFile(a / "A-00002-of-00002.gguf") as f:  # shard 2 rewritten as "2 of 3"
        _copy(f, tmp_path / "x.gguf", list(f.tensors), {}, split=(1, 3, len(f.tensors)))
    (tmp_path / "x.gguf").replace(a / "A-00002-of-00002.gguf")
    assert _line(pack=str(a)) == f"pack {a}: A-00002-of-00002.gguf says split.count = 3, but its name says 2 shards"
    with GGUFFile(two / "b" / "B-00001-of-00002.gguf") as f:  # shard 1's file under shard 2's name
        _copy(f, a / "A-00002-of-00002.gguf", list(f.tensors), {}, split=(0, 2, 214))
    assert _line(pack=str(a)) == (f"pack {a}: A-00002-of-00002.gguf says split.no = 0 (shard 1), "
                                  f"but its name makes it shard 2 of 2")


def test_a_tensor_count_that_disagrees(two, tmp_path):
    a = two / "a"
    with GGUFFile(a / "A-00002-of-00002.gguf") as f:
        _copy(f, tmp_path / "x.gguf", list(f.tensors), {}, split=(1, 2, 215))
    (tmp_path / "x.gguf").replace(a / "A-00002-of-00002.gguf")
    assert _line(pack=str(a)) == (f"pack {a}: A-00002-of-00002.gguf says split.tensors.count = 215, "
                                  f"but A-00001-of-00002.gguf says 214")
    with GGUFFile(QWEN4EXP) as f:  # both say 215, the two files hold 214
        _copy(f, a / "A-00001-of-00002.gguf", [n for n in f.tensors if n != PLE_TABLE], f.metadata,
              split=(0, 2, 215))
    assert _line(pack=str(a)) == (f"pack {a}: A-00001-of-00002.gguf says split.tensors.count = 215, "
                                  f"but its 2 shards hold 214 tensors")


def test_a_tensor_in_two_shards(two, tmp_path):
    a = two / "a"
    with GGUFFile(QWEN4EXP) as f:
        _copy(f, a / "A-00002-of-00002.gguf", [PLE_TABLE, "output.weight"], {}, split=(1, 2, 214))
    line = _line(pack=str(a))
    assert line.startswith(f"pack {a}: tensor output.weight is in both ") and line.endswith("A-00002-of-00002.gguf")


def test_ple_gguf_from_another_pack(two):
    a, b = two / "a", two / "b"
    base = dict(pack=str(a), native="A-00001-of-00002.gguf")
    assert _line(**base, ple_gguf=[str(b / "B-00002-of-00002.gguf")]) == (
        f"--ple-gguf B-00002-of-00002.gguf: is shard 2 of 2, but the pack already has shard 2 "
        f"({a / 'A-00002-of-00002.gguf'}); it belongs to another pack")
    assert _line(**base, ple_gguf=[str(two / "b3" / "B-00003-of-00003.gguf")]) == (
        "--ple-gguf B-00003-of-00003.gguf: is shard 3 of 3 of a split, "
        "but the pack's split (A-00001-of-00002.gguf) has 2 shards")
    assert _line(pack=str(QWEN4EXP), ple_gguf=[str(b / "B-00002-of-00002.gguf")]) == (
        "--ple-gguf B-00002-of-00002.gguf: is shard 2 of 2 of a split, but the pack (qwen4exp-tiny-f16.gguf) is one file")


def test_a_shard_renamed_out_of_its_split(two, tmp_path):
    renamed = tmp_path / "main.gguf"
    (two / "a" / "A-00001-of-00002.gguf").rename(renamed)
    assert _line(pack=str(renamed)) == (
        f"pack {renamed}: main.gguf says split.count = 2 (one shard of a split), "
        f"but its name is not the NAME-00001-of-00002.gguf form its other shards are found by")


def test_cli_says_it_in_one_line(two):
    a, b = two / "a", two / "b"
    proc = subprocess.run([sys.executable, "-m", "strata.cli.main", "inspect", str(a), "--native",
                           "A-00001-of-00002.gguf", "--ple-gguf", str(b / "B-00002-of-00002.gguf"), "--no-check"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("strata: --ple-gguf B-00002-of-00002.gguf: is shard 2 of 2, but")
