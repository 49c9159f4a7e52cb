"""Pack loading: split shards, the seed config's --pack/--native/--ple-gguf form, errors."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.errors import StrataError
from strata.gguf import GGUFWriter
from strata.kernels.ggml_types import type_by_name
from strata.pack import check_arch, check_shape, open_pack

REPO = Path(__file__).resolve().parents[1]
Q8_0 = type_by_name("Q8_0")


def _shard(path: Path, tensors: list[str], *, no=None, count=None, arch="qwen3moe", fill=1) -> Path:
    w = GGUFWriter(path)
    w.add_metadata("general.architecture", arch)
    w.add_metadata(f"{arch}.block_count", 2)
    if count is not None:
        w.add_metadata("split.no", no - 1)
        w.add_metadata("split.count", count)
    for name in tensors:
        w.add_tensor(name, Q8_0.id, (64, 3), np.full(6 * Q8_0.type_size, fill, np.uint8))
    return w.write()


def _split(directory: Path, stem: str, groups: list[list[str]]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    n = len(groups)
    return [_shard(directory / f"{stem}-{i:05d}-of-{n:05d}.gguf", names, no=i, count=n, fill=i)
            for i, names in enumerate(groups, start=1)]


MAIN = ["token_embd.weight", "blk.0.attn_q.weight", "blk.1.attn_q.weight"]
PLE = ["blk.0.ffn_down_exps.weight", "blk.1.ffn_down_exps.weight"]


def test_seed_config_form(tmp_path, monkeypatch):
    _split(tmp_path / "packs" / "iq3_s", "IQ3_S", [MAIN, PLE])
    monkeypatch.chdir(tmp_path)
    pack = open_pack(pack="packs/iq3_s", native="IQ3_S-00001-of-00002.gguf", ple_gguf=["IQ3_S-00002-of-00002.gguf"])
    assert set(pack.tensors) == set(MAIN + PLE)
    assert len(pack.files) == 2 and pack.files[0].path.name == "IQ3_S-00001-of-00002.gguf"
    assert pack.arch == "qwen3moe" and pack.metadata["split.no"] == 0
    assert pack.tensor("blk.1.ffn_down_exps.weight").data()[0] == 2  # from shard 2's bytes
    assert pack.total_bytes == 5 * 6 * Q8_0.type_size
    assert "qwen3moe" in pack.describe()
    # Windows-style separators in every flag
    win = open_pack(pack="packs\\iq3_s", native="IQ3_S-00001-of-00002.gguf", ple_gguf="IQ3_S-00002-of-00002.gguf")
    assert set(win.tensors) == set(MAIN + PLE)


def test_dir_file_and_native_forms(tmp_path, monkeypatch):
    shards = _split(tmp_path / "p", "M", [MAIN[:1], MAIN[1:], PLE])
    for form in (dict(pack=str(tmp_path / "p")), dict(pack=str(shards[0])), dict(pack=str(shards[1])),
                 dict(native=str(shards[0]))):
        pack = open_pack(**form)
        assert set(pack.tensors) == set(MAIN + PLE), form
        assert pack.main.path.name == "M-00001-of-00003.gguf"
    monkeypatch.chdir(tmp_path / "p")
    assert len(open_pack(native="M-00001-of-00003.gguf").tensors) == 5


def test_missing_shard(tmp_path):
    shards = _split(tmp_path / "p", "M", [MAIN[:1], MAIN[1:], PLE])
    shards[1].unlink()
    for form in (dict(pack=str(tmp_path / "p")), dict(pack=str(shards[0]))):
        with pytest.raises(StrataError, match="shard M-00002-of-00003.gguf is missing"):
            open_pack(**form)


def test_duplicate_across_shards(tmp_path):
    _split(tmp_path / "p", "M", [MAIN, MAIN[1:2] + PLE])
    with pytest.raises(StrataError) as err:
        open_pack(pack=str(tmp_path / "p"))
    msg = str(err.value)
    assert "blk.0.attn_q.weight" in msg and "M-00001-of-00002.gguf" in msg and "M-00002-of-00002.gguf" in msg


def test_several_models_need_native(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    _shard(d / "a.gguf", MAIN)
    _shard(d / "b.gguf", PLE)
    with pytest.raises(StrataError, match=r"a\.gguf, b\.gguf.*--native"):
        open_pack(pack=str(d))
    pack = open_pack(pack=str(d), native="b.gguf")
    assert set(pack.tensors) == set(PLE)
    pack = open_pack(pack=str(d), native="a.gguf", ple_gguf="b.gguf")  # unrelated extra file joins
    assert set(pack.tensors) == set(MAIN + PLE)


def test_missing_inputs(tmp_path):
    with pytest.raises(StrataError, match="no such file or directory"):
        open_pack(pack=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(StrataError, match="no .gguf files"):
        open_pack(pack=str(tmp_path / "empty"))
    _shard(tmp_path / "empty" / "a.gguf", MAIN)
    with pytest.raises(StrataError, match="--native zz.gguf"):
        open_pack(pack=str(tmp_path / "empty"), native="zz.gguf")
    with pytest.raises(StrataError, match="--ple-gguf zz.gguf"):
        open_pack(pack=str(tmp_path / "empty"), ple_gguf="zz.gguf")


def test_split_count_mismatch(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    _shard(d / "M-00001-of-00001.gguf", MAIN, no=1, count=2)
    with pytest.raises(StrataError, match="split.count = 2"):
        open_pack(pack=str(d))


def test_validate_helpers(tmp_path):
    pack = open_pack(pack=str(_shard(tmp_path / "a.gguf", MAIN)))
    assert check_shape(pack, "blk.0.attn_q.weight", (64, 3)).name == "blk.0.attn_q.weight"
    with pytest.raises(StrataError, match=r"tensor blk.0.attn_q.weight has shape \[64, 3\] but the metadata implies \[64, 4\]"):
        check_shape(pack, "blk.0.attn_q.weight", (64, 4))
    with pytest.raises(StrataError, match="missing required tensor output.weight"):
        pack.tensor("output.weight")
    with pytest.raises(StrataError, match="missing required tensor output.weight"):
        check_shape(pack, "output.weight", (64, 3))
    assert check_arch("llama", ["llama", "qwen3"]) == "llama"
    with pytest.raises(StrataError, match=r"unsupported architecture 'gemma' \(supported: llama, qwen3\)"):
        check_arch("gemma", ["llama", "qwen3"])
    assert pack.arch_key("block_count") == 2 and pack.arch_key("nope", 7) == 7
    with pytest.raises(StrataError, match="missing metadata key qwen3moe.nope"):
        pack.arch_key("nope")


def test_cli_inspect_split_and_missing_shard(tmp_path):
    shards = _split(tmp_path / "p", "M", [MAIN, PLE])
    run = lambda *a: subprocess.run([sys.executable, "-m", "strata.cli.main", "inspect", *a],
                                    cwd=REPO, capture_output=True, text=True, timeout=60)
    ok = run(str(tmp_path / "p"), "--json", "--no-check")  # (a few tensors, no model: the listing alone)
    assert ok.returncode == 0, ok.stderr
    import json
    report = json.loads(ok.stdout)
    assert report["tensor_count"] == 5 and len(report["files"]) == 2
    roles = {r["role"]: r for r in report["roles"]}
    assert roles["blk.*.ffn_down_exps"]["tensors"] == 2 and roles["blk.*.ffn_down_exps"]["types"] == {"Q8_0": 2}
    shards[1].unlink()
    bad = run(str(tmp_path / "p"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == f"strata: pack {tmp_path / 'p'}: shard M-00002-of-00002.gguf is missing"
