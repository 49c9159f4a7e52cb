"""An independent float64 recomputation of the decoder (llama / qwen2 / qwen3 / qwen3moe).

Written separately from strata.model and strata.gguf: a small GGUF parser of its own (the
`gguf` package's GGUFReader refuses files with Q2_0 and is slow on a 49k vocabulary), the
`gguf` package's dequantizers for every type it knows, strata's dequantizer only for types
it lacks (Q2_0, id 42). Every step is plain float64 numpy over the whole sequence, RoPE is
written in complex-number form, attention is a full causal softmax per head. Weights are
dequantized when the forward pass reaches them and dropped after, so a 135M-weight model
never sits in memory as float64 all at once. Used as the test oracle.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

# GGUF metadata value types: id -> struct format of a scalar (8 = string, 9 = array)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_F32, _F16, _BF16 = 0, 1, 30
_GGUF_LACKS = {42}  # Q2_0: decoded with strata.kernels.dequant


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self):
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            inner, n = self.unpack("<I"), self.unpack("<Q")
            if inner in _SCALAR and inner != 8:  # skip big numeric arrays (token types, scores) fast
                size = struct.calcsize(_SCALAR[inner])
                arr = np.frombuffer(self.buf, dtype=np.dtype(_SCALAR[inner]), count=n, offset=self.pos)
                self.pos += n * size
                return arr
            return [self.value(inner) for _ in range(n)]
        return self.unpack(_SCALAR[vtype])


class RawTensor:
    """One tensor's raw blocks (uint8) and shape in numpy order."""

    def __init__(self, name, type_id, ne, data):
        self.name, self.type_id, self.data = name, type_id, data
        self.shape = tuple(int(x) for x in reversed(ne))


def read_gguf(path):
    """(metadata without tokenizer.*, {name: RawTensor}) from one GGUF file."""
    f = open(path, "rb")
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    f.close()
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    cur.pos = 4
    cur.unpack("<I")  # version (v3 assumed: 64-bit counts)
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    md = {}
    for _ in range(n_kv):
        key = cur.string()
        val = cur.value(cur.unpack("<I"))
        if not key.startswith("tokenizer."):
            md[key] = val
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        ne = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        type_id, off = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((name, ne, type_id, off))
    align = int(md.get("general.alignment", 32))
    base = (cur.pos + align - 1) // align * align
    whole = np.frombuffer(buf, dtype=np.uint8)
    ends = sorted(off for _, _, _, off in infos)[1:] + [len(buf) - base]
    end_of = dict(zip(sorted(off for _, _, _, off in infos), ends))
    tensors = {}
    for name, ne, type_id, off in infos:
        tensors[name] = RawTensor(name, type_id, ne, whole[base + off : base + end_of[off]])
    return md, tensors


