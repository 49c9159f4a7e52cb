"""An independent float64 recomputation of the decoder (llama / qwen2 / qwen3 / qwen3moe).

Written separately from strata.model: weights come from the `gguf` package's reader and
dequantizers where it knows the type (strata's own dequantizer only for Q2_0, which gguf
lacks), every step is plain float64 numpy over the whole sequence, RoPE is written in
complex-number form, attention is a full causal softmax per head. Used as the test oracle.
"""

from __future__ import annotations

import numpy as np


def _gguf_tensors(path):
    import gguf

    r = gguf.GGUFReader(path)
    out = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        out[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)
    md = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer."):
            continue
        try:
            md[k] = f.contents()
        except Exception:
            pass
    return md, out


def load(path, tensors=None, md=None):
    """(metadata, {name: float64 array in numpy order}) from a GGUF file (gguf package)."""
    if tensors is None:
        md, tensors = _gguf_tensors(path)
    return md, tensors


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_complex(x, pos, base, dim, neox):
    """x (T, H, D): rotate with complex multiplication; NORM pairs (2i,2i+1), NEOX pairs (i, i+dim/2)."""
    T, H, D = x.shape
    half = dim // 2
    freqs = base ** (-np.arange(half) * 2.0 / dim)
    rot = np.exp(1j * np.outer(pos, freqs))[:, None, :]  # (T,1,half)
    out = x.copy()
    if neox:
        z = (x[..., :half] + 1j * x[..., half:dim]) * rot
        out[..., :half], out[..., half:dim] = z.real, z.imag
    else:
        z = (x[..., 0:dim:2] + 1j * x[..., 1:dim:2]) * rot
        out[..., 0:dim:2], out[..., 1:dim:2] = z.real, z.imag
    return out


def forward(md, W, tokens, arch=None, arch_neox=None):
    """Logits (T, vocab) for the whole token sequence, float64."""
    a = arch or md["general.architecture"]
    L = int(md[f"{a}.block_count"])
    nh = int(md[f"{a}.attention.head_count"])
    nkv = int(md.get(f"{a}.attention.head_count_kv", nh))
    E = int(md[f"{a}.embedding_length"])
    hd = int(md.get(f"{a}.attention.key_length", E // nh))
    eps = float(md[f"{a}.attention.layer_norm_rms_epsilon"])
    base = float(md.get(f"{a}.rope.freq_base", 10000.0))
    neox = (a != "llama") if arch_neox is None else arch_neox
    T = len(tokens)
    pos = np.arange(T)
    x = W["token_embd.weight"][np.asarray(tokens)]
    for i in range(L):
        p = f"blk.{i}."
        h = rms(x, W[p + "attn_norm.weight"], eps)
        q = h @ W[p + "attn_q.weight"].T
        k = h @ W[p + "attn_k.weight"].T
        v = h @ W[p + "attn_v.weight"].T
        if p + "attn_q.bias" in W:
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        if p + "attn_q_norm.weight" in W:
            q = rms(q, W[p + "attn_q_norm.weight"], eps)
            k = rms(k, W[p + "attn_k_norm.weight"], eps)
        q, k = rope_complex(q, pos, base, hd, neox), rope_complex(k, pos, base, hd, neox)
        att = np.zeros((T, nh, hd))
        for hh in range(nh):
            kv = hh * nkv // nh
            s = q[:, hh] @ k[:, kv].T / np.sqrt(hd)
            s[np.triu_indices(T, 1)] = -np.inf
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            att[:, hh] = s @ v[:, kv]
        x = x + att.reshape(T, nh * hd) @ W[p + "attn_output.weight"].T
        h = rms(x, W[p + "ffn_norm.weight"], eps)
        if p + "ffn_gate_inp.weight" in W:
            x = x + _moe(md, a, W, p, h)
        else:
            g = h @ W[p + "ffn_gate.weight"].T
            u = h @ W[p + "ffn_up.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    x = rms(x, W["output_norm.weight"], eps)
    out = W.get("output.weight", W["token_embd.weight"])
    return x @ out.T


def _moe(md, a, W, p, h):
    k = int(md[f"{a}.expert_used_count"])
    norm = bool(md.get(f"{a}.expert_weights_norm", a == "qwen3moe"))
    logits = h @ W[p + "ffn_gate_inp.weight"].T
    pr = np.exp(logits - logits.max(axis=1, keepdims=True))
    pr /= pr.sum(axis=1, keepdims=True)
    y = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-pr[t], kind="stable")[:k]
        w = pr[t, top] / (pr[t, top].sum() if norm else 1.0)
        for e, we in zip(top, w):
            g = W[p + "ffn_gate_exps.weight"][e] @ h[t]
            u = W[p + "ffn_up_exps.weight"][e] @ h[t]
            y[t] += we * (W[p + "ffn_down_exps.weight"][e] @ (g / (1 + np.exp(-g)) * u))
    return y
