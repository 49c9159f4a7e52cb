"""An independent float64 recomputation of the hybrid family (qwen35moe, qwen35, qwen3next),
written from llama.cpp's graphs (src/models/qwen35moe.cpp, qwen35.cpp, qwen3next.cpp and
delta-net-base.cpp), not from strata.model: whole-sequence numpy per layer, the delta rule as
its textbook recurrence per head and token, IMRoPE by its per-pair position component, the
conv as an explicit sum. Shares only the GGUF reading and dequantization of reference_model.
Used as the test oracle, and to tell llama.cpp's activation rounding from a real disagreement.
"""

from __future__ import annotations

import numpy as np

from tests.support.reference_model import _matmul, rms


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _l2(x, eps):
    return x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)


def _rope(x, pos, base, n_rot, sections):
    """NEOX pairs (i, i + n_rot/2); with IMRoPE sections a text token's position components are
    (p, p, p, 0) and pair i reads component (i % sum) % 3 while inside that section, else the 4th."""
    half = n_rot // 2
    comp_pos = np.tile(pos[:, None].astype(np.float64), (1, half))
    if sections:
        total = sum(sections)
        for i in range(half):
            s = i % total
            c = s % 3
            if not s < 3 * sections[c]:
                comp_pos[:, i] = 0.0
    theta = comp_pos * base ** (-2.0 * np.arange(half) / n_rot)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    a, b = x[..., :half], x[..., half:n_rot]
    out[..., :half] = a * cos - b * sin
    out[..., half:n_rot] = a * sin + b * cos
    return out


class _Hp:
    def __init__(self, md):
        a = self.arch = md["general.architecture"]
        g = lambda k, d=None: md.get(f"{a}.{k}", d)  # noqa: E731
        self.n_nextn = int(g("nextn_predict_layers", 0))
        self.L = int(g("block_count")) - self.n_nextn
        self.E = int(g("embedding_length"))
        self.nh = int(g("attention.head_count"))
        self.nkv = int(g("attention.head_count_kv", self.nh))
        self.hd = int(g("attention.key_length", self.E // self.nh))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.base = float(g("rope.freq_base", 10000.0))
        self.n_rot = int(g("rope.dimension_count", self.hd))
        self.sections = tuple(int(s) for s in g("rope.dimension_sections", ())) if a != "qwen3next" else ()
        self.K = int(g("ssm.conv_kernel"))
        self.S = int(g("ssm.state_size"))
        self.Hk = int(g("ssm.group_count"))
        self.Hv = int(g("ssm.time_step_rank"))
        every = int(g("full_attention_interval", 4))
        self.recurrent = [(i + 1) % every != 0 for i in range(self.L)]
        self.n_used = int(g("expert_used_count", 0))


def _attention(hp, W, mm, p, h, pos, kv_round):
    T, nh, nkv, hd = h.shape[0], hp.nh, hp.nkv, hp.hd
    if p + "attn_qkv.weight" in W:
        qkv = mm(p + "attn_qkv.weight", h)
        qg, k, v = np.split(qkv, [2 * nh * hd, 2 * nh * hd + nkv * hd], axis=1)
    else:
        qg, k, v = mm(p + "attn_q.weight", h), mm(p + "attn_k.weight", h), mm(p + "attn_v.weight", h)
    qg = qg.reshape(T, nh, 2 * hd)
    q, gate = qg[:, :, :hd], qg[:, :, hd:].reshape(T, nh * hd)
    q = rms(q, W[p + "attn_q_norm.weight"], hp.eps)
    k = rms(k.reshape(T, nkv, hd), W[p + "attn_k_norm.weight"], hp.eps)
    v = v.reshape(T, nkv, hd)
    q, k = _rope(q, pos, hp.base, hp.n_rot, hp.sections), _rope(k, pos, hp.base, hp.n_rot, hp.sections)
    if kv_round == "f16":
        k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
    att = np.zeros((T, nh, hd))
    for hh in range(nh):
        kv = hh // (nh // nkv)
        s = q[:, hh] @ k[:, kv].T / np.sqrt(hd)
        s[np.triu_indices(T, 1)] = -np.inf
        s = np.exp(s - s.max(axis=1, keepdims=True))
        att[:, hh] = (s / s.sum(axis=1, keepdims=True)) @ v[:, kv]
    return mm(p + "attn_output.weight", att.reshape(T, nh * hd) * _sigmoid(gate))


def _qkv_and_z(hp, W, mm, p, h):
    """The conv input (T, 2Kd + Vd) and the output gate z (T, Hv, S). A fused ssm_in (qwen3next
    packs of earlier converters) is, per token, Hk key groups of [q (S) | k (S) | v (rS) | z (rS)]
    (qwen3next.cpp's build_qkvz): the conv input is every group's q, then k, then v."""
    T, S, Hk, Hv = h.shape[0], hp.S, hp.Hk, hp.Hv
    if p + "attn_qkv.weight" in W:
        return mm(p + "attn_qkv.weight", h), mm(p + "attn_gate.weight", h).reshape(T, Hv, S)
    r = Hv // Hk
    groups = mm(p + "ssm_in.weight", h).reshape(T, Hk, 2 * S + 2 * r * S)
    q, k, v, z = np.split(groups, [S, 2 * S, 2 * S + r * S], axis=2)
    qkv = np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=1)
    return qkv, z.reshape(T, Hv, S)


def _delta_net(hp, W, mm, p, h):
    T, S, Hk, Hv, K = h.shape[0], hp.S, hp.Hk, hp.Hv, hp.K
    Kd, Vd = S * Hk, S * Hv
    qkv, z = _qkv_and_z(hp, W, mm, p, h)  # (T, 2Kd + Vd), (T, Hv, S)
    r = Hv // Hk
    if p + "ssm_ba.weight" in W:  # qwen3next: per key group [b(r) | a(r)], value head g*r + i
        ba = mm(p + "ssm_ba.weight", h).reshape(T, Hk, 2 * r)
        b, a = ba[:, :, :r].reshape(T, Hv), ba[:, :, r:].reshape(T, Hv)
        key_of = [j // r for j in range(Hv)]
    else:
        b, a = mm(p + "ssm_beta.weight", h), mm(p + "ssm_alpha.weight", h)
        key_of = [j % Hk for j in range(Hv)]
    beta = _sigmoid(b)
    g = _softplus(a + W[p + "ssm_dt.bias"]) * W[p + "ssm_a"]
    w = W[p + "ssm_conv1d.weight"]  # (C, K)
    padded = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv], axis=0)
    conv = np.zeros_like(qkv)
    for t in range(T):
        for j in range(K):
            conv[t] += padded[t + j] * w[:, j]
    conv = _silu(conv)
    q = _l2(conv[:, :Kd].reshape(T, Hk, S), hp.eps)
    k = _l2(conv[:, Kd : 2 * Kd].reshape(T, Hk, S), hp.eps)
    v = conv[:, 2 * Kd :].reshape(T, Hv, S)
    o = np.zeros((T, Hv, S))
    for j in range(Hv):
        St = np.zeros((S, S))  # St[v_index, k_index]
        kh = key_of[j]
        for t in range(T):
            St = St * np.exp(g[t, j])
            delta = beta[t, j] * (v[t, j] - St @ k[t, kh])
            St = St + np.outer(delta, k[t, kh])
            o[t, j] = St @ q[t, kh] / np.sqrt(S)
    y = rms(o, W[p + "ssm_norm.weight"], hp.eps) * _silu(z)
    return mm(p + "ssm_out.weight", y.reshape(T, Vd))