def dequantize(t: RawTensor) -> np.ndarray:
    """float64 array in numpy order."""
    n = int(np.prod(t.shape))
    if t.type_id == _F32:
        flat = t.data[: 4 * n].view(np.float32)
    elif t.type_id == _F16:
        flat = t.data[: 2 * n].view(np.float16)
    elif t.type_id == _BF16:
        flat = (t.data[: 2 * n].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif t.type_id in _GGUF_LACKS:
        from strata.kernels.dequant import dequantize as strata_dequantize
        from strata.kernels.ggml_types import type_by_id

        flat = strata_dequantize(t.type_id, t.data[: type_by_id(t.type_id).nbytes(n)], n)
    else:
        import gguf

        qtype = gguf.GGMLQuantizationType(t.type_id)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        flat = gguf.quants.dequantize(t.data[: n // block * size], qtype)
    return np.asarray(flat, dtype=np.float64).reshape(t.shape)


class LazyWeights:
    """Mapping name -> float64 weights, dequantized on access (1-D tensors are kept)."""

    def __init__(self, raw):
        self.raw = raw
        self._small = {}

    def __contains__(self, name):
        return name in self.raw

    def __getitem__(self, name):
        t = self.raw[name]
        if len(t.shape) == 1:
            if name not in self._small:
                self._small[name] = dequantize(t)
            return self._small[name]
        return dequantize(t)

    def get(self, name, default=None):
        return self[name] if name in self.raw else default


def load(path):
    """(metadata, LazyWeights) for a single-file GGUF model."""
    md, raw = read_gguf(Path(path))
    return md, LazyWeights(raw)


def q8_round(x):
    """Round activations as llama.cpp's CPU matmuls do for quantized weights: per 32 values,
    d = amax / 127 (stored as f16), q = round(x / d), value q * d."""
    shp = x.shape
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = amax / 127.0
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    q = np.sign(b) * np.floor(np.abs(b.astype(np.float32) * inv.astype(np.float32)) + 0.5)
    return (q * d.astype(np.float16).astype(np.float64)).reshape(shp)


def _matmul(W, name, h, act_round):
    t = W.raw[name] if isinstance(W, LazyWeights) else None
    if act_round == "q8" and t is not None and t.type_id not in (_F32, _F16, _BF16):
        h = q8_round(h)
    return h @ W[name].T


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_complex(x, pos, base, dim, neox):
    """x (T, H, D): rotate with complex multiplication; NORM pairs (2i,2i+1), NEOX pairs (i, i+dim/2)."""
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


def forward(md, W, tokens, arch=None, arch_neox=None, kv_round=None, act_round=None):
    """Logits (T, vocab) for the whole token sequence, float64.

    kv_round: None keeps K and V in float64; "f16" rounds them (after RoPE) to float16 as an
    f16 KV cache stores them, the one rounding an exact engine with such a cache must share.
    act_round: "q8" rounds the input of every quantized matmul to Q8_0 blocks (what
    llama.cpp's CPU kernels do), to tell its rounding apart from a real disagreement.
    """
    mm = lambda name, h: _matmul(W, name, h, act_round)  # noqa: E731
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
        q = mm(p + "attn_q.weight", h)
        k = mm(p + "attn_k.weight", h)
        v = mm(p + "attn_v.weight", h)
        if p + "attn_q.bias" in W:
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        if p + "attn_q_norm.weight" in W:
            q = rms(q, W[p + "attn_q_norm.weight"], eps)
            k = rms(k, W[p + "attn_k_norm.weight"], eps)
        q, k = rope_complex(q, pos, base, hd, neox), rope_complex(k, pos, base, hd, neox)
        if kv_round == "f16":
            k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
        att = np.zeros((T, nh, hd))
        for hh in range(nh):
            kv = hh * nkv // nh
            s = q[:, hh] @ k[:, kv].T / np.sqrt(hd)
            s[np.triu_indices(T, 1)] = -np.inf
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            att[:, hh] = s @ v[:, kv]
        x = x + mm(p + "attn_output.weight", att.reshape(T, nh * hd))
        h = rms(x, W[p + "ffn_norm.weight"], eps)
        if p + "ffn_gate_inp.weight" in W:
            x = x + _moe(md, a, W, p, h)
        else:
            g = mm(p + "ffn_gate.weight", h)
            u = mm(p + "ffn_up.weight", h)
            x = x + mm(p + "ffn_down.weight", g / (1 + np.exp(-g)) * u)
    x = rms(x, W["output_norm.weight"], eps)
    return mm("output.weight" if "output.weight" in W else "token_embd.weight", x)


def _moe(md, a, W, p, h):
    k = int(md[f"{a}.expert_used_count"])
    norm = bool(md.get(f"{a}.expert_weights_norm", a == "qwen3moe"))
    gate, up, down = W[p + "ffn_gate_exps.weight"], W[p + "ffn_up_exps.weight"], W[p + "ffn_down_exps.weight"]
    logits = h @ W[p + "ffn_gate_inp.weight"].T
    pr = np.exp(logits - logits.max(axis=1, keepdims=True))
    pr /= pr.sum(axis=1, keepdims=True)
    y = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-pr[t], kind="stable")[:k]
        w = pr[t, top] / (pr[t, top].sum() if norm else 1.0)
        for e, we in zip(top, w):
            g = gate[e] @ h[t]
            u = up[e] @ h[t]
            y[t] += we * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return y
