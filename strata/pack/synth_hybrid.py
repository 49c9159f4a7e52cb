"""Synthetic packs of the hybrid family (qwen35moe, qwen35, qwen3next): the metadata llama.cpp's
converters write, and the tensors of strata/model/hybrid/tensors.py (the table the loader checks),
so a synthetic pack is laid out as a real one and llama.cpp loads it unchanged."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from strata.errors import StrataError
from strata.gguf.constants import ValueType as V
from strata.kernels.ggml_types import BY_NAME
from strata.model.hybrid.config import FAMILY
from strata.model.hybrid.tensors import INPUT_FORMS
from strata.pack.presets import SynthSpec


def with_delta_net_input(spec: SynthSpec, form: str) -> SynthSpec:
    """spec with its DeltaNet input projection in `form` (INPUT_FORMS: "split" attn_qkv +
    attn_gate, or "fused" ssm_in as earlier qwen3next converters wrote it)."""
    out = replace(spec, delta_net_input=form)
    _check_delta_net_input(out)
    return out


def _check_delta_net_input(spec: SynthSpec) -> None:
    form = spec.delta_net_input
    if form not in INPUT_FORMS:
        raise StrataError(f"--delta-net-input {form}: unknown (known: {', '.join(INPUT_FORMS)})")
    traits = FAMILY.get(spec.arch)
    if form == "fused" and not (traits and traits.fused_qkvz):
        raise StrataError(f"--delta-net-input fused: only qwen3next packs hold a fused ssm_in, not --arch {spec.arch}")


def _rope_dim(spec: SynthSpec) -> int:
    return spec.rope_dim or spec.head_dim


def hybrid_arch_metadata(spec: SynthSpec, *, nextn: bool = True) -> list[tuple[str, object, object]]:
    """The `{arch}.*` keys; nextn False: a main stack alone (its nextn layer written elsewhere)."""
    a = spec.arch
    n_nextn = spec.nextn if nextn else 0
    u32 = lambda key, value: (f"{a}.{key}", int(value), V.UINT32)  # noqa: E731
    meta = [
        u32("vocab_size", spec.vocab),
        u32("context_length", spec.context),
        u32("embedding_length", spec.n_embd),
        u32("block_count", spec.n_layer + n_nextn),
        u32("attention.head_count", spec.n_head),
        u32("attention.head_count_kv", spec.n_head_kv),
        u32("attention.key_length", spec.head_dim),
        u32("attention.value_length", spec.head_dim),
        u32("rope.dimension_count", _rope_dim(spec)),
        (f"{a}.rope.freq_base", float(spec.rope_freq_base), V.FLOAT32),
        (f"{a}.attention.layer_norm_rms_epsilon", float(spec.rms_eps), V.FLOAT32),
        u32("ssm.conv_kernel", spec.ssm_conv),
        u32("ssm.state_size", spec.ssm_state),
        u32("ssm.group_count", spec.ssm_groups),
        u32("ssm.time_step_rank", spec.ssm_heads),
        u32("ssm.inner_size", spec.ssm_state * spec.ssm_heads),
        u32("full_attention_interval", spec.attn_interval),
    ]
    if n_nextn:
        meta.append(u32("nextn_predict_layers", n_nextn))
    if spec.rope_sections:
        meta.append((f"{a}.rope.dimension_sections", np.asarray(spec.rope_sections, np.int32), (V.ARRAY, V.INT32)))
    if spec.n_expert:
        meta += [u32("expert_count", spec.n_expert), u32("expert_used_count", spec.n_expert_used),
                 u32("expert_feed_forward_length", spec.expert_ff),
                 u32("expert_shared_feed_forward_length", spec.shexp_ff)]
    else:
        meta.append(u32("feed_forward_length", spec.n_ff))
    return meta


def spec_config(spec: SynthSpec):
    """The ModelConfig a pack of this spec (with its nextn layers) reads as."""
    from strata.model.config import config_from_metadata

    md = {k: v for k, v, _ in hybrid_arch_metadata(spec, nextn=True)}
    md.update({"general.architecture": spec.arch, "tokenizer.ggml.model": "gpt2",
               "tokenizer.ggml.tokens": [""] * spec.vocab})
    return config_from_metadata(md, label="synth")


def check_hybrid_spec(spec: SynthSpec) -> None:
    for flag, value in (("--ssm-state", spec.ssm_state), ("--ssm-groups", spec.ssm_groups),
                        ("--ssm-heads", spec.ssm_heads)):
        if value <= 0:
            raise StrataError(f"{flag} {value}: must be > 0 for --arch {spec.arch}")
    if spec.ssm_heads % spec.ssm_groups:
        raise StrataError(f"--ssm-heads {spec.ssm_heads} is not a multiple of --ssm-groups {spec.ssm_groups}")
    if spec.is_moe and spec.shexp_ff <= 0:  # (the experts' own flags: synth.check_spec)
        raise StrataError(f"--shexp-ff {spec.shexp_ff}: must be > 0 for --arch {spec.arch}")
    _check_delta_net_input(spec)


def hybrid_plans(spec: SynthSpec, *, trunk: bool, nextn: bool):
    """TensorPlans (strata.pack.synth) of the main stack and/or the nextn layers."""
    from strata.model.hybrid.tensors import model_tensors
    from strata.pack.synth import TensorPlan, type_for

    check_hybrid_spec(spec)
    cfg = spec_config(spec)
    form = spec.delta_net_input
    plans = []
    for t in model_tensors(cfg, trunk=trunk, nextn=nextn and spec.nextn > 0):
        if (t.name == "output.weight" and spec.tied_output) or t.form not in (None, form):
            continue
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
        if t.role is None:
            scale = {"norm": 0.02, "bias": 0.5, "conv": t.ne[0] ** -0.5, "ssm_a": 0.0}.get(t.fill, t.ne[0] ** -0.5)
            fill = "bias" if t.fill == "conv" else t.fill
            if t.fill == "weight":  # F32 router and shared-expert gate: random matrices
                fill = "bias"
            plans.append(TensorPlan(t.name, BY_NAME["F32"], t.ne, fill, scale))
        else:
            plans.append(TensorPlan(t.name, type_for(spec, t.role, layer), t.ne, "weight", t.ne[0] ** -0.5, t.role))
    return plans
