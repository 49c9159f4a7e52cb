"""Mutants of small synthetic packs: byte-level damage and metadata rewritten with our writer.

Each mutation kind is one function `(rng, seed) -> (description, bytes)` in KINDS. Mutant i is
fully determined by (campaign seed, i): kind KINDS[i % len], seed pack ARCHS[(i // len) % len(ARCHS)], so
a failure is reproduced with `python -m tests.fuzz.harness --only I`.
"""

from __future__ import annotations

import math
import random
import struct
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from strata.gguf.constants import ALIGNMENT_KEY, ValueType as V
from strata.gguf.reader import GGUFFile
from strata.gguf.writer import GGUFWriter
from strata.kernels.ggml_types import BY_ID
from tests.fuzz.layout import N_KV_AT, N_TENSORS_AT, Layout, scan

ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next")
Q8_ROLES = ("embed", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
            "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ssm_in", "ssm_ba", "ssm_out", "ffn_gate_shexp",
            "ffn_up_shexp", "ffn_down_shexp", "nextn_eh_proj")
# the hybrid family at the same size: a DeltaNet and a gated-attention layer, a nextn layer
_HYBRID_SMALL = dict(n_layer=2, attn_interval=2, ssm_state=16, ssm_groups=2, ssm_heads=4, shexp_ff=32,
                     rope_dim=16, nextn=1)


def write_seed_packs(out_dir: Path) -> dict[str, Path]:
    """One tiny pack per architecture (Q8_0 everywhere, so rows of 32 weights fit; ~110 KiB each)."""
    from strata.pack.presets import TINY
    from strata.pack.synth import synth_pack

    paths = {}
    for arch in ARCHS:
        spec = replace(TINY[arch], n_layer=1, n_embd=64, n_ff=64, n_head=4, n_head_kv=2, head_dim=16, vocab=512,
                       n_expert=4 if TINY[arch].n_expert else 0, n_expert_used=2 if TINY[arch].n_expert else 0,
                       expert_ff=32, context=256, types={r: "Q8_0" for r in Q8_ROLES})
        if spec.is_hybrid:
            spec = replace(spec, **_HYBRID_SMALL, rope_sections=(3, 3, 2, 0) if spec.rope_sections else ())
        (paths[arch],) = synth_pack(spec, out_dir / arch, name=arch, force=True, progress=lambda line: None)
    return paths


@dataclass
class Seed:
    arch: str
    path: Path
    data: bytes
    layout: Layout
    metadata: dict[str, Any]
    types: dict[str, Any]
    tensors: list[tuple[str, int, tuple[int, ...], bytes]]

    @classmethod
    def open(cls, arch: str, path: Path) -> "Seed":
        data = path.read_bytes()
        with GGUFFile(path) as g:  # a valid pack: the reader under test only lists what to rewrite
            tensors = [(t.name, t.ggml_type, tuple(t.shape), bytes(t.data())) for t in g.tensors.values()]
            return cls(arch, path, data, scan(data, g.alignment), dict(g.metadata), dict(g.metadata_types), tensors)

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"


DROP = object()


def rewrite(seed: Seed, changes: dict[str, Any] | None = None,
            tensors: list[tuple[str, int, tuple[int, ...], bytes]] | None = None) -> bytes:
    """The seed written again by GGUFWriter with some metadata replaced: key -> (type, value) or DROP."""
    changes = changes or {}
    with tempfile.TemporaryDirectory() as tmp:
        w = GGUFWriter(Path(tmp) / "m.gguf")
        for key, value in seed.metadata.items():
            if key not in changes:
                w.add_metadata(key, value, seed.types[key])
        for key, change in changes.items():
            if change is not DROP:
                # straight into the table: add_metadata would make a bad alignment the writer's own
                w.metadata[key] = change
        for name, type_id, shape, data in (seed.tensors if tensors is None else tensors):
            w.add_tensor(name, type_id, shape, data)
        return w.write().read_bytes()


