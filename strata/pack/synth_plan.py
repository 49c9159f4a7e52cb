"""What a synthetic pack holds: every tensor of its architecture's table (strata/model/archs/,
the one the loader checks), each with the type its role's plan gives, and every flag problem as
one line before a byte is written."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from math import prod

from strata.errors import StrataError
from strata.kernels.ggml_types import BY_NAME, GGMLType
from strata.model.archs import ARCHS, SUPPORTED_ARCHS, model_tensors
from strata.model.config import ModelConfig, config_from_metadata
from strata.model.layers.delta_net import INPUT_FORMS
from strata.model.layers.tensors import TensorSpec
from strata.pack.presets import SynthSpec
from strata.pack.synth_metadata import arch_metadata

DEFAULT_TYPE = "Q8_0"  # for roles a plan leaves out: its 32-weight block fits every row here
U32_MAX = 2**32 - 1
# SynthSpec fields whose flag is not "--" + the field's name
FIELD_FLAGS = {"n_layer": "--layers", "n_head": "--heads", "n_head_kv": "--kv-heads"}
MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS: a pack with more is no model anything loads


@dataclass(frozen=True)
class TensorPlan:
    name: str
    gtype: GGMLType
    ne: tuple[int, ...]
    fill: str  # "weight" | "norm" | "bias" | "ssm_a"
    scale: float
    role: str | None = None  # the --type role that chose gtype (None for fixed F32 tensors)

    @property
    def nbytes(self) -> int:
        return self.gtype.nbytes(prod(self.ne))  # a Python int: no int64 wrap for absurd shapes


def type_for(spec: SynthSpec, role: str, layer: int) -> GGMLType:
    value = spec.types.get(role, DEFAULT_TYPE)
    choices = value.split("/")
    name = choices[layer % len(choices)].strip().upper()
    if name not in BY_NAME:
        raise StrataError(f"--type {role}={value}: unknown type {name} (known: {', '.join(BY_NAME)})")
    return BY_NAME[name]


def _plan(spec: SynthSpec, t: TensorSpec, role: str | None = None) -> TensorPlan:
    """role: in place of the table's (a draft file's eh_proj)."""
    role = role or t.role
    scale = t.scale if t.scale is not None else t.ne[0] ** -0.5  # keeps a random matmul's outputs near unit size
    if role is None:
        return TensorPlan(t.name, BY_NAME["F32"], t.ne, t.fill, scale)
    layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
    return TensorPlan(t.name, type_for(spec, role, layer), t.ne, "weight", scale, role)


def with_delta_net_input(spec: SynthSpec, form: str) -> SynthSpec:
    """spec with its DeltaNet input projection in `form` (INPUT_FORMS: "split" attn_qkv +
    attn_gate, or "fused" ssm_in as earlier converters wrote it, where the architecture reads it)."""
    out = replace(spec, delta_net_input=form)
    _check_delta_net_input(out)
    return out


def _check_delta_net_input(spec: SynthSpec) -> None:
    form = spec.delta_net_input
    if form not in INPUT_FORMS:
        raise StrataError(f"--delta-net-input {form}: unknown (known: {', '.join(INPUT_FORMS)})")
    arch = ARCHS.get(spec.arch)
    if form == "fused" and not (arch and arch.delta_net and arch.delta_net.fused_qkvz):
        readers = [a for a, s in ARCHS.items() if s.delta_net and s.delta_net.fused_qkvz]
        raise StrataError(f"--delta-net-input fused: only {', '.join(readers)} packs hold a fused ssm_in, "
                          f"not --arch {spec.arch}")


def spec_config(spec: SynthSpec) -> ModelConfig:
    """The ModelConfig a pack of this spec (with its nextn layers) reads as."""
    md = {k: v for k, v, _ in arch_metadata(spec, nextn=True)}
    md.update({"general.architecture": spec.arch, "tokenizer.ggml.model": "gpt2",
               "tokenizer.ggml.tokens": [""] * spec.vocab})
    return config_from_metadata(md, label="synth")


def _plans(spec: SynthSpec, tables: list[TensorSpec]) -> list[TensorPlan]:
    form = spec.delta_net_input
    return [_plan(spec, t) for t in tables
            if t.synth and t.form in (None, form) and not (t.name == "output.weight" and spec.tied_output)]


def plan_tensors(spec: SynthSpec, *, trunk: bool = True, nextn: bool = True) -> list[TensorPlan]:
    """Every tensor of the model (main stack, nextn layers or both), in llama.cpp's conversion order."""
    check_flags(spec)
    return _plans(spec, model_tensors(ARCHS[spec.arch], spec_config(spec), trunk=trunk,
                                      nextn=nextn and spec.nextn > 0))


def mtp_tensors(spec: SynthSpec) -> list[TensorPlan]:
    """A strata-mtp draft file (docs/MTP.md): input norms, eh_proj, one block of the target's
    shape named mtp.blk.*, its head norm."""
    check_flags(spec)
    cfg = spec_config(spec)
    e = spec.n_embd
    norm = lambda name: TensorSpec(name, (e,), fill="norm", scale=0.02)  # noqa: E731
    return [
        _plan(spec, norm("mtp.enorm.weight")),
        _plan(spec, norm("mtp.hnorm.weight")),
        _plan(spec, TensorSpec("mtp.eh_proj.weight", (2 * e, e)), role="attn_q"),
        *_plans(spec, ARCHS[spec.arch].block_tensors(cfg, "mtp.blk.", 0)),
        _plan(spec, norm("mtp.output_norm.weight")),
    ]


def _check_delta_net(spec: SynthSpec) -> None:
    for flag, value in (("--ssm-state", spec.ssm_state), ("--ssm-groups", spec.ssm_groups),
                        ("--ssm-heads", spec.ssm_heads)):
        if value <= 0:
            raise StrataError(f"{flag} {value}: must be > 0 for --arch {spec.arch}")
    if spec.ssm_heads % spec.ssm_groups:
        raise StrataError(f"--ssm-heads {spec.ssm_heads} is not a multiple of --ssm-groups {spec.ssm_groups}")
    if ARCHS[spec.arch].shared_expert and spec.shexp_ff <= 0:
        raise StrataError(f"--shexp-ff {spec.shexp_ff}: must be > 0 for --arch {spec.arch}")
    _check_delta_net_input(spec)


def check_flags(spec: SynthSpec) -> None:
    """Every flag problem of the spec itself as one line."""
    if spec.arch not in SUPPORTED_ARCHS:
        raise StrataError(f"--arch {spec.arch}: unsupported (supported: {', '.join(SUPPORTED_ARCHS)})")
    if spec.is_hybrid:
        _check_delta_net(spec)
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


def check_spec(spec: SynthSpec, plans: list[TensorPlan]) -> None:
    """Every flag problem as one line before a byte is written: the spec's, then each tensor's
    type against its rows."""
    check_flags(spec)
    for p in plans:
        if p.ne[0] % p.gtype.block_size:
            raise StrataError(
                f"type {p.gtype.name} for role {p.role} (--type {p.role}={spec.types.get(p.role, DEFAULT_TYPE)}) "
                f"does not fit: {p.name} rows have {p.ne[0]} weights, not a multiple of its "
                f"{p.gtype.block_size}-weight blocks"
            )