def _ffn(hp, W, mm, p, h):
    if p + "ffn_gate_inp.weight" not in W:
        return mm(p + "ffn_down.weight", _silu(mm(p + "ffn_gate.weight", h)) * mm(p + "ffn_up.weight", h))
    logits = h @ W[p + "ffn_gate_inp.weight"].T
    pr = np.exp(logits - logits.max(axis=1, keepdims=True))
    pr /= pr.sum(axis=1, keepdims=True)
    gate, up, down = W[p + "ffn_gate_exps.weight"], W[p + "ffn_up_exps.weight"], W[p + "ffn_down_exps.weight"]
    y = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-pr[t], kind="stable")[: hp.n_used]
        wt = pr[t, top] / max(pr[t, top].sum(), 6.103515625e-5)
        for e, we in zip(top, wt):
            y[t] += we * (down[e] @ (_silu(gate[e] @ h[t]) * (up[e] @ h[t])))
    shared = mm(p + "ffn_down_shexp.weight", _silu(mm(p + "ffn_gate_shexp.weight", h)) * mm(p + "ffn_up_shexp.weight", h))
    return y + shared * _sigmoid(h @ W[p + "ffn_gate_inp_shexp.weight"])[:, None]


def forward(md, W, tokens, kv_round=None, act_round=None, with_hidden=False):
    """Logits (T, vocab) of the main stack, float64; with_hidden also the final-normed hidden
    states (the MTP head's input). kv_round / act_round: as reference_model.forward."""
    mm = lambda name, h: _matmul(W, name, h, act_round)  # noqa: E731
    hp = _Hp(md)
    T = len(tokens)
    pos = np.arange(T)
    x = W["token_embd.weight"][np.asarray(tokens)]
    for i in range(hp.L):
        p = f"blk.{i}."
        h = rms(x, W[p + "attn_norm.weight"], hp.eps)
        x = x + (_delta_net(hp, W, mm, p, h) if hp.recurrent[i] else _attention(hp, W, mm, p, h, pos, kv_round))
        x = x + _ffn(hp, W, mm, p, rms(x, W[p + "post_attention_norm.weight"], hp.eps))
    hidden = rms(x, W["output_norm.weight"], hp.eps)
    logits = mm("output.weight" if "output.weight" in W else "token_embd.weight", hidden)
    return (logits, hidden) if with_hidden else logits


def nextn_forward(md, W, tokens, hidden, kv_round=None, act_round=None):
    """The nextn (MTP) layer's logits over a sequence: row t reads token t and the main model's
    hidden state at t - 1 (row 0 pairs with a zero hidden, as a draft's first entry is never
    used for a proposal). -> (T, vocab)."""
    mm = lambda name, h: _matmul(W, name, h, act_round)  # noqa: E731
    hp = _Hp(md)
    n = hp.L
    p = f"blk.{n}."
    T = len(tokens)
    h_prev = np.concatenate([np.zeros((1, hp.E)), hidden[:-1]], axis=0)
    e = W["token_embd.weight"][np.asarray(tokens)]
    x = mm(p + "nextn.eh_proj.weight", np.concatenate([rms(e, W[p + "nextn.enorm.weight"], hp.eps),
                                                       rms(h_prev, W[p + "nextn.hnorm.weight"], hp.eps)], axis=1))
    x = x + _attention(hp, W, mm, p, rms(x, W[p + "attn_norm.weight"], hp.eps), np.arange(T), kv_round)
    x = x + _ffn(hp, W, mm, p, rms(x, W[p + "post_attention_norm.weight"], hp.eps))
    norm = W.get(p + "nextn.shared_head_norm.weight")
    hn = rms(x, norm if norm is not None else W["output_norm.weight"], hp.eps)
    return mm("output.weight" if "output.weight" in W else "token_embd.weight", hn)
