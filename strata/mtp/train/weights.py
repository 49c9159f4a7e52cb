"""The draft's frozen tables and starting weights, read from the target (or from an earlier draft).

The shared embedding and output head stay frozen; the block starts as the target's last layer,
so the draft works from step 0 (`initial_weights`), or as an existing draft's (`--init`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata.backend.cpu_layout import dequantize_source
from strata.errors import StrataError
from strata.gguf.reader import GGUFFile
from strata.model.transformer import Span
from strata.mtp.draft import VOCAB_TENSOR


def frozen_tables(core) -> tuple[np.ndarray, np.ndarray]:
    """The target's embedding and output head (vocab, E) float32 on the host, from the pack (either
    backend); one array when the head is tied to the embedding."""
    m = core.model
    if isinstance(m.embd, np.ndarray) and m.embd.dtype == np.float32:  # the CPU backend's dequantized table
        embed = m.embd
    else:
        embed = np.ascontiguousarray(dequantize_source(m.embd_source), np.float32)
    if m.output_source is m.embd_source:
        return embed, embed
    return embed, np.ascontiguousarray(dequantize_source(m.output_source), np.float32)


def initial_weights(core) -> dict[str, np.ndarray]:
    """The target's last block (dequantized) + eh_proj that passes hnorm(h) through.

    With eh_proj = [0.1 I | I] the draft starts as "the last layer applied to the hidden
    state, nudged by the next token's embedding": a working model from step 0.
    """
    cfg = core.cfg
    last = f"blk.{cfg.n_layer - 1}."
    roles = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    if cfg.traits.qk_norm:
        roles += ["attn_q_norm", "attn_k_norm"]
    if cfg.traits.moe or core.pack.tensors.get(last + "ffn_gate.weight") is None:
        raise StrataError(f"strata mtp train: {cfg.arch} packs with routed experts are not supported yet "
                          f"(the draft block is a dense FFN initialised from the last layer)")
    w = {r: dequantize_source(core.pack.tensors[last + r + ".weight"]).astype(np.float32) for r in roles}
    E = cfg.n_embd
    eye = np.eye(E, dtype=np.float32)
    w_out = np.asarray(core.backend.to_host(core.model.output_norm), np.float32)
    w["eh_proj"] = np.concatenate([0.1 * eye, eye], axis=1)  # (E, 2E): [embedding part | hidden part]
    w["enorm"] = np.ones(E, np.float32)
    w["hnorm"] = _unnorm_gain(core, w_out)
    w["output_norm"] = w_out.copy()
    return w


def draft_weights(path: str) -> dict[str, np.ndarray]:
    """role -> float32 array of an existing draft GGUF (dequantized), to continue training it."""
    if not Path(path).is_file():
        raise StrataError(f"--init {path}: no such file")
    f = GGUFFile(path)
    try:
        if "mtp.eh_proj.weight" not in f.tensors:
            raise StrataError(f"--init {path}: not an MTP draft (mtp.eh_proj.weight is missing)")
        return {name.removeprefix("mtp.").removeprefix("blk.").removesuffix(".weight"):
                dequantize_source(t).astype(np.float32) for name, t in f.tensors.items()
                if name != VOCAB_TENSOR}  # a vocabulary is no weight: --draft-vocab makes a new one
    finally:
        f.close()


def _unnorm_gain(core, w_out: np.ndarray) -> np.ndarray:
    """hnorm gain that maps rmsnorm(h) back to the scale of the residual stream it came from.

    h = rmsnorm(r) * w_out, so r ~ rmsnorm(h) * rms(h) * rms(r) / w_out. The last layer's
    weights expect r's scale; feeding them unit-RMS inputs would make the block's own updates
    swamp its input. rms(r) and rms(h) come from one short forward of the target.
    """
    m, b = core.model, core.backend
    toks = np.asarray(core.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4, add_special=True))
    cache = m.new_cache(len(toks), "f16")
    span = Span(cache, 0, len(toks))
    cache.ensure(len(toks))
    x = b.embed(m.embd, toks)
    x, y = m.run_blocks(x, [span])
    x = x + y
    r = np.asarray(b.to_host(x), np.float64)
    h = np.asarray(b.to_host(b.rms_norm(x, m.output_norm, core.cfg.rms_eps)), np.float64)
    rms = lambda a: float(np.sqrt((a * a).mean(-1)).mean())  # noqa: E731
    floor = 0.05 * float(np.abs(w_out).mean())  # tiny output-norm gains would blow up
    safe = np.where(np.abs(w_out) < floor, np.copysign(floor, w_out + 1e-30), w_out)
    return (rms(h) * rms(r) / safe).astype(np.float32)
