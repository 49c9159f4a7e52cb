"""Every tensor of the hybrid family, named and shaped as llama.cpp's converters write them: the
one table that the loader's shape check, the layers and `strata pack synth` read.

Shapes are ggml order (ne0, the row length, first). `role` is the synth type role that picks a
tensor's type (`--type ROLE=TYPE`); None keeps it F32 (norms, gates, the conv kernel, ssm_a).
`fill` says how synth fills it (strata/pack/synth.py). A DeltaNet layer's input projection comes
in one of INPUT_FORMS (`form`): the layers take the first form a pack holds whole, synth writes
the one it is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.model.config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]
    role: str | None = None  # synth type role (None: F32)
    fill: str = "weight"  # weight | norm | bias | ssm_a | conv
    required: bool = True  # False: an alternative form may stand in (the loader says which)
    form: str | None = None  # the DeltaNet input form it belongs to (INPUT_FORMS); None: any pack


# A DeltaNet input projection: "split" attn_qkv + attn_gate (today's converters), or "fused" one
# ssm_in holding q, k, v and z per key group (earlier qwen3next converters; fused_qkvz.py has the
# layout). llama.cpp's qwen3next.cpp reads either, the split one first.
INPUT_FORMS = ("split", "fused")


def _attention(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    """A gated full-attention layer: q carries a gate per head ([q | gate], 2 x head_dim)."""
    E, D = cfg.n_embd, cfg.head_dim
    q2, kv = 2 * cfg.q_dim, cfg.kv_dim
    return [
        # attn_qkv.weight (E, q2 + 2 kv) may replace the three (llama.cpp's create_tensor_qkv)
        TensorSpec(p + "attn_q.weight", (E, q2), "attn_q", required=False),
        TensorSpec(p + "attn_k.weight", (E, kv), "attn_k", required=False),
        TensorSpec(p + "attn_v.weight", (E, kv), "attn_v", required=False),
        TensorSpec(p + "attn_output.weight", (cfg.q_dim, E), "attn_output"),
        TensorSpec(p + "attn_q_norm.weight", (D,), fill="norm"),
        TensorSpec(p + "attn_k_norm.weight", (D,), fill="norm"),
    ]


def _delta_net_input(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    h = cfg.hybrid
    E = cfg.n_embd
    out = [TensorSpec(p + "attn_qkv.weight", (E, h.conv_dim), "ssm_in", required=False, form="split"),
           TensorSpec(p + "attn_gate.weight", (E, h.value_dim), "ssm_in", required=False, form="split")]
    if h.traits.fused_qkvz:
        out.append(TensorSpec(p + "ssm_in.weight", (E, h.conv_dim + h.value_dim), "ssm_in", required=False,
                              form="fused"))
    return out


def input_forms(cfg: ModelConfig, p: str) -> dict[str, list[TensorSpec]]:
    """The input projection forms a DeltaNet layer (prefix p) may hold, in the order tried."""
    out: dict[str, list[TensorSpec]] = {}
    for t in _delta_net_input(cfg, p):
        out.setdefault(t.form, []).append(t)
    return out


def _delta_net(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    h = cfg.hybrid
    E, H = cfg.n_embd, h.n_v_heads
    out = [
        *_delta_net_input(cfg, p),
        TensorSpec(p + "ssm_conv1d.weight", (h.d_conv, h.conv_dim), fill="conv"),
        TensorSpec(p + "ssm_dt.bias", (H,), fill="bias"),
        TensorSpec(p + "ssm_a", (H,), fill="ssm_a"),
        TensorSpec(p + "ssm_norm.weight", (h.d_state,), fill="norm"),
        TensorSpec(p + "ssm_out.weight", (h.value_dim, E), "ssm_out"),
    ]
    if h.traits.fused_ba:
        out.append(TensorSpec(p + "ssm_ba.weight", (E, 2 * H), "ssm_ba"))
    else:
        out += [TensorSpec(p + "ssm_beta.weight", (E, H), "ssm_ba"),
                TensorSpec(p + "ssm_alpha.weight", (E, H), "ssm_ba")]
    return out


def _ffn(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    E = cfg.n_embd
    if not cfg.hybrid.traits.moe:
        F = cfg.n_ff
        return [TensorSpec(p + "ffn_gate.weight", (E, F), "ffn_gate"),
                TensorSpec(p + "ffn_up.weight", (E, F), "ffn_up"),
                TensorSpec(p + "ffn_down.weight", (F, E), "ffn_down")]
    X, F, S = cfg.n_expert, cfg.expert_ff, cfg.hybrid.shexp_ff
    return [
        TensorSpec(p + "ffn_gate_inp.weight", (E, X), fill="weight"),
        # ffn_gate_up_exps.weight (E, 2F, X) may replace the two (llama.cpp's create_tensor_gate_up_exps)
        TensorSpec(p + "ffn_gate_exps.weight", (E, F, X), "ffn_gate_exps", required=False),
        TensorSpec(p + "ffn_up_exps.weight", (E, F, X), "ffn_up_exps", required=False),
        TensorSpec(p + "ffn_down_exps.weight", (F, E, X), "ffn_down_exps"),
        TensorSpec(p + "ffn_gate_inp_shexp.weight", (E,), fill="weight"),
        TensorSpec(p + "ffn_gate_shexp.weight", (E, S), "ffn_gate_shexp"),
        TensorSpec(p + "ffn_up_shexp.weight", (E, S), "ffn_up_shexp"),
        TensorSpec(p + "ffn_down_shexp.weight", (S, E), "ffn_down_shexp"),
    ]


def layer_tensors(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """A main-stack layer: norms, its mixer (DeltaNet or gated attention), its FFN."""
    p = f"blk.{layer}."
    E = cfg.n_embd
    mixer = _delta_net(cfg, p) if cfg.hybrid.recurrent[layer] else _attention(cfg, p)
    return [TensorSpec(p + "attn_norm.weight", (E,), fill="norm"), *mixer,
            TensorSpec(p + "post_attention_norm.weight", (E,), fill="norm"), *_ffn(cfg, p)]


def nextn_tensors(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    """A nextn (MTP) layer: a gated-attention block with the arch's FFN, and its input and head
    norms. nextn.embed_tokens / shared_head_head are optional (the model's own are shared)."""
    p = f"blk.{layer}."
    E = cfg.n_embd
    return [
        TensorSpec(p + "nextn.eh_proj.weight", (2 * E, E), "nextn_eh_proj"),
        TensorSpec(p + "nextn.enorm.weight", (E,), fill="norm"),
        TensorSpec(p + "nextn.hnorm.weight", (E,), fill="norm"),
        TensorSpec(p + "attn_norm.weight", (E,), fill="norm"),
        *_attention(cfg, p),
        TensorSpec(p + "post_attention_norm.weight", (E,), fill="norm"),
        *_ffn(cfg, p),
        TensorSpec(p + "nextn.shared_head_norm.weight", (E,), fill="norm", required=False),
    ]


def model_tensors(cfg: ModelConfig, *, trunk: bool = True, nextn: bool = True) -> list[TensorSpec]:
    """The whole model in conversion order; an MTP-only file holds the head and the nextn layers."""
    E, V = cfg.n_embd, cfg.vocab_size
    out = [TensorSpec("token_embd.weight", (E, V), "embed")]
    if trunk:
        for i in range(cfg.n_layer):
            out += layer_tensors(cfg, i)
    if nextn:
        for i in range(cfg.n_layer, cfg.n_layer_all):
            out += nextn_tensors(cfg, i)
    out += [TensorSpec("output_norm.weight", (E,), fill="norm"),
            TensorSpec("output.weight", (E, V), "output", required=False)]
    return out
