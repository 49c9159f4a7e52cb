"""Synthetic packs: valid GGUF models of a given shape and type plan, filled with random
quantized blocks of sane magnitude and the test model's real tokenizer.

They exercise every code path a real model of that architecture and type mix would
(loading, kernels, routing, sharding, MTP) without shipping gigabytes of weights.
"""

from __future__ import annotations

import os
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.errors import StrataError
from strata.gguf.constants import SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY, ValueType as V
from strata.gguf.out_path import check_room, out_dir as writable_dir
from strata.gguf.writer import GGUFWriter
from strata.pack.loader import shard_name
from strata.pack.presets import SynthSpec
from strata.pack.synth_metadata import (  # noqa: F401  (names read from here)
    MTP_ARCH, TOKENIZER_ENV, draft_metadata, model_metadata, smollm_model_path, tokenizer_metadata,
)
from strata.pack.synth_plan import (  # noqa: F401  (names read from here)
    DEFAULT_TYPE, TensorPlan, check_spec, mtp_tensors, plan_tensors, type_for,
)

CHUNK_BYTES = 32 << 20  # generate big tensors in pieces so memory stays flat


# ----------------------------------------------------------------------------- data
def _random_blocks():
    try:
        from strata.kernels.random_blocks import random_blocks
    except ImportError:
        raise StrataError("pack synth: strata.kernels.random_blocks is not available in this build") from None
    return random_blocks


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """Per-tensor stream: the same tensor gets the same bytes however the pack is sharded."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def tensor_data(plan: TensorPlan, seed: int) -> Callable[[], Iterator[np.ndarray]]:
    row_len = plan.ne[0]
    n_rows = int(np.prod(plan.ne[1:])) if len(plan.ne) > 1 else 1
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, plan.gtype.row_bytes(row_len)))

    def chunks() -> Iterator[np.ndarray]:
        rng = tensor_rng(seed, plan.name)
        for start in range(0, n_rows, rows_per_chunk):
            n = min(rows_per_chunk, n_rows - start)
            if plan.fill == "norm":  # RMS-norm gains sit near 1
                yield (1.0 + plan.scale * rng.standard_normal(n * row_len)).astype(np.float32)
            elif plan.fill == "ssm_a":  # -exp(A_log), A_log in [0, log 16): decays of every speed
                yield (-np.exp(rng.uniform(0.0, np.log(16.0), n * row_len))).astype(np.float32)
            elif plan.fill == "bias":
                yield (plan.scale * rng.standard_normal(n * row_len)).astype(np.float32)
            else:  # random_blocks: valid blocks whose dequantized RMS is about plan.scale
                yield np.asarray(_random_blocks()(plan.gtype.id, n, row_len, rng, plan.scale), dtype=np.uint8)

    return chunks


# ----------------------------------------------------------------------------- writing
def split_evenly(plans: list[TensorPlan], n: int) -> list[list[TensorPlan]]:
    """Contiguous groups of about equal bytes, none empty (as gguf-split keeps tensor order)."""
    if n > len(plans):
        raise StrataError(f"--shards {n}: the model has only {len(plans)} tensors")
    total = sum(p.nbytes for p in plans)
    groups: list[list[TensorPlan]] = [[]]
    done = 0
    for i, p in enumerate(plans):
        must_cut = len(plans) - i <= n - len(groups)  # leave one tensor per remaining shard
        want_cut = done >= total * len(groups) / n
        if groups[-1] and len(groups) < n and (want_cut or must_cut):
            groups.append([])
        groups[-1].append(p)
        done += p.nbytes
    return groups


@dataclass
class _PendingFile:
    flag: str  # the flag that chose its folder: --out or --mtp
    writer: GGUFWriter
    plans: list[TensorPlan]
    nbytes: int  # the file's size on disk


def _pending(flag: str, path: Path, meta, plans: list[TensorPlan], seed: int) -> _PendingFile:
    w = GGUFWriter(path)
    for key, value, vtype in meta:
        w.add_metadata(key, value, vtype)
    for p in plans:
        w.add_tensor(p.name, p.gtype.id, p.ne, tensor_data(p, seed))
    return _PendingFile(flag, w, plans, w.file_size())


def _check_room(files: list[_PendingFile]) -> None:
    """All the files of one disk must fit in its free space, less what they replace."""
    need: dict[int, int] = defaultdict(int)
    where: dict[int, tuple[str, Path]] = {}
    for f in files:
        folder = f.writer.path.parent
        dev = os.stat(folder).st_dev
        old = f.writer.path.stat().st_size if f.writer.path.is_file() else 0
        need[dev] += f.nbytes - old
        where.setdefault(dev, (f.flag, folder))
    for dev, nbytes in need.items():
        check_room(*where[dev], nbytes)


def _write_file(f: _PendingFile, progress) -> Path:
    path = f.writer.path
    try:
        f.writer.write()
    except OSError as e:
        raise StrataError(f"{f.flag} {path.parent}: cannot write {path.name}: {e.strerror}") from None
    size = sum(p.nbytes for p in f.plans)
    progress(f"wrote {path} ({len(f.plans)} tensors, {size / 2**20:.1f} MiB)")
    return path


def _prepare_dir(directory: Path, force: bool, keep: set[str]) -> None:
    foreign = sorted(p.name for p in directory.glob("*.gguf") if p.name not in keep)
    if foreign and not force:
        raise StrataError(f"--out {directory}: already holds other .gguf files ({', '.join(foreign)}); use --force to replace them")
    for name in foreign:
        (directory / name).unlink()


def synth_pack(
    spec: SynthSpec,
    out_dir: str | Path,
    *,
    name: str = "model",
    shards: int = 1,
    seed: int = 0,
    mtp_dir: str | Path | None = None,
    force: bool = False,
    progress: Callable[[str], None] = print,
) -> list[Path]:
    """Write the pack (and optionally its MTP draft); returns the files written."""
    if spec.is_hybrid:
        # with --mtp the nextn layer goes to an MTP-only GGUF (as llama.cpp's converter writes
        # one), the pack keeps the main stack; without, the pack carries it
        plans = plan_tensors(spec, nextn=mtp_dir is None)
        draft = plan_tensors(spec, trunk=False) if mtp_dir is not None else []
    else:
        plans = plan_tensors(spec)
        draft = mtp_tensors(spec) if mtp_dir is not None else []
    check_spec(spec, plans + draft)
    if shards < 1:
        raise StrataError(f"--shards {shards}: must be >= 1")
    _random_blocks()  # fail before writing anything
    groups = split_evenly(plans, shards)
    out = writable_dir(out_dir, "--out")
    names = [f"{name}.gguf"] if shards == 1 else [shard_name(name, i + 1, shards) for i in range(shards)]
    meta = model_metadata(spec, name, nextn=mtp_dir is None)
    files = []
    for i, (file_name, group) in enumerate(zip(names, groups)):
        split = []
        if shards > 1:  # the keys and types llama.cpp's gguf-split writes
            split = [(SPLIT_NO_KEY, i, V.UINT16), (SPLIT_COUNT_KEY, shards, V.UINT16),
                     (SPLIT_TENSORS_COUNT_KEY, len(plans), V.INT32)]
        file_meta = (meta + split) if i == 0 else split
        files.append(_pending("--out", out / file_name, file_meta, group, seed))
    if mtp_dir is not None:
        mtp = writable_dir(mtp_dir, "--mtp")
        if spec.is_hybrid:
            mtp_meta, mtp_seed = model_metadata(spec, f"{name} MTP", nextn=True), seed
        else:
            mtp_meta, mtp_seed = draft_metadata(spec, name), seed + 1
        files.append(_pending("--mtp", mtp / "mtp.gguf", mtp_meta, draft, mtp_seed))
    _check_room(files)  # before a byte is written or an old file removed
    _prepare_dir(out, force, set(names))
    progress(f"writing {len(files)} file(s), {sum(f.nbytes for f in files) / 2**20:.1f} MiB in all")
    return [_write_file(f, progress) for f in files]
