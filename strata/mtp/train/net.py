"""The draft in PyTorch (training only; serving never imports torch).

Mirrors strata.mtp.draft.DraftModel.step and strata.model.transformer.BlockRunner.block op for
op (RMSNorm, fused SwiGLU FFN, GQA attention, RoPE in the target's pair convention), so the
weights exported from here compute the same function in the engine.

Passes per batch (`DraftNet.unrolled`):
- pass 1: entry for x_p reads the target's true hidden h_{p-1} (what catch-up feeds the draft);
- pass 2: entry for x_{p+1} reads the draft's own normed output of pass 1 at entry p, and
  attends to the pass-1 keys of earlier entries plus its own key: exactly what the second
  drafted token sees at serving time (a cache of true entries + one speculative entry);
- pass j: the same one level deeper (true entries, the j-2 speculative entries before it, itself).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from strata.mtp.train.dims import Dims, rope_cos_sin

BLOCK_ROLES = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
               "ffn_down", "attn_q_norm", "attn_k_norm")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope_tables(dims: Dims, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_cos_sin(dims, n)
    return torch.from_numpy(cos), torch.from_numpy(sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: Dims) -> torch.Tensor:
    """x (B, T, H, D); cos/sin (T, D/2) for the rows' positions."""
    d = dims.rope_dim
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    if dims.rope_neox:
        a, b = x[..., : d // 2], x[..., d // 2 : d]
        return torch.cat([a * c - b * s, a * s + b * c, x[..., d:]], dim=-1)
    a, b = x[..., 0:d:2], x[..., 1:d:2]
    rot = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([rot, x[..., d:]], dim=-1)


class DraftNet(torch.nn.Module):
    """Trainable draft weights + the frozen shared embedding/head of the target."""

    def __init__(self, dims: Dims, weights: dict[str, np.ndarray], embed: np.ndarray, head: np.ndarray):
        super().__init__()
        self.dims = dims
        self.p = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(torch.from_numpy(
            np.ascontiguousarray(v, np.float32))) for k, v in weights.items()})
        self.embed = torch.from_numpy(embed)  # frozen (vocab, E)
        self.head = torch.from_numpy(head)  # frozen (vocab, E), may be the same array

    def w(self, role: str) -> torch.Tensor | None:
        return self.p[role] if role in self.p else None

    # ---- the block ------------------------------------------------------------------------------
    def _qkv(self, x: torch.Tensor, cos, sin):
        d = self.dims
        B, T, _ = x.shape
        h = rms_norm(x, self.p["attn_norm"], d.rms_eps)
        q = (h @ self.p["attn_q"].T).view(B, T, d.n_head, d.head_dim)
        k = (h @ self.p["attn_k"].T).view(B, T, d.n_head_kv, d.head_dim)
        v = (h @ self.p["attn_v"].T).view(B, T, d.n_head_kv, d.head_dim)
        if "attn_q_norm" in self.p:
            q = rms_norm(q, self.p["attn_q_norm"], d.rms_eps)
            k = rms_norm(k, self.p["attn_k_norm"], d.rms_eps)
        q = apply_rope(q, cos, sin, d)
        k = apply_rope(k, cos, sin, d)
        g = d.n_head // d.n_head_kv  # query head i uses kv head i // g (as the engine groups them)
        return (q.transpose(1, 2), k.repeat_interleave(g, dim=2).transpose(1, 2),
                v.repeat_interleave(g, dim=2).transpose(1, 2))  # (B, H, T, D)

    def _finish(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        d = self.dims
        B, H, T, D = att.shape
        x = x + att.transpose(1, 2).reshape(B, T, H * D) @ self.p["attn_output"].T
        h = rms_norm(x, self.p["ffn_norm"], d.rms_eps)
        y = (F.silu(h @ self.p["ffn_gate"].T) * (h @ self.p["ffn_up"].T)) @ self.p["ffn_down"].T
        return x + y

    def _inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        d = self.dims
        e = rms_norm(self.embed[tokens], self.p["enorm"], d.rms_eps)
        h = rms_norm(hidden, self.p["hnorm"], d.rms_eps)
        return torch.cat([e, h], dim=-1) @ self.p["eh_proj"].T

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, two_pass: bool = True):
        """tokens (B, T+1) x_0..x_T, hidden (B, T, E) h_0..h_{T-1} (float32).

        Returns normed draft outputs: pass 1 (B, T, E) for entries x_1..x_T (entry p at index
        p-1) and pass 2 (B, T-1, E) for entries x_2..x_T fed pass-1 outputs (or None).
        """
        outs = self.unrolled(tokens, hidden, 2 if two_pass else 1)
        return outs[0], (outs[1] if len(outs) > 1 else None)

    def unrolled(self, tokens: torch.Tensor, hidden: torch.Tensor, passes: int) -> list[torch.Tensor]:
        """The draft chained `passes` steps deep at every position, as DraftProposer runs it.

        Pass j (j >= 2) has T-j+1 rows; its row r is the entry at cache index i = r+j-1 for
        token x_{i+1}, drafted j-th after a catch-up that ended at index r. It reads pass j-1's
        output of row r (index i-1) as its "h", and attends to the pass-1 (true) keys of indices
        0..r, the keys of passes 2..j-1 at row r (the speculative entries drafted before it,
        indices r+1..i-1) and its own key: the serving draft cache of that moment.
        """
        d = self.dims
        T = hidden.shape[1]
        cos, sin = (t.to(hidden.device) for t in rope_tables(d, T))  # made on the host
        x = self._inputs(tokens[:, 1:], hidden)
        q, k, v = self._qkv(x, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        g = rms_norm(self._finish(x, att), self.p["output_norm"], d.rms_eps)
        outs = [g]
        spec_k: list[torch.Tensor] = []  # keys/values of passes 2.. (row-aligned: row r of every pass)
        spec_v: list[torch.Tensor] = []
        scale = 1.0 / float(d.head_dim) ** 0.5
        for j in range(2, passes + 1):
            n = T - j + 1
            if n < 1:
                break
            xj = self._inputs(tokens[:, j:], g[:, :n])
            qj, kj, vj = self._qkv(xj, cos[j - 1 :], sin[j - 1 :])
            spec_k.append(kj)
            spec_v.append(vj)
            s_true = (qj @ k[:, :, :n].transpose(-1, -2)) * scale  # (B, H, n, n): true keys 0..n-1
            mask = torch.ones(n, n, dtype=torch.bool, device=qj.device).tril()  # row r sees 0..r
            s_true = s_true.masked_fill(~mask, float("-inf"))
            s_spec = torch.cat([(qj * sk[:, :, :n]).sum(-1, keepdim=True) for sk in spec_k], dim=-1) * scale
            p = torch.softmax(torch.cat([s_true, s_spec], dim=-1), dim=-1)
            att = p[..., :n] @ v[:, :, :n]
            for l, sv in enumerate(spec_v):
                att = att + p[..., n + l : n + l + 1] * sv[:, :, :n]
            g = rms_norm(self._finish(xj, att), self.p["output_norm"], d.rms_eps)
            outs.append(g)
        return outs


def candidate_loss(net: DraftNet, g: torch.Tensor, top_ids: torch.Tensor, top_logits: torch.Tensor,
                   negatives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy against the target's next-token distribution, over a candidate set.

    g (n, E) draft outputs; top_ids/top_logits (n, K) the target's top-K; negatives (M,) shared
    sampled ids (masked where they repeat a row's own top-K). Returns (loss, top-1 agreement).
    The full 49k-row head would cost more than the block itself on a CPU; the target's top-K
    carry nearly all of its mass and the negatives keep the rest of the vocabulary down.
    """
    own = torch.einsum("ne,nke->nk", g, net.head[top_ids])
    neg = g @ net.head[negatives].T
    dup = (negatives[None, None, :] == top_ids[:, :, None]).any(1)
    neg = neg.masked_fill(dup, float("-inf"))
    logq = torch.log_softmax(torch.cat([own, neg], dim=1), dim=1)[:, : top_ids.shape[1]]
    p = torch.softmax(top_logits, dim=1)
    # soft match of the target's distribution (sampling acceptance) + its argmax (greedy acceptance)
    loss = -(p * logq).sum(1).mean() - 0.5 * logq[:, 0].mean()
    agree = (own.argmax(1) == 0) & (own.max(1).values >= neg.max(1).values)
    return loss, agree.float().mean()
