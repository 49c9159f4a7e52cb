"""The architecture registry (strata/model/archs/): one file per architecture, nothing else names it.

- Apart from its own file, no module of strata/ names an architecture (STYLE.md section 4): the
  config reader, the loader's check, synthetic packs and their presets find it in ARCHS.
- An architecture's tensor table is the one its layers read: every tensor a synthetic pack of it
  holds (the table's) is read when the model and its draft are built.
- A sequence's state goes back to a snapshot whatever the architecture: the same tokens after a
  restore give the same bits.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from strata.backend.cpu import CpuBackend
from strata.model.archs import ARCHS
from strata.model.build import build_model
from strata.model.state import StateLost
from strata.model.transformer import Span
from strata.pack.loader import open_pack
from strata.pack.presets import TINY
from strata.pack.synth import synth_pack

ROOT = Path(__file__).resolve().parents[1]
# where a string spelled like an architecture is something else: tokenizer pre-tokenizer names
# (tokenizer.ggml.pre), and `strata pack synth`'s default --arch
NOT_ARCH_NAMES = {"strata/text/pretokenizers.py", "strata/text/tokenizer.py", "strata/cli/pack.py"}


def _names_of(arch: str, text: str) -> bool:
    """The architecture, one of its presets ("qwen35moe-tiny") or keys ("qwen3.block_count");
    prose (a docstring, a message) is not a name."""
    return not any(c.isspace() for c in text) and (text == arch or text.startswith((arch + "-", arch + ".")))


def test_only_an_architectures_own_file_names_it():
    named: dict[str, set[str]] = {arch: set() for arch in ARCHS}
    for path in (ROOT / "strata").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel in NOT_ARCH_NAMES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for arch in ARCHS:
                    if _names_of(arch, node.value):
                        named[arch].add(rel)
    for arch, files in named.items():
        assert files <= {f"strata/model/archs/{arch}.py"}, f"{arch} is named outside its file: {sorted(files)}"


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    out = {}
    for arch in ARCHS:
        synth_pack(replace(TINY[arch], vocab=512), root / arch, progress=lambda *a: None)
        out[arch] = root / arch / "model.gguf"
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_table_is_what_the_layers_read(packs, arch):
    from strata.mtp.draft import DraftModel, find_draft

    pack = open_pack(pack=str(packs[arch]))
    read: set[str] = set()

    def get(name):
        read.add(name)
        return pack.tensors.get(name)

    m = build_model(CpuBackend(), pack.model_config(), get)
    src = find_draft(None, pack)
    if src is not None:  # the nextn layer
        src.get = get
        DraftModel(m.b, m.cfg, src, m)
    assert set(pack.tensors) - read == set()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_restore_goes_back_to_the_snapshot(packs, arch):
    pack = open_pack(pack=str(packs[arch]))
    m = build_model(CpuBackend(), pack.model_config(), lambda n: pack.tensors.get(n))
    cache = m.new_cache(64, "f16")
    m.forward(np.arange(1, 7), [Span(cache, 0, 6)])
    snap = cache.snapshot()
    first = m.forward(np.asarray([7, 8, 9]), [Span(cache, 6, 3)], logit_rows=[2])[1]
    m.forward(np.asarray([10]), [Span(cache, 9, 1)])
    cache.restore(snap)
    again = m.forward(np.asarray([7, 8, 9]), [Span(cache, 6, 3)], logit_rows=[2])[1]
    assert np.array_equal(first, again)
    cache.truncate(7)
    with pytest.raises(StateLost):
        cache.restore(snap)
