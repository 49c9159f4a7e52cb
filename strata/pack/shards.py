"""One pack split over several GGUF files, as llama.cpp's gguf-split writes it.

The format (llama.cpp `tools/gguf-split/gguf-split.cpp` and `llama_split_path` in
`src/llama.cpp`; the gguf package's `GGUFWriter` with `split_max_tensors` writes the same):
  - shard k of n (1-based) is named `PREFIX-0000k-of-0000n.gguf`, all in one folder;
  - every shard holds `split.no` (u16, k - 1), `split.count` (u16, n) and
    `split.tensors.count` (i32, the tensors of all n shards together);
  - only shard 1 holds the model's metadata; every tensor lives in exactly one shard.

A shard is found by its name (the loader lists the set from any one member), and each file is
held to the keys it carries: its place, the count, the total. `place_extra` decides where a
file named on its own (`--ple-gguf FILE`) goes: into its slot of the pack's split, or beside
the pack as a source of tensors the pack lacks. Every mistake is one line naming the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from strata.errors import StrataError
from strata.gguf.constants import SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY
from strata.gguf.reader import GGUFFile

SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_name(stem: str, no: int, count: int) -> str:
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def shard_slots(path: Path) -> list[Path]:
    """The standard paths of every shard in the split that `path`'s name places it in, shard 1
    first ([path] itself when the name is not a shard's)."""
    m = SHARD_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    return [path.parent / shard_name(m["stem"], i, count) for i in range(1, count + 1)]


@dataclass(frozen=True)
class SplitKeys:
    """A file's split.* keys; None where the file has no such key."""

    no: int | None
    count: int | None
    tensors: int | None

    @classmethod
    def of(cls, f: GGUFFile) -> "SplitKeys":
        def number(key: str) -> int | None:
            value = f.metadata.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StrataError(f"{f.path}: metadata key {key}: must be a count, found {value!r}")
            return int(value)

        return cls(number(SPLIT_NO_KEY), number(SPLIT_COUNT_KEY), number(SPLIT_TENSORS_COUNT_KEY))

    @property
    def is_shard(self) -> bool:
        """Part of a split of more than one file (a split of one is a plain file)."""
        return self.count is not None and self.count > 1


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def check_split(label: str, shards: list[GGUFFile]) -> None:
    """The shards of one split, in place order 1..n: each file's split.no is its place and its
    split.count is n (check_tensor_total then holds split.tensors.count to what they hold)."""
    n = len(shards)
    for place, f in enumerate(shards, start=1):
        keys = SplitKeys.of(f)
        named = SHARD_NAME.match(f.path.name) is not None
        if keys.count is not None and keys.count != n:
            if n == 1 and not named:
                raise StrataError(
                    f"pack {label}: {f.path.name} says {SPLIT_COUNT_KEY} = {keys.count} (one shard of a split), "
                    f"but its name is not the NAME-00001-of-{keys.count:05d}.gguf form its other shards are found by")
            raise StrataError(f"pack {label}: {f.path.name} says {SPLIT_COUNT_KEY} = {keys.count}, "
                              f"but its name says {_plural(n, 'shard')}")
        if keys.no is not None and keys.no != place - 1:
            raise StrataError(f"pack {label}: {f.path.name} says {SPLIT_NO_KEY} = {keys.no} (shard {keys.no + 1}), "
                              f"but its name makes it shard {place} of {n}")


def check_tensor_total(label: str, shards: list[GGUFFile]) -> None:
    """split.tensors.count, where the shards give it, is one number: the tensors the n files hold."""
    n = len(shards)
    declared: tuple[int, GGUFFile] | None = None
    for f in shards:
        keys = SplitKeys.of(f)
        if keys.tensors is None:
            continue
        if declared is None:
            declared = (keys.tensors, f)
        elif keys.tensors != declared[0]:
            raise StrataError(f"pack {label}: {f.path.name} says {SPLIT_TENSORS_COUNT_KEY} = {keys.tensors}, "
                              f"but {declared[1].path.name} says {declared[0]}")
    held = sum(len(f.tensors) for f in shards)
    if declared is not None and n > 1 and declared[0] != held:
        raise StrataError(f"pack {label}: {declared[1].path.name} says {SPLIT_TENSORS_COUNT_KEY} = {declared[0]}, "
                          f"but its {_plural(n, 'shard')} hold {_plural(held, 'tensor')}")


def place_extra(flag: str, extra: GGUFFile, paths: list[Path], held: list[GGUFFile | None]) -> int | None:
    """Where a separately named file joins the pack: its slot index in the pack's split (a shard,
    checked to belong: the same split.count and a place no other file holds), or None for a
    plain file, whose tensors join beside the pack's.

    paths: the pack's shards by place, as their names give them; held: the file open in each
    place, None where the folder lacks it."""
    keys = SplitKeys.of(extra)
    if not keys.is_shard:
        return None
    where = f"{flag} {extra.path.name}"
    if keys.no is None or keys.no >= keys.count:
        raise StrataError(f"{where}: says {SPLIT_COUNT_KEY} = {keys.count} but {SPLIT_NO_KEY} = {keys.no}")
    shard = f"shard {keys.no + 1} of {keys.count}"
    if len(paths) == 1:
        raise StrataError(f"{where}: is {shard} of a split, but the pack ({paths[0].name}) is one file")
    if keys.count != len(paths):
        raise StrataError(f"{where}: is {shard} of a split, but the pack's split ({paths[0].name}) "
                          f"has {_plural(len(paths), 'shard')}")
    if held[keys.no] is not None:
        raise StrataError(f"{where}: is {shard}, but the pack already has shard {keys.no + 1} ({held[keys.no].path}); "
                          f"it belongs to another pack")
    return keys.no


def check_beside(flag: str, extra: GGUFFile, main: GGUFFile) -> None:
    """A plain file joining the pack's namespace is of the pack's architecture where it names one
    (a file with no metadata of its own, e.g. a table written alone, is taken as it is)."""
    if extra.arch is not None and main.arch is not None and extra.arch != main.arch:
        raise StrataError(f"{flag} {extra.path.name}: architecture {extra.arch}, but the pack's is {main.arch}")
