"""Open a model "pack": one or more GGUF files joined into one tensor namespace.

Flag forms (as the CLI passes them):
  --pack DIR                      every *.gguf in DIR (one model: one file or one split set)
  --pack FILE                     that file (plus its siblings when it is one shard of a split)
  --native FILE                   the main file; relative paths resolve against --pack DIR
  --ple-gguf FILE [FILE ...]      a shard of the pack's split (where the folder lacks it, or
                                  naming one the folder has), or a plain file whose tensors the
                                  pack lacks (the n-gram table of a pack written without it)
Split shards follow llama.cpp's gguf-split naming, NAME-0000i-of-0000N.gguf, and are held to
their split.* keys (strata.pack.shards); metadata comes from shard 1. Model code looks a tensor
up by name (`Pack.tensor`), whichever file holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.errors import StrataError
from strata.gguf.reader import GGUFFile, TensorInfo
from strata.pack.shards import (SHARD_NAME, check_beside, check_split, check_tensor_total, place_extra, shard_name,
                                shard_slots)

__all__ = ["Pack", "open_pack", "user_path", "shard_name", "SHARD_NAME"]


def user_path(text: str | Path, base: Path | None = None) -> Path:
    """A path from a flag: Windows backslashes accepted; relative ones tried against base first."""
    raw = str(text)
    candidates = [Path(raw)]
    if "\\" in raw:
        candidates.append(Path(raw.replace("\\", "/")))
    ordered = []
    for c in candidates:
        if base is not None and not c.is_absolute():
            ordered.append(base / c)
        ordered.append(c)
    for c in ordered:
        if c.exists():
            return c
    return ordered[0]


def _models_in_dir(directory: Path) -> dict[str, list[Path]]:
    """Group a directory's .gguf files into models: a split set counts as one."""
    groups: dict[str, list[Path]] = {}
    for p in sorted(directory.glob("*.gguf")):
        m = SHARD_NAME.match(p.name)
        key = shard_name(m["stem"], 1, int(m["count"])) if m else p.name
        groups.setdefault(key, []).append(p)
    return groups


@dataclass
class Pack:
    label: str  # how the user named it, for messages
    files: list[GGUFFile]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def main(self) -> GGUFFile:
        return self.files[0]

    @property
    def metadata(self) -> dict[str, Any]:
        return self.main.metadata

    @property
    def metadata_types(self):
        return self.main.metadata_types

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise StrataError(f"pack {self.label}: missing metadata key general.architecture")
        return arch

    def require(self, key: str) -> Any:
        """A metadata value the model cannot do without; a named error when absent."""
        if key not in self.metadata:
            raise StrataError(f"pack {self.label}: missing metadata key {key}")
        return self.metadata[key]

    def arch_key(self, suffix: str, default: Any = ...) -> Any:
        """`{arch}.{suffix}`, e.g. arch_key('block_count'); required unless a default is given."""
        key = f"{self.arch}.{suffix}"
        if default is not ... and key not in self.metadata:
            return default
        return self.require(key)

    def model_config(self):
        """The model's hyperparameters (a ModelConfig), once the metadata has passed the key table
        (strata/model/config.py) and every tensor the model reads has the shape it implies: the
        one check a pack gets before a model is built from it."""
        from strata.model.config import config_from_metadata
        from strata.pack.validate import check_tensors

        cfg = config_from_metadata(self.metadata, label=self.label, types=self.metadata_types)
        check_tensors(self, cfg)
        return cfg

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise StrataError(f"pack {self.label}: missing required tensor {name}") from None

    def has(self, name: str) -> bool:
        return name in self.tensors

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def describe(self) -> str:
        lines = [
            f"pack {self.label}: arch {self.metadata.get('general.architecture', '?')}, "
            f"{len(self.tensors)} tensors, {self.total_bytes / 2**20:.1f} MiB in {len(self.files)} file(s)"
        ]
        lines += [f"  {f.path}" for f in self.files]
        return "\n".join(lines)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def _join(self, gguf: GGUFFile) -> None:
        for name, info in gguf.tensors.items():
            other = self.tensors.get(name)
            if other is not None:
                raise StrataError(f"pack {self.label}: tensor {name} is in both {other.path} and {info.path}")
            self.tensors[name] = info
        self.files.append(gguf)


def _main_paths(pack: str | None, native: str | None) -> tuple[str, Path | None, Path]:
    """(label, the folder relative names resolve against, the main file: any shard of a split)."""
    base = None
    if pack is not None:
        pack_path = user_path(pack)
        label = str(pack)
        if pack_path.is_dir():
            base = pack_path
        elif pack_path.is_file():
            base = pack_path.parent
            if native is None:
                return label, base, pack_path
        else:
            raise StrataError(f"pack {pack}: no such file or directory")
    if native is not None:
        native_path = user_path(native, base)
        label = str(pack) if pack is not None else str(native)
        if not native_path.is_file():
            where = f" (looked in {base})" if base is not None else ""
            raise StrataError(f"--native {native}: no such file{where}")
        return label, base, native_path
    if pack is None:
        raise StrataError("no model given: pass --pack DIR|FILE or --native FILE")
    groups = _models_in_dir(base)
    if not groups:
        raise StrataError(f"pack {pack}: no .gguf files in {base}")
    if len(groups) > 1:
        names = ", ".join(groups)
        raise StrataError(f"pack {pack}: holds several models ({names}); pick the main one with --native")
    (first, members), = groups.items()
    return label, base, (base / first if SHARD_NAME.match(first) else members[0])


def open_pack(
    pack: str | None = None,
    native: str | None = None,
    ple_gguf: list[str] | str | None = None,
) -> Pack:
    label, base, main = _main_paths(pack, native)
    if isinstance(ple_gguf, (str, Path)):
        ple_gguf = [ple_gguf]
    extra_paths = []
    for extra in ple_gguf or ():
        extra_path = user_path(extra, base)
        if not extra_path.is_file():
            raise StrataError(f"--ple-gguf {extra}: no such file")
        extra_paths.append(extra_path)

    opened: list[GGUFFile] = []
    try:
        return _assemble(label, shard_slots(main), extra_paths, opened)
    except BaseException:
        for f in opened:
            f.close()
        raise


def _assemble(label: str, paths: list[Path], extra_paths: list[Path], opened: list[GGUFFile]) -> Pack:
    """Open the split's shards found by name, place each --ple-gguf file (a shard into its slot,
    a plain file beside), then check the split and join every tensor into one namespace."""
    def open_file(path: Path) -> GGUFFile:
        f = GGUFFile(path)
        opened.append(f)
        return f

    held: list[GGUFFile | None] = [open_file(p) if p.is_file() else None for p in paths]
    seen = {f.path.resolve() for f in held if f is not None}
    beside: list[GGUFFile] = []
    for path in extra_paths:
        if path.resolve() in seen:  # --ple-gguf naming a shard already loaded with its set
            continue
        seen.add(path.resolve())
        f = open_file(path)
        place = place_extra("--ple-gguf", f, paths, held)
        if place is None:
            beside.append(f)
        else:
            held[place] = f
    for path, f in zip(paths, held):
        if f is None:
            raise StrataError(f"pack {label}: shard {path.name} is missing")
    check_split(label, held)
    for f in beside:
        check_beside("--ple-gguf", f, held[0])
    result = Pack(label, [])
    for f in held + beside:  # (a tensor in two files is named before the counts disagree)
        result._join(f)
    check_tensor_total(label, held)
    return result
