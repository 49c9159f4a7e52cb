"""An MTP draft file's metadata is checked once, when it is opened, against its own key table
(strata.pack.draft_rules, on metadata_rules' machinery): each bad value is one line naming the
file and the key, exit code 2, through the real `strata generate --mtp`; good drafts (the
shipped one, a synthetic one, an MTP-only nextn GGUF) still load.

The pack is a tiny synthetic llama (width 256) with its synthetic draft; each mutant is that
draft rewritten with the project's GGUF writer, one key changed.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from strata.gguf.constants import ValueType as V
from strata.gguf.reader import GGUFFile
from strata.gguf.writer import GGUFWriter
from strata.mtp.defaults import default_draft_path
from support.server_proc import ROOT
from tests.support.model_fixtures import default_model_or_skip

E = 256  # the tiny llama's width (strata.pack.presets.TINY)
EMB, TARGET_ARCH, FP = "strata-mtp.embedding_length", "strata-mtp.target_architecture", "strata-mtp.target_fingerprint"
GOOD_FP = "sha256:" + "0123456789abcdef" * 4
DROP = object()  # a mutation that removes the key

# (name, key, new value, GGUF type or None, fragment of the one line; tensors "mtp" or "nextn")
BAD = [
    ("width-other", EMB, E // 2, V.UINT32, f"must equal the target's embedding_length ({E}), found {E // 2}", "mtp"),
    ("width-zero", EMB, 0, V.UINT32, "must be >= 1, found 0", "mtp"),
    ("width-text", EMB, "256", V.STRING, "must be an integer, found STRING", "mtp"),
    ("width-missing", EMB, DROP, None, "missing (an integer is required)", "mtp"),
    ("arch-missing", TARGET_ARCH, DROP, None, "missing (a string is required)", "mtp"),
    ("arch-number", TARGET_ARCH, 7, V.UINT32, "must be a string, found UINT32", "mtp"),
    ("arch-unknown", TARGET_ARCH, "gpt2", V.STRING, "must be one of llama, qwen2", "mtp"),
    ("arch-other", TARGET_ARCH, "qwen3", V.STRING, "must be the target's general.architecture (llama), found qwen3",
     "mtp"),
    ("fingerprint-short", FP, "sha256:abc", V.STRING, 'must be "sha256:" and 64 lowercase hex digits', "mtp"),
    ("fingerprint-md5", FP, "md5:" + "0" * 64, V.STRING, 'must be "sha256:"', "mtp"),
    ("fingerprint-array", FP, [GOOD_FP], (V.ARRAY, V.STRING), "must be a string, found an array of STRING", "mtp"),
    ("training-bytes", "strata-mtp.training", "made \udcff\udcfe", V.STRING, "is not valid UTF-8", "mtp"),
    ("vocabulary-number", "strata-mtp.vocabulary", 3.5, V.FLOAT32, "must be a string, found FLOAT32", "mtp"),
    ("format-other", "general.architecture", "qwen3", V.STRING,
     "must be strata-mtp or the target's architecture (llama), found qwen3", "mtp"),
    ("format-unknown", "general.architecture", "bert", V.STRING, "must be one of strata-mtp, llama", "mtp"),
    ("name-number", "general.name", 1, V.INT32, "must be a string, found INT32", "mtp"),
    ("nextn-width", "llama.embedding_length", E * 2, V.UINT32,
     f"must equal the target's embedding_length ({E}), found {E * 2}", "nextn"),
    ("nextn-arch", "general.architecture", "qwen2", V.STRING,
     "must be strata-mtp or the target's architecture (llama), found qwen2", "nextn"),
]

NEXTN_ROLES = {"mtp.enorm.weight": "nextn.enorm.weight", "mtp.hnorm.weight": "nextn.hnorm.weight",
               "mtp.eh_proj.weight": "nextn.eh_proj.weight", "mtp.output_norm.weight": "nextn.shared_head_norm.weight"}


def rewrite(src: Path, out: Path, changes: dict, nextn: bool = False) -> Path:
    """src with metadata keys changed (key -> (value, type), or DROP) and, nextn: its mtp.* tensors
    renamed to an MTP-only GGUF's blk.0.nextn.* (llama.cpp's converter), with llama arch keys."""
    f = GGUFFile(src)
    try:
        md, types = dict(f.metadata), dict(f.metadata_types)
        if nextn:
            for key in list(md):
                if key.startswith("strata-mtp."):
                    del md[key]
            md["general.architecture"], types["general.architecture"] = "llama", V.STRING
            md["llama.embedding_length"], types["llama.embedding_length"] = E, V.UINT32
        for key, change in changes.items():
            if change is DROP:
                md.pop(key, None)
            else:
                md[key], types[key] = change
        w = GGUFWriter(out)
        w.add_all_metadata(md, {k: t for k, t in types.items() if k in md})
        for name, t in f.tensors.items():
            if nextn:
                name = "blk.0." + (NEXTN_ROLES.get(name) or name.removeprefix("mtp.blk."))
            w.add_tensor(name, t.ggml_type, t.shape, np.asarray(t.data()).tobytes())
        return w.write()
    finally:
        f.close()


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """(the tiny llama pack, its good draft, an MTP-only nextn copy of it)."""
    from strata.pack.presets import TINY
    from strata.pack.synth import synth_pack

    d = tmp_path_factory.mktemp("draft-md")
    assert TINY["llama"].n_embd == E
    model, draft = synth_pack(replace(TINY["llama"], vocab=1024), d, name="llama", mtp_dir=d / "mtp",
                                progress=lambda line: None)
    return model, draft, rewrite(draft, d / "nextn.gguf", {}, nextn=True)


def _generate(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "strata.cli.main", "generate", "--device", "cpu",
                             "--prompt", "Hi", "--max-tokens", "2", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _have_the_test_model() -> bool:
    from strata.defaults import default_model_path
    from strata.errors import StrataError

    try:
        return default_model_path() is not None and default_draft_path() is not None
    except StrataError:
        return False


@pytest.fixture(scope="module")
def runs(pack, tmp_path_factory):
    """Every `strata generate --mtp` of the module, started at once (two at a time would leave
    the cores idle while each imports): {case name: (exit code, stdout, stderr, the draft)}."""
    model, draft, nextn = pack
    d = tmp_path_factory.mktemp("mutants")
    drafts = {name: rewrite(draft, d / f"{name}.gguf", {key: value if value is DROP else (value, vtype)},
                            nextn=form == "nextn")
              for name, key, value, vtype, _, form in BAD}
    drafts.update({"good": draft, "good-nextn": nextn})
    procs = {name: _generate("--pack", str(model), "--mtp", str(path), "--spec", "2") for name, path in drafts.items()}
    if _have_the_test_model():  # the default model with no flags: the shipped draft, by default on the CPU
        procs["shipped"], drafts["shipped"] = _generate(), default_draft_path()
    done = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            done[name] = (proc.returncode, out, err, drafts[name])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


@pytest.mark.parametrize("name, key, fragment", [(b[0], b[1], b[4]) for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_draft_key_is_one_line_naming_the_file_and_the_key(runs, name, key, fragment):
    rc, out, err, path = runs[name]
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and out == "", err
    # the engine opens the draft before it loads the pack's weights: the pack's line may come
    # first, then the one line about the draft, and nothing after
    *before, last = err.strip().splitlines()
    assert all(ln.startswith("strata: pack ") for ln in before), err
    assert last.startswith(f"strata: --mtp {path}: metadata key {key}: "), last
    assert fragment in last, last


def test_good_drafts_pass_the_table_and_still_load(pack, runs):
    """The synthetic draft and its nextn copy draft through the CLI; the table's values for them
    and for the shipped draft (for its model)."""
    from strata.errors import StrataError
    from strata.pack.draft_rules import checked_draft_values
    from strata.pack.loader import open_pack

    for name in ("good", "good-nextn"):
        rc, out, err, path = runs[name]
        assert rc == 0 and "Traceback" not in err, err
        assert "shared draft weights" in err and str(path) in err, err
    if "shipped" in runs:
        rc, out, err, path = runs["shipped"]
        assert rc == 0 and "shared draft weights" in err and f"shipped draft {path.name}" in err, err
    model, draft, nextn = pack
    target = open_pack(pack=str(model))
    with GGUFFile(draft) as f:
        v = checked_draft_values("--mtp d: ", f.metadata, f.metadata_types, target)
    assert (v["target_architecture"], v["embedding_length"]) == ("llama", E)
    with GGUFFile(nextn) as f:
        assert checked_draft_values("--mtp n: ", f.metadata, f.metadata_types, target)[
            "embedding_length"] == E
    shipped = default_draft_path()
    assert shipped is not None  # (strata/mtp/data ships one)
    smollm = open_pack(pack=str(default_model_or_skip()))
    with GGUFFile(shipped) as f:
        v = checked_draft_values("shipped: ", f.metadata, f.metadata_types, smollm)
    assert v["embedding_length"] == 576 and v["target_fingerprint"].startswith("sha256:")
    # the shipped draft against another target: one line, naming it as the shipped draft
    from strata.mtp.draft import find_draft

    with pytest.raises(StrataError) as e:
        find_draft(str(shipped), target, f"shipped draft {shipped.name}")
    assert e.value.message == (f"shipped draft {shipped.name}: metadata key {EMB}: "
                               f"must equal the target's embedding_length ({E}), found 576")


def test_the_target_is_checked_by_its_own_table_first(pack, tmp_path):
    """A draft opened for a broken pack names the pack's key, not the draft's."""
    from strata.errors import StrataError
    from strata.mtp.draft import find_draft
    from strata.pack.loader import open_pack

    model, draft, _ = pack
    with GGUFFile(model) as f:
        md, types = dict(f.metadata), dict(f.metadata_types)
        md["llama.embedding_length"] = 0
        w = GGUFWriter(tmp_path / "broken.gguf")
        w.add_all_metadata(md, types)
        for name, t in f.tensors.items():
            w.add_tensor(name, t.ggml_type, t.shape, np.asarray(t.data()).tobytes())
        broken = w.write()
    with pytest.raises(StrataError) as e:
        find_draft(str(draft), open_pack(pack=str(broken)))
    assert e.value.message == f"pack {broken}: metadata key llama.embedding_length: must be >= 1, found 0"
