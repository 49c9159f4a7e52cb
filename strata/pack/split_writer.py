"""Write one GGUF file as a split of several, the layout strata.pack.shards reads.

Shard 1 carries the source's metadata; every shard carries `split.no`, `split.count` and
`split.tensors.count` with the types llama.cpp's gguf-split writes (u16, u16, i32); tensor bytes
are copied as they are (no conversion), each tensor into the shard its group names. Tests build
the multi-file packs of a bug report from a one-file pack with it; the groups say which tensors
share a file (e.g. the n-gram table alone in the last shard, as the report's pack has it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from strata.errors import StrataError
from strata.gguf.constants import SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY, ValueType
from strata.gguf.reader import GGUFFile
from strata.gguf.writer import GGUFWriter
from strata.pack.shards import shard_name

_SPLIT_KEYS = (SPLIT_NO_KEY, SPLIT_COUNT_KEY, SPLIT_TENSORS_COUNT_KEY)


def split_gguf(src: str | Path, out_dir: str | Path, groups: Sequence[Sequence[str]], stem: str) -> list[Path]:
    """Write `src` as len(groups) shards `stem-0000k-of-0000n.gguf` in out_dir; groups[k] names
    the tensors of shard k + 1, and together they name each tensor of src exactly once."""
    out_dir = Path(out_dir)
    with GGUFFile(src) as f:
        _check_groups(f, groups)
        n = len(groups)
        paths = []
        for k, names in enumerate(groups):
            w = GGUFWriter(out_dir / shard_name(stem, k + 1, n), alignment=f.alignment)
            if k == 0:
                w.add_all_metadata({key: v for key, v in f.metadata.items() if key not in _SPLIT_KEYS},
                                   f.metadata_types)
            w.add_metadata(SPLIT_NO_KEY, k, ValueType.UINT16)
            w.add_metadata(SPLIT_COUNT_KEY, n, ValueType.UINT16)
            w.add_metadata(SPLIT_TENSORS_COUNT_KEY, len(f.tensors), ValueType.INT32)
            for name in names:
                t = f.tensors[name]
                w.add_tensor(name, t.ggml_type, t.shape, lambda t=t: (t.data(),))
            paths.append(w.write())
    return paths


def _check_groups(f: GGUFFile, groups: Sequence[Sequence[str]]) -> None:
    if not groups or any(not g for g in groups):
        raise StrataError(f"{f.path}: a split needs at least one tensor in each shard")
    named = [name for g in groups for name in g]
    unknown = sorted(set(named) - set(f.tensors))
    if unknown:
        raise StrataError(f"{f.path}: no tensor {unknown[0]} to place in a shard")
    twice = sorted(name for name, n in Counter(named).items() if n > 1)
    if twice:
        raise StrataError(f"{f.path}: tensor {twice[0]} is placed in two shards")
    left = [name for name in f.tensors if name not in set(named)]
    if left:
        raise StrataError(f"{f.path}: tensor {left[0]} is in no shard")
