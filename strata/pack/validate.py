"""Checks the model code runs against a pack, with one-line errors naming the culprit."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from strata.errors import StrataError


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def check_shape(pack, name: str, expected_ne: tuple[int, ...]):
    """The tensor (ggml order shape) must match what the metadata implies; returns it."""
    info = pack.tensor(name)
    if tuple(info.shape) != tuple(int(d) for d in expected_ne):
        raise StrataError(
            f"pack {pack.label}: tensor {name} has shape {_fmt(info.shape)} "
            f"but the metadata implies {_fmt(expected_ne)}"
        )
    return info


def check_arch(arch: str | None, supported: Iterable[str]) -> str:
    supported = list(supported)
    if arch not in supported:
        raise StrataError(f"unsupported architecture {arch!r} (supported: {', '.join(supported)})")
    return arch


@dataclass(frozen=True)
class Expected:
    name: str
    shape: tuple[int, ...]  # ggml order
    required: bool = True


def model_tensors(cfg) -> Iterator[Expected]:
    """Every tensor strata.model.transformer reads for `cfg`, with the shape the metadata implies.

    Kept beside the model's own reads so that a pack is refused at load, with the pack's name, for
    any tensor the first window would otherwise trip over (an output head or a bias of the wrong
    length loads fine and fails only when multiplied)."""
    if cfg.hybrid is not None:  # the family's own table (strata/model/hybrid/tensors.py), main stack
        from strata.model.hybrid.tensors import model_tensors as hybrid_tensors

        for t in hybrid_tensors(cfg, nextn=False):
            yield Expected(t.name, t.ne, t.required)
        return
    E, D, V = cfg.n_embd, cfg.head_dim, cfg.vocab_size
    yield Expected("token_embd.weight", (E, V))
    yield Expected("output_norm.weight", (E,))
    yield Expected("output.weight", (E, V), required=False)  # absent: tied to token_embd
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        yield from (
            Expected(p + "attn_norm.weight", (E,)),
            Expected(p + "attn_q.weight", (E, cfg.q_dim)),
            Expected(p + "attn_k.weight", (E, cfg.kv_dim)),
            Expected(p + "attn_v.weight", (E, cfg.kv_dim)),
            Expected(p + "attn_output.weight", (cfg.q_dim, E)),
            Expected(p + "attn_q.bias", (cfg.q_dim,), required=False),
            Expected(p + "attn_k.bias", (cfg.kv_dim,), required=False),
            Expected(p + "attn_v.bias", (cfg.kv_dim,), required=False),
            Expected(p + "ffn_norm.weight", (E,)),
        )
        if cfg.traits.qk_norm:
            yield Expected(p + "attn_q_norm.weight", (D,))
            yield Expected(p + "attn_k_norm.weight", (D,))
        if cfg.traits.moe:
            X, F = cfg.n_expert, cfg.expert_ff
            yield from (
                Expected(p + "ffn_gate_inp.weight", (E, X)),
                Expected(p + "ffn_gate_exps.weight", (E, F, X)),
                Expected(p + "ffn_up_exps.weight", (E, F, X)),
                Expected(p + "ffn_down_exps.weight", (F, E, X)),
            )
        else:
            yield from (
                Expected(p + "ffn_gate.weight", (E, cfg.n_ff)),
                Expected(p + "ffn_up.weight", (E, cfg.n_ff)),
                Expected(p + "ffn_down.weight", (cfg.n_ff, E)),
            )


def check_tensors(pack, cfg) -> None:
    """Each tensor the model reads is present (unless optional) with the shape `cfg` implies."""
    for t in model_tensors(cfg):
        if t.required or pack.has(t.name):
            check_shape(pack, t.name, t.shape)
