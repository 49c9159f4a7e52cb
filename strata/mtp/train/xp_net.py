"""The draft's training math for any array module (numpy on the CPU, CuPy on a GPU), no PyTorch.

The same function as net.py's `DraftNet.unrolled` and `candidate_loss` (RMSNorm, the eh_proj
input, GQA attention with RoPE in the target's pair convention, optional q/k norm, SwiGLU FFN,
output_norm; the candidate-set cross-entropy), with the backward pass written out by hand:
the forward keeps what the backward needs (a "tape" per pass) and `XpDraft.backward` walks the
passes in reverse. The frozen embedding and head get no gradient, but gradient flows into the
draft through the head (dg = dlogits @ head rows), and from pass j into pass j-1's output (its
"h" input) and into the keys/values of earlier passes that pass j attends to.

Arrays: activations (B, T, E) row-major; attention works on (B, H, T, D) with the H query
heads grouped as (n_head_kv, group): query head i uses kv head i // group, as the engine and
net.py do, so keys and values are never repeated per query head. Every product is one batched
`xp.matmul`; no Python loop runs over rows or heads. float32 unless built with another dtype
(the tests compare against PyTorch in float64).

`AdamW`, `clip_grad_norm` and `lr_factor` are torch.optim.AdamW, clip_grad_norm_ and the
trainer's LambdaLR schedule written for xp arrays.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from strata.mtp.train.dims import Dims, rope_cos_sin


def to_host(xp: Any, a: Any) -> np.ndarray:
    return xp.asnumpy(a) if hasattr(xp, "asnumpy") else np.asarray(a)


class XpDraft:
    """Trainable draft weights (role -> xp array) + the frozen shared embedding/head of the target."""

    def __init__(self, dims: Dims, weights: dict[str, Any], embed: Any, head: Any, xp: Any = np,
                 dtype: Any = np.float32):
        self.xp, self.dims, self.dtype = xp, dims, np.dtype(dtype)
        self.p = {k: xp.array(v, dtype=self.dtype) for k, v in weights.items()}  # own copies: updated in place
        tied = head is embed
        self.embed = xp.asarray(embed, dtype=self.dtype)  # frozen (vocab, E)
        self.head = self.embed if tied else xp.asarray(head, dtype=self.dtype)  # frozen (vocab, E)
        self.qk_norm = "attn_q_norm" in self.p
        self._tables: dict[int, tuple[Any, Any, Any]] = {}

    def host_weights(self) -> dict[str, np.ndarray]:
        return {k: to_host(self.xp, v).astype(np.float32) for k, v in self.p.items()}

    # ---- primitives -------------------------------------------------------------------------------
    def _rope_tables(self, n: int):
        """cos, sin (n, rope_dim/2) and the causal mask (n, n) (0 / -inf) in the net's dtype."""
        hit = self._tables.get(n)
        if hit is None:
            xp = self.xp
            cos, sin = rope_cos_sin(self.dims, n)
            mask = np.where(np.tri(n, dtype=bool), 0.0, -np.inf)
            hit = (xp.asarray(cos, self.dtype), xp.asarray(sin, self.dtype), xp.asarray(mask, self.dtype))
            self._tables = {n: hit}  # batches come bucketed by length: keep the latest only
        return hit

    def _rms(self, x, w):
        xp = self.xp
        r = 1.0 / xp.sqrt((x * x).mean(-1, keepdims=True) + self.dims.rms_eps)
        return x * r * w, r

    @staticmethod
    def _rms_back(dy, x, r, w, want_dx: bool = True):
        """y = x * r * w, r = (mean(x^2) + eps)^-1/2: dw = sum dy * x r; dx = r (dy w - x r mean(dy w x r))."""
        xh = x * r
        dw = (dy * xh).reshape(-1, x.shape[-1]).sum(0)
        if not want_dx:
            return None, dw
        dxh = dy * w
        return r * (dxh - xh * (dxh * xh).mean(-1, keepdims=True)), dw

    def _rope(self, x, cos, sin):
        """x (B, T, H, D), cos/sin (T, rope_dim/2). Backward is the same with -sin (a rotation)."""
        d = self.dims.rope_dim
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        out = x.copy()
        if self.dims.rope_neox:
            a, b = x[..., : d // 2], x[..., d // 2 : d]
            out[..., : d // 2] = a * c - b * s
            out[..., d // 2 : d] = a * s + b * c
        else:
            a, b = x[..., 0:d:2], x[..., 1:d:2]
            out[..., 0:d:2] = a * c - b * s
            out[..., 1:d:2] = a * s + b * c
        return out

    @staticmethod
    def _lin(x, w):
        """x (..., in) @ w.T, w (out, in)."""
        return (x.reshape(-1, x.shape[-1]) @ w.T).reshape(*x.shape[:-1], w.shape[0])

    def _lin_back(self, dy, x, name: str, grads) -> Any:
        """Accumulates dW = dy^T x into grads[name]; returns dx = dy @ W."""
        w = self.p[name]
        dyf, xf = dy.reshape(-1, w.shape[0]), x.reshape(-1, w.shape[1])
        grads[name] += dyf.T @ xf
        return (dyf @ w).reshape(*dy.shape[:-1], w.shape[1])

    # ---- the pieces of one pass ---------------------------------------------------------------------
    def _inputs(self, tokens, hidden):
        """u = eh_proj [enorm(embed(x)); hnorm(h)]."""
        xp, p = self.xp, self.p
        e = self.embed[tokens]
        en, re = self._rms(e, p["enorm"])
        hn, rh = self._rms(hidden, p["hnorm"])
        c = xp.concatenate([en, hn], axis=-1)
        return self._lin(c, p["eh_proj"]), (e, re, hidden, rh, c)

    def _inputs_back(self, du, t, grads, want_dh: bool):
        e, re, hidden, rh, c = t
        E = self.dims.n_embd
        dc = self._lin_back(du, c, "eh_proj", grads)
        _, dw = self._rms_back(dc[..., :E], e, re, self.p["enorm"], want_dx=False)  # the embedding is frozen
        grads["enorm"] += dw
        dh, dw = self._rms_back(dc[..., E:], hidden, rh, self.p["hnorm"], want_dx=want_dh)
        grads["hnorm"] += dw
        return dh

    def _qkv(self, x, cos, sin):
        """(B, T, E) -> q (B, H, T, D), k and v (B, Hkv, T, D) (normed, rotated)."""
        xp, p, d = self.xp, self.p, self.dims
        B, T, _ = x.shape
        h, r = self._rms(x, p["attn_norm"])
        q = self._lin(h, p["attn_q"]).reshape(B, T, d.n_head, d.head_dim)
        k = self._lin(h, p["attn_k"]).reshape(B, T, d.n_head_kv, d.head_dim)
        v = self._lin(h, p["attn_v"]).reshape(B, T, d.n_head_kv, d.head_dim)
        rq = rk = None
        qn, kn = q, k
        if self.qk_norm:
            qn, rq = self._rms(q, p["attn_q_norm"])
            kn, rk = self._rms(k, p["attn_k_norm"])
        qr, kr = self._rope(qn, cos, sin), self._rope(kn, cos, sin)
        tr = lambda a: xp.ascontiguousarray(a.transpose(0, 2, 1, 3))  # noqa: E731
        return tr(qr), tr(kr), tr(v), (x, r, h, q, rq, k, rk, cos, sin)

    def _qkv_back(self, dq, dk, dv, t, grads):
        x, r, h, q, rq, k, rk, cos, sin = t
        tr = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731
        dq, dk = self._rope(tr(dq), cos, -sin), self._rope(tr(dk), cos, -sin)
        if self.qk_norm:
            dq, dw = self._rms_back(dq, q, rq, self.p["attn_q_norm"])
            grads["attn_q_norm"] += dw
            dk, dw = self._rms_back(dk, k, rk, self.p["attn_k_norm"])
            grads["attn_k_norm"] += dw
        flat = lambda a: a.reshape(*a.shape[:2], -1)  # noqa: E731
        dh = (self._lin_back(flat(dq), h, "attn_q", grads) + self._lin_back(flat(dk), h, "attn_k", grads)
              + self._lin_back(flat(tr(dv)), h, "attn_v", grads))
        dx, dw = self._rms_back(dh, x, r, self.p["attn_norm"])
        grads["attn_norm"] += dw
        return dx

    def _attend(self, q, kt, vt, mask, ks=None, vs=None):
        """Softmax attention of q (B, H, n, D) over the true keys kt/vt (B, Hkv, n, D), causal (row r
        sees 0..r), plus, per row, L speculative keys ks/vs (B, Hkv, n, L, D) (pass j: the keys of
        passes 2..j at that row, its own last). -> (B, H, n, D)."""
        xp = self.xp
        B, H, n, D = q.shape
        Hkv = kt.shape[1]
        g = H // Hkv
        scale = 1.0 / math.sqrt(self.dims.head_dim)
        qf = q.reshape(B, Hkv, g * n, D)
        st = (xp.matmul(qf, kt.transpose(0, 1, 3, 2)) * scale).reshape(B, Hkv, g, n, n) + mask
        m = st.max(-1)
        ps = None
        if ks is not None:
            q5 = q.reshape(B, Hkv, g, n, 1, D)
            ss = (q5 * ks[:, :, None]).sum(-1) * scale  # (B, Hkv, g, n, L)
            m = xp.maximum(m, ss.max(-1))
            es = xp.exp(ss - m[..., None])
        et = xp.exp(st - m[..., None])
        z = et.sum(-1, keepdims=True)
        if ks is not None:
            z = z + es.sum(-1, keepdims=True)
            ps = es / z
        pt = et / z
        o = xp.matmul(pt.reshape(B, Hkv, g * n, n), vt).reshape(B, Hkv, g, n, D)
        if ps is not None:
            o = o + (ps[..., None] * vs[:, :, None]).sum(-2)
        return o.reshape(B, H, n, D), (q, kt, vt, ks, vs, pt, ps)

    def _attend_back(self, do, t):
        """-> dq, dkt, dvt, dks, dvs (None without speculative keys). Softmax backward:
        dS = P (dP - sum_keys P dP), over the true and the speculative columns together."""
        xp = self.xp
        q, kt, vt, ks, vs, pt, ps = t
        B, H, n, D = q.shape
        Hkv = kt.shape[1]
        g = H // Hkv
        scale = 1.0 / math.sqrt(self.dims.head_dim)
        dof = do.reshape(B, Hkv, g * n, D)
        ptf = pt.reshape(B, Hkv, g * n, n)
        dvt = xp.matmul(ptf.transpose(0, 1, 3, 2), dof)  # (B, Hkv, n, D): summed over the group
        dpt = xp.matmul(dof, vt.transpose(0, 1, 3, 2)).reshape(B, Hkv, g, n, n)
        dot = (pt * dpt).sum(-1)  # (B, Hkv, g, n)
        dks = dvs = None
        if ps is not None:
            do5 = do.reshape(B, Hkv, g, n, 1, D)
            dps = (do5 * vs[:, :, None]).sum(-1)  # (B, Hkv, g, n, L)
            dot = dot + (ps * dps).sum(-1)
            dss = ps * (dps - dot[..., None]) * scale
            dvs = (ps[..., None] * do5).sum(2)  # (B, Hkv, n, L, D)
            dks = (dss[..., None] * q.reshape(B, Hkv, g, n, 1, D)).sum(2)
        dst = (pt * (dpt - dot[..., None]) * scale).reshape(B, Hkv, g * n, n)
        dq = xp.matmul(dst, kt).reshape(B, Hkv, g, n, D)
        if ps is not None:
            dq = dq + (dss[..., None] * ks[:, :, None]).sum(-2)
        dkt = xp.matmul(dst.transpose(0, 1, 3, 2), q.reshape(B, Hkv, g * n, D))
        return dq.reshape(B, H, n, D), dkt, dvt, dks, dvs

    def _finish(self, x, att):
        """Attention output projection + residual, then the SwiGLU FFN + residual."""
        xp, p = self.xp, self.p
        B, H, T, D = att.shape
        a = att.transpose(0, 2, 1, 3).reshape(B, T, H * D)
        x2 = x + self._lin(a, p["attn_output"])
        h2, r2 = self._rms(x2, p["ffn_norm"])
        gt = self._lin(h2, p["ffn_gate"])
        up = self._lin(h2, p["ffn_up"])
        e = xp.exp(-xp.abs(gt))
        sg = xp.where(gt >= 0, 1.0 / (1.0 + e), e / (1.0 + e))  # sigmoid without overflow
        act = gt * sg * up
        return x2 + self._lin(act, p["ffn_down"]), (a, x2, r2, h2, gt, up, sg, act)

    def _finish_back(self, dout, t, grads):
        a, x2, r2, h2, gt, up, sg, act = t
        dact = self._lin_back(dout, act, "ffn_down", grads)
        dgt = dact * up * (sg * (1.0 + gt * (1.0 - sg)))  # silu'(z) = s (1 + z (1 - s))
        dup = dact * gt * sg
        dh2 = self._lin_back(dgt, h2, "ffn_gate", grads) + self._lin_back(dup, h2, "ffn_up", grads)
        dx2, dw = self._rms_back(dh2, x2, r2, self.p["ffn_norm"])
        grads["ffn_norm"] += dw
        dx2 = dx2 + dout
        da = self._lin_back(dx2, a, "attn_output", grads)
        B, T, _ = da.shape
        datt = da.reshape(B, T, self.dims.n_head, self.dims.head_dim).transpose(0, 2, 1, 3)
        return dx2, datt

    # ---- the unrolled draft -------------------------------------------------------------------------
    def forward(self, tokens, hidden, passes: int):
        """tokens (B, T+1) x_0..x_T, hidden (B, T, E) h_0..h_{T-1}.

        Returns (outs, tape): outs[j-1] the normed outputs of pass j, (B, T-j+1, E), as
        `DraftNet.unrolled` (pass 1 reads the true hiddens; pass j reads pass j-1's output of the
        same row and attends to the pass-1 keys of indices 0..r, the keys of passes 2..j-1 at
        row r and its own); tape what `backward` needs.
        """
        xp, p = self.xp, self.p
        hidden = xp.asarray(hidden, dtype=self.dtype)
        T = hidden.shape[1]
        cos, sin, mask = self._rope_tables(T)
        outs, tape, keys, vals = [], [], [], []
        for j in range(1, passes + 1):
            n = T - j + 1
            if n < 1:
                break
            x, ti = self._inputs(tokens[:, j:], hidden if j == 1 else outs[-1][:, :n])
            q, k, v, tq = self._qkv(x, cos[j - 1 :], sin[j - 1 :])
            keys.append(k)
            vals.append(v)
            if j == 1:
                att, ta = self._attend(q, k, v, mask)
            else:
                ks = xp.stack([kk[:, :, :n] for kk in keys[1:]], axis=3)
                vs = xp.stack([vv[:, :, :n] for vv in vals[1:]], axis=3)
                att, ta = self._attend(q, keys[0][:, :, :n], vals[0][:, :, :n], mask[:n, :n], ks, vs)
            out, tf = self._finish(x, att)
            g, r = self._rms(out, p["output_norm"])
            outs.append(g)
            tape.append((n, ti, tq, ta, tf, out, r))
        return outs, tape

    def unrolled(self, tokens, hidden, passes: int) -> list:
        """The normed outputs of passes 1..passes (forward only)."""
        return self.forward(tokens, hidden, passes)[0]

    def backward(self, tape, dgs: list) -> dict[str, Any]:
        """Gradients of every draft weight, given d loss / d outs[j] (dgs, None: zero)."""
        xp = self.xp
        grads = {k: xp.zeros_like(v) for k, v in self.p.items()}
        P = len(tape)
        dg = [None] * P
        for i, d in enumerate(dgs[:P]):
            dg[i] = None if d is None else d.copy()
        # d loss / d keys and values of each pass (B, Hkv, rows, D): from itself and from later passes
        B, Hkv, D = tape[0][5].shape[0], self.dims.n_head_kv, self.dims.head_dim
        dk = [xp.zeros((B, Hkv, t[0], D), self.dtype) for t in tape]
        dv = [xp.zeros((B, Hkv, t[0], D), self.dtype) for t in tape]
        for i in range(P - 1, -1, -1):
            n, ti, tq, ta, tf, out, r = tape[i]
            if dg[i] is None:
                dg[i] = xp.zeros_like(out)
            dout, dw = self._rms_back(dg[i], out, r, self.p["output_norm"])
            grads["output_norm"] += dw
            dx, datt = self._finish_back(dout, tf, grads)
            dq, dkt, dvt, dks, dvs = self._attend_back(datt, ta)
            dk[0][:, :, :n] += dkt  # every pass attends to the first rows of pass 1's (true) keys
            dv[0][:, :, :n] += dvt
            for c in range(i):  # speculative column c: the key of pass c+2 at this row (the last: its own)
                dk[c + 1][:, :, :n] += dks[:, :, :, c]
                dv[c + 1][:, :, :n] += dvs[:, :, :, c]
            dx = dx + self._qkv_back(dq, dk[i], dv[i], tq, grads)
            dh = self._inputs_back(dx, ti, grads, want_dh=i > 0)
            if i > 0:
                if dg[i - 1] is None:
                    dg[i - 1] = xp.zeros_like(tape[i - 1][5])
                dg[i - 1][:, :n] += dh
        return grads


# ---- the loss -------------------------------------------------------------------------------------
def candidate_loss(net: XpDraft, g, top_ids, top_logits, negatives, want_grad: bool = True):
    """net.py's candidate_loss with its gradient: (loss, agreement, d loss / d g or None).

    g (n, E) draft outputs; top_ids/top_logits (n, K) the target's top-K; negatives (M,) unique
    shared ids, masked (-inf) in a row where they repeat one of its top-K. loss = mean over rows
    of -sum_k p_k log q_k - 0.5 log q_0 (p the target's softmax over its top-K, q the draft's
    softmax over the row's K + M candidates); d loss / d z = ((sum p) + 0.5) q - p - 0.5 e_0,
    per row, / n. loss and agreement are 0-d xp arrays (no host sync here).
    """
    xp = net.xp
    n, K = top_ids.shape
    M = negatives.shape[0]
    h_own = net.head[top_ids]  # (n, K, E)
    h_neg = net.head[negatives]  # (M, E)
    own = xp.matmul(h_own, g[:, :, None])[..., 0]  # (n, K)
    neg = g @ h_neg.T  # (n, M)
    # a row's top-K ids among the negatives (sorted search, no n x K x M comparison)
    order = xp.argsort(negatives)
    pos = xp.minimum(xp.searchsorted(negatives[order], top_ids), M - 1)
    hit = negatives[order][pos] == top_ids
    col = xp.where(hit, order[pos], M)
    dup = xp.zeros((n, M + 1), dtype=bool)
    dup[xp.arange(n)[:, None], col] = True
    neg = xp.where(dup[:, :M], xp.asarray(-np.inf, dtype=neg.dtype), neg)
    m = xp.maximum(own.max(1), neg.max(1))[:, None]
    eo, en = xp.exp(own - m), xp.exp(neg - m)
    z = eo.sum(1, keepdims=True) + en.sum(1, keepdims=True)
    logq = own - (m + xp.log(z))
    t = top_logits - top_logits.max(1, keepdims=True)
    p = xp.exp(t)
    p = p / p.sum(1, keepdims=True)
    loss = -(p * logq).sum(1).mean() - 0.5 * logq[:, 0].mean()
    agree = ((xp.argmax(own, 1) == 0) & (own.max(1) >= neg.max(1))).astype(g.dtype).mean()
    if not want_grad:
        return loss, agree, None
    coef = (p.sum(1, keepdims=True) + 0.5) / z
    dz_own = coef * eo - p
    dz_own[:, 0] -= 0.5
    dz_own /= n
    dz_neg = coef * en / n
    dg = xp.matmul(dz_own[:, None, :], h_own)[:, 0] + dz_neg @ h_neg
    return loss, agree, dg


PASS_WEIGHT = 0.5  # loss weight of pass j is PASS_WEIGHT ** (j-1): later positions matter less end to end


def mined(net: XpDraft, g, rng: np.random.Generator, n: int, rows: int = 64) -> np.ndarray:
    """trainer._mined for xp: the tokens the draft ranks highest (full head, a few rows), host ids."""
    xp = net.xp
    flat = g.reshape(-1, g.shape[-1])
    pick = rng.choice(flat.shape[0], size=min(rows, flat.shape[0]), replace=False)
    lg = flat[xp.asarray(pick)] @ net.head.T
    k = min(8, lg.shape[1])
    top = xp.argpartition(-lg, k - 1, axis=-1)[:, :k] if k < lg.shape[1] else xp.argsort(-lg, axis=-1)
    top = to_host(xp, xp.unique(top))
    return rng.choice(top, size=min(n, len(top)), replace=False) if len(top) else top


def batch_loss(net: XpDraft, batch, rng: np.random.Generator, n_neg: int = 1024, passes: int = 2):
    """trainer.batch_loss for xp, with the gradient: (total loss, stats, grads).

    batch: (tokens (B, T+1), hidden (B, T, E), top_ids (B, T, K), top_logits (B, T, K)) xp
    arrays. The negatives are drawn from `rng` in the same order as the torch trainer draws them.
    """
    xp = net.xp
    tokens, hidden, top_ids, top_lg = batch
    B, T = hidden.shape[:2]
    E = net.dims.n_embd
    K = top_ids.shape[-1]
    outs, tape = net.forward(tokens, hidden, passes)
    vocab = net.head.shape[0]
    pool = to_host(xp, xp.unique(top_ids[top_ids >= 0]))
    neg = np.concatenate([rng.choice(pool, size=min(n_neg // 2, len(pool)), replace=False),
                          rng.integers(0, vocab, size=n_neg // 4), mined(net, outs[0], rng, n_neg // 4)])
    neg = xp.asarray(np.unique(neg.astype(np.int64)))
    stats: dict[str, float] = {}
    total = 0.0
    dgs = []
    for j, g in enumerate(outs, start=1):
        n = T - j  # rows j..T-1 have targets
        if n < 1:
            break
        ids = xp.ascontiguousarray(top_ids[:, j : j + n]).reshape(-1, K)
        lg = xp.ascontiguousarray(top_lg[:, j : j + n]).reshape(-1, K)
        rows = xp.nonzero(ids[:, 0] >= 0)[0]
        gj = xp.ascontiguousarray(g[:, :n]).reshape(-1, E)[rows]
        loss, agree, dg = candidate_loss(net, gj, ids[rows], lg[rows], neg)
        w = PASS_WEIGHT ** (j - 1)
        full = xp.zeros((B * n, E), dtype=g.dtype)
        full[rows] = w * dg
        d = xp.zeros_like(g)
        d[:, :n] = full.reshape(B, n, E)
        dgs.append(d)
        loss, agree = float(loss), float(agree)
        total += w * loss
        stats[f"loss{j}"], stats[f"agree{j}"] = loss, agree
    return total, stats, net.backward(tape, dgs)


def acceptance(net: XpDraft, batches, passes: int = 3, chunk: int = 512) -> list[float]:
    """trainer.teacher_forced_acceptance for xp: greedy, full head (chunked), P(d1), P(d2 | d1), ...

    batches: one (tokens, hidden, top_ids, top_logits) host tuple per held-out sequence (B = 1).
    """
    xp = net.xp
    hit, tries = np.zeros(passes, np.int64), np.zeros(passes, np.int64)
    for tokens, hidden, top_ids, _ in batches:
        T = hidden.shape[1]
        if T <= passes:
            continue
        tgt = np.asarray(top_ids)[0, :, 0]
        n = T - passes  # rows whose whole chain has targets
        chain_ok = np.ones(n, dtype=bool)
        for j in range(passes):  # prompt rows have no target: they are no drafting window
            chain_ok &= tgt[1 + j : 1 + j + n] >= 0
        outs = net.unrolled(xp.asarray(tokens), xp.asarray(hidden), passes)
        for j, g in enumerate(outs):
            want = tgt[1 + j : 1 + j + n]
            arg = np.concatenate([to_host(xp, xp.argmax(g[0, a : min(a + chunk, n)] @ net.head.T, axis=-1))
                                  for a in range(0, n, chunk)])
            tries[j] += int(chain_ok.sum())
            chain_ok = chain_ok & (arg == want)
            hit[j] += int(chain_ok.sum())
    return [float(h / max(t, 1)) for h, t in zip(hit, tries)]


# ---- the optimiser --------------------------------------------------------------------------------
def lr_factor(s: int, steps: int, warm: int) -> float:
    """The trainer's schedule (a LambdaLR lambda): linear warm-up over `warm` steps, then cosine to 0.1."""
    return min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))


def clip_grad_norm(grads: dict[str, Any], max_norm: float, xp: Any = np):
    """torch.nn.utils.clip_grad_norm_: scale all gradients by min(1, max_norm / (global norm + 1e-6)).
    Returns the norm before clipping (an xp 0-d array: no host sync)."""
    total = xp.sqrt(sum((g * g).sum() for g in grads.values()))
    coef = xp.minimum(max_norm / (total + 1e-6), 1.0).astype(next(iter(grads.values())).dtype)
    for g in grads.values():
        g *= coef
    return total


class AdamW:
    """torch.optim.AdamW on a dict of xp arrays (updated in place)."""

    def __init__(self, params: dict[str, Any], betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-8,
                 weight_decay: float = 0.0, xp: Any = np):
        self.params, self.betas, self.eps, self.weight_decay = params, betas, eps, weight_decay
        self.m = {k: xp.zeros_like(v) for k, v in params.items()}
        self.v = {k: xp.zeros_like(v) for k, v in params.items()}
        self.xp = xp
        self.t = 0

    def step(self, grads: dict[str, Any], lr: float) -> None:
        xp = self.xp
        b1, b2 = self.betas
        self.t += 1
        step_size = lr / (1 - b1 ** self.t)
        bc2_sqrt = math.sqrt(1 - b2 ** self.t)
        for k, p in self.params.items():
            g, m, v = grads[k], self.m[k], self.v[k]
            if self.weight_decay:
                p *= 1 - lr * self.weight_decay
            m += (1 - b1) * (g - m)
            v *= b2
            v += (1 - b2) * g * g
            p -= step_size * m / (xp.sqrt(v) / bc2_sqrt + self.eps)