def _patch(data: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


# ------------------------------------------------------------------------------ byte-level kinds
def truncate(rng: random.Random, s: Seed):
    name, (lo, hi) = rng.choice(list(s.layout.regions().items()))
    cut = rng.randrange(lo, max(lo + 1, hi))
    return f"truncated at byte {cut} of {len(s.data)} (in the {name})", s.data[:cut]


def _flip(region: str):
    def mutate(rng: random.Random, s: Seed):
        lo, hi = s.layout.regions()[region]
        out = bytearray(s.data)
        spots = sorted(rng.randrange(lo, hi) for _ in range(rng.randint(1, 4)))
        for at in spots:
            out[at] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
        return f"bytes flipped in the {region} at {spots}", bytes(out)
    return mutate


_HUGE = (2**64 - 1, 2**63, 2**40, 2**32 + 1, 0xFFFFFFFF)


def huge_count(rng: random.Random, s: Seed):
    lay = s.layout
    arrays = [r for r in lay.kvs if r.count_at is not None]
    targets = {
        "tensor count": lambda: N_TENSORS_AT,
        "metadata count": lambda: N_KV_AT,
        "array length": lambda: rng.choice(arrays).count_at,
        "string length": lambda: rng.choice([a for r in lay.kvs for a in r.string_len_at[:50]]),
        "key length": lambda: rng.choice(lay.kvs).start,
        "tensor name length": lambda: rng.choice(lay.tensors).start,
    }
    what = rng.choice(list(targets))
    at = targets[what]()
    value = rng.choice(_HUGE + (len(s.data), len(s.data) // 8 + 1))
    return f"{what} at byte {at} set to {value}", _patch(s.data, at, "<Q", value)


def unknown_value_type(rng: random.Random, s: Seed):
    rec = rng.choice(s.layout.kvs)
    value = rng.choice((13, 14, 255, 2**31, 2**32 - 1))
    if rec.count_at is not None and rng.random() < 0.5:
        return f"metadata {rec.key}: array element type {value}", _patch(s.data, rec.value_at, "<I", value)
    return f"metadata {rec.key}: value type {value}", _patch(s.data, rec.vtype_at, "<I", value)


_UNKNOWN_GGML = tuple(sorted({4, 5, 31, 36, 37, 43, 44, 99, 1000, 2**32 - 1} - set(BY_ID)))


def unknown_ggml_type(rng: random.Random, s: Seed):
    t = rng.choice(s.layout.tensors)
    value = rng.choice(_UNKNOWN_GGML)
    return f"tensor {t.name}: ggml type {value}", _patch(s.data, t.type_at, "<I", value)


def other_ggml_type(rng: random.Random, s: Seed):
    """A known type other than the tensor's: its rows or its size no longer fit, or (fewer bytes)
    it reads as another type's blocks."""
    t = rng.choice(s.layout.tensors)
    value = rng.choice(sorted(set(BY_ID) - {t.type_id}))
    return (f"tensor {t.name}: ggml type {BY_ID[t.type_id].name} -> {BY_ID[value].name}",
            _patch(s.data, t.type_at, "<I", value))


def misaligned_offset(rng: random.Random, s: Seed):
    t = rng.choice(s.layout.tensors)
    value = rng.choice((t.rel_offset + rng.randint(1, 31), 2**63, 2**64 - 32, len(s.data), len(s.data) * 4 // 32 * 32))
    return f"tensor {t.name}: data offset {t.rel_offset} -> {value}", _patch(s.data, t.offset_at, "<Q", value)


def overlapping_tensors(rng: random.Random, s: Seed):
    a, b = rng.sample(s.layout.tensors, 2)
    return (f"tensor {a.name}: data offset set to {b.name}'s ({b.rel_offset})",
            _patch(s.data, a.offset_at, "<Q", b.rel_offset))


def duplicate_name(rng: random.Random, s: Seed):
    by_len: dict[int, list] = {}
    for t in s.layout.tensors:
        by_len.setdefault(len(t.name), []).append(t)
    pairs = [ts for ts in by_len.values() if len(ts) > 1]
    a, b = rng.sample(rng.choice(pairs), 2)
    out = bytearray(s.data)
    out[a.start + 8 : a.start + 8 + len(a.name)] = b.name.encode()
    return f"tensor {a.name} renamed {b.name} (a duplicate)", bytes(out)


def wrong_dims(rng: random.Random, s: Seed):
    t = rng.choice(s.layout.tensors)
    if rng.random() < 0.3:
        value = rng.choice((0, 3, 5, 8, 9, 2**31, 2**32 - 1))
        return f"tensor {t.name}: n_dims {len(t.dims)} -> {value}", _patch(s.data, t.n_dims_at, "<I", value)
    i = rng.randrange(len(t.dims))
    value = rng.choice((0, 1, t.dims[i] * 2, t.dims[i] + 32, 2**32, 2**62, 2**64 - 1))
    return f"tensor {t.name}: ne{i} {t.dims[i]} -> {value}", _patch(s.data, t.dims_at[i], "<Q", value)


# ------------------------------------------------------------------------------ metadata rewrites
_BAD_VALUES = (
    (V.UINT32, 0), (V.INT32, -1), (V.INT32, -(2**31)), (V.UINT32, 2**32 - 1), (V.UINT64, 2**64 - 1),
    (V.INT64, 2**62), (V.FLOAT32, math.nan), (V.FLOAT32, math.inf), (V.FLOAT32, -math.inf),
    (V.FLOAT32, -1.0), (V.FLOAT32, 0.0), (V.FLOAT32, 1e30), (V.FLOAT64, 2.5), (V.STRING, "12"), (V.STRING, "x\udcff\udcfe"),
    (V.BOOL, True), ((V.ARRAY, V.INT32), [1, 2]), ((V.ARRAY, V.STRING), ["a"]), (V.UINT8, 3),
)
_VALUE_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
               "attention.head_count", "attention.head_count_kv", "attention.key_length",
               "attention.value_length", "rope.dimension_count", "rope.freq_base",
               "attention.layer_norm_rms_epsilon", "vocab_size", "expert_count", "expert_used_count",
               "expert_feed_forward_length", "rope.scaling.factor", "nextn_predict_layers",
               "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
               "full_attention_interval", "rope.dimension_sections", "attention.recurrent_layers",
               "expert_shared_feed_forward_length")
_PLAIN_KEYS = (ALIGNMENT_KEY, "general.architecture", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
               "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token", "general.name",
               "tokenizer.chat_template")


def _any_key(rng: random.Random, s: Seed) -> str:
    return s.key(rng.choice(_VALUE_KEYS)) if rng.random() < 0.75 else rng.choice(_PLAIN_KEYS)


def bad_value(rng: random.Random, s: Seed):
    key = _any_key(rng, s)
    vtype, value = rng.choice(_BAD_VALUES)
    return f"metadata {key} = {value!r} ({_type_name(vtype)})", rewrite(s, {key: (vtype, value)})


def missing_key(rng: random.Random, s: Seed):
    choices = [k for k in s.metadata if k.startswith(s.arch + ".")] + [
        "general.architecture", "tokenizer.ggml.tokens", "tokenizer.ggml.model", "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type"]
    key = rng.choice(choices)
    return f"metadata {key} removed", rewrite(s, {key: DROP})


def _u32(value: int):
    return (V.UINT32, value)


def _relations(s: Seed) -> dict[str, dict[str, Any]]:
    """Values that each make sense alone but break a relation between keys or with the tensors."""
    md, k = s.metadata, s.key
    heads, hd, n_layer = md[k("attention.head_count")], md[k("attention.key_length")], md[k("block_count")]
    return {
        "head_count_kv does not divide head_count": {k("attention.head_count_kv"): _u32(3)},
        "head_count_kv > head_count": {k("attention.head_count_kv"): _u32(heads * 2)},
        "head_count 0": {k("attention.head_count"): _u32(0)},
        "rope.dimension_count > head_dim": {k("rope.dimension_count"): _u32(hd * 2)},
        "rope.dimension_count odd": {k("rope.dimension_count"): _u32(hd - 1)},
        "expert_used_count > expert_count": {k("expert_used_count"): _u32(9), k("expert_count"): _u32(4)},
        "expert_used_count 0": {k("expert_used_count"): _u32(0), k("expert_count"): _u32(4)},
        "expert_count does not match the tensors": {k("expert_count"): _u32(8), k("expert_used_count"): _u32(2)},
        "key_length != value_length": {k("attention.value_length"): _u32(hd * 2)},
        "key_length x heads does not match the tensors": {k("attention.key_length"): _u32(hd * 2),
                                                          k("attention.value_length"): _u32(hd * 2),
                                                          k("rope.dimension_count"): _u32(hd)},
        "vocab_size != token count": {k("vocab_size"): _u32(len(md["tokenizer.ggml.tokens"]) + 1)},
        "block_count > the blocks present": {k("block_count"): _u32(n_layer + 1)},
        "block_count -1": {k("block_count"): (V.INT32, -1)},
        "block_count huge": {k("block_count"): _u32(2**31)},
        "block_count a string": {k("block_count"): (V.STRING, "1")},
        "context_length NaN": {k("context_length"): (V.FLOAT32, math.nan)},
        "context_length 0": {k("context_length"): _u32(0)},
        "context_length huge": {k("context_length"): (V.UINT64, 2**62)},
        "embedding_length does not match the tensors": {k("embedding_length"): _u32(md[k("embedding_length")] * 2)},
        "feed_forward_length does not match": {k("feed_forward_length"): _u32(md.get(k("feed_forward_length"), 32) + 32)},
        # the hybrid family's keys (read only by qwen35, qwen35moe and qwen3next)
        "ssm.inner_size != state x heads": {k("ssm.inner_size"): _u32(md.get(k("ssm.inner_size"), 8) + 8)},
        "ssm.time_step_rank not a multiple of the groups": {k("ssm.time_step_rank"): _u32(3)},
        "ssm.state_size 0": {k("ssm.state_size"): _u32(0)},
        "ssm.conv_kernel 1": {k("ssm.conv_kernel"): _u32(1)},
        "ssm.group_count huge": {k("ssm.group_count"): _u32(2**31)},
        "full_attention_interval 0": {k("full_attention_interval"): _u32(0)},
        "full_attention_interval 1 (no recurrent layer: tensors differ)": {k("full_attention_interval"): _u32(1)},
        "recurrent_layers too short": {k("attention.recurrent_layers"): ((V.ARRAY, V.BOOL), [True])},
        "rope sections of 3": {k("rope.dimension_sections"): ((V.ARRAY, V.INT32), [3, 3, 2])},
        "rope sections over the rotated pairs": {k("rope.dimension_sections"): ((V.ARRAY, V.INT32), [30, 30, 30, 0])},
        "shared expert width does not match": {k("expert_shared_feed_forward_length"): _u32(64)},
        "expert_feed_forward_length does not match": {k("expert_feed_forward_length"): _u32(64)},
        "nextn_predict_layers >= block_count": {k("nextn_predict_layers"): _u32(n_layer)},
        "rms epsilon NaN": {k("attention.layer_norm_rms_epsilon"): (V.FLOAT32, math.nan)},
        "rope freq_base 0": {k("rope.freq_base"): (V.FLOAT32, 0.0)},
        "alignment an array": {ALIGNMENT_KEY: ((V.ARRAY, V.UINT32), [32, 32])},
        "alignment NaN": {ALIGNMENT_KEY: (V.FLOAT32, math.nan)},
        "alignment 0": {ALIGNMENT_KEY: _u32(0)},
        "alignment 48 (not a power of two)": {ALIGNMENT_KEY: _u32(48)},
        "alignment huge": {ALIGNMENT_KEY: _u32(2**31)},
        "rope scaling unknown": {k("rope.scaling.type"): (V.STRING, "yarn")},
        "rope scaling factor 0": {k("rope.scaling.type"): (V.STRING, "linear"), k("rope.scaling.factor"): (V.FLOAT32, 0.0)},
    }


def relation(rng: random.Random, s: Seed):
    name, changes = rng.choice(sorted(_relations(s).items()))
    return f"metadata: {name}", rewrite(s, changes)


def _tokens_changes(s: Seed) -> dict[str, dict[str, Any]]:
    md = s.metadata
    toks = list(md["tokenizer.ggml.tokens"])
    n = len(toks)
    bad_utf8 = toks[:]
    bad_utf8[300] = "ab\udcff\udcfe"  # written as the raw bytes ab FF FE: not UTF-8
    types = np.asarray(md["tokenizer.ggml.token_type"], np.int32)
    types_bad = types.copy()
    types_bad[7] = 99
    S, I32 = (V.ARRAY, V.STRING), (V.ARRAY, V.INT32)
    return {
        "a token is not UTF-8": {"tokenizer.ggml.tokens": (S, bad_utf8)},
        "one token fewer than the embedding rows": {"tokenizer.ggml.tokens": (S, toks[:-1])},
        "one token more than the embedding rows": {"tokenizer.ggml.tokens": (S, toks + ["zz_extra"])},
        "no tokens": {"tokenizer.ggml.tokens": (S, [])},
        "tokens as numbers": {"tokenizer.ggml.tokens": (I32, list(range(n)))},
        "two tokens the same": {"tokenizer.ggml.tokens": (S, toks[:5] + [toks[4]] + toks[6:])},
        "token_type shorter": {"tokenizer.ggml.token_type": (I32, types[:-3])},
        "token_type out of range": {"tokenizer.ggml.token_type": (I32, types_bad)},
        "token_type as strings": {"tokenizer.ggml.token_type": (S, ["1"] * n)},
        "bos id out of range": {"tokenizer.ggml.bos_token_id": _u32(n + 5)},
        "eos id negative": {"tokenizer.ggml.eos_token_id": (V.INT32, -2)},
        "merges garbage": {"tokenizer.ggml.merges": (S, ["nospace", "a b c", "", " "])},
        "merges as numbers": {"tokenizer.ggml.merges": (I32, [1, 2, 3])},
        "unknown tokenizer model": {"tokenizer.ggml.model": (V.STRING, "wordpiece")},
        "unknown pre-tokenizer": {"tokenizer.ggml.pre": (V.STRING, "nonesuch")},
        "scores for a gpt2 vocabulary, wrong length": {"tokenizer.ggml.scores": ((V.ARRAY, V.FLOAT32), [0.0] * 3)},
        "llama model without scores": {"tokenizer.ggml.model": (V.STRING, "llama")},
        "chat template not a string": {"tokenizer.chat_template": (I32, [1])},
        "chat template bad syntax": {"tokenizer.chat_template": (V.STRING, "{% for %}")},
    }


def bad_tokens(rng: random.Random, s: Seed):
    name, changes = rng.choice(sorted(_tokens_changes(s).items()))
    return f"tokenizer: {name}", rewrite(s, changes)


def tensor_shape(rng: random.Random, s: Seed):
    """One tensor declared (and stored) with another shape than the metadata implies."""
    i = rng.randrange(len(s.tensors))
    name, type_id, shape, _ = s.tensors[i]
    g = BY_ID[type_id]
    dim = rng.randrange(len(shape))
    new = list(shape)
    new[dim] = shape[dim] + (g.block_size if dim == 0 else rng.choice((1, -1 if shape[dim] > 1 else 1)))
    if rng.random() < 0.2:
        new = new + [1] if len(new) < 4 else new[:-1]
    new_shape = tuple(new)
    data = bytes(g.nbytes(int(np.prod(new_shape))))
    tensors = list(s.tensors)
    tensors[i] = (name, type_id, new_shape, data)
    return f"tensor {name}: shape {list(shape)} -> {list(new_shape)}", rewrite(s, tensors=tensors)


def dropped_tensor(rng: random.Random, s: Seed):
    i = rng.randrange(len(s.tensors))
    return f"tensor {s.tensors[i][0]} removed", rewrite(s, tensors=s.tensors[:i] + s.tensors[i + 1:])


def _type_name(vtype) -> str:
    return "/".join(V(v).name for v in vtype) if isinstance(vtype, tuple) else V(vtype).name


# kind -> mutator; byte-level first, then rewrites through the writer
KINDS: dict[str, Callable[[random.Random, Seed], tuple[str, bytes]]] = {
    "truncate": truncate,
    "flip_header": _flip("header"),
    "flip_metadata": _flip("metadata"),
    "flip_tensor_info": _flip("tensor_info"),
    "huge_count": huge_count,
    "unknown_value_type": unknown_value_type,
    "unknown_ggml_type": unknown_ggml_type,
    "other_ggml_type": other_ggml_type,
    "misaligned_offset": misaligned_offset,
    "overlapping_tensors": overlapping_tensors,
    "duplicate_name": duplicate_name,
    "wrong_dims": wrong_dims,
    "bad_value": bad_value,
    "missing_key": missing_key,
    "relation": relation,
    "bad_tokens": bad_tokens,
    "tensor_shape": tensor_shape,
    "dropped_tensor": dropped_tensor,
}


@dataclass(frozen=True)
class Mutant:
    index: int
    kind: str
    arch: str
    description: str
    path: Path

    def __str__(self) -> str:
        return f"mutant {self.index} [{self.kind}, {self.arch}] {self.description}"


def make_mutant(index: int, campaign_seed: int, seeds: dict[str, Seed], out_dir: Path) -> Mutant:
    kinds = list(KINDS)
    kind = kinds[index % len(kinds)]
    arch = ARCHS[(index // len(kinds)) % len(ARCHS)]
    rng = random.Random(f"{campaign_seed}:{index}")
    description, data = KINDS[kind](rng, seeds[arch])
    path = out_dir / f"m{index:05d}.gguf"
    path.write_bytes(data)
    return Mutant(index, kind, arch, description, path)
