"""Hyper-connections (qwen4exp): the residual is `count` streams X = (x_0 .. x_{c-1}) of n_embd
each, not one vector; every sub-block reads one mix of them and writes its output back to each
stream with its own scalar. There is no Sinkhorn step (transformers models/qwen4_exp/
modeling_qwen4_exp.py:997-1025, llama.cpp src/models/qwen4exp.cpp:270-350):

    n_c = RMS(x_c) * gamma_c                 (one RMS per stream, gamma of length c * n_embd)
    a   = silu(W_down n / c)                  (n: the c normed streams concatenated, stream-major)
    g   = sigmoid(W_up a)                     (c * n_embd gates)
    u   = (1/c) sum_c g_c * n_c               (what the sub-block reads)
    w   = 2 sigmoid(W_inject n / c)           (c write scalars)
    x_c <- x_c + w_c * Block(u)               (the write: the un-normed streams)

The head's mix is the same read without the inject (modeling_qwen4_exp.py:1476); its u goes
straight to the output projection (no other final norm). GGUF's gammas are 1 + w already.
"""

from __future__ import annotations

from typing import Any

from strata.backend.base import Backend
from strata.gguf.key_rules import Key, Kind, Range
from strata.model.layers.attention import norm_spec
from strata.model.layers.tensors import Reader, TensorSpec

KEYS = (
    Key("hyper_connection.count", Kind.COUNT, required=True, range=Range(1, 64)),
    Key("hyper_connection.low_rank", Kind.COUNT, required=True, range=Range(1, 2**20)),
)


def tensors(p: str, n_embd: int, count: int, rank: int, *, inject: bool = True) -> list[TensorSpec]:
    """One mix's tensors, names p + norm / down / up / inject (".weight" after each)."""
    W = count * n_embd
    out = [norm_spec(p + "norm.weight", W),
           TensorSpec(p + "down.weight", (W, rank), "hc"),
           TensorSpec(p + "up.weight", (rank, W), "hc")]
    if inject:
        out.append(TensorSpec(p + "inject.weight", (W, count), "hc"))
    return out


def grouped_rms(b: Backend, x: Any, weight: Any, eps: float) -> Any:
    """RMS norm of each stream of x (n, c, E) on its own, times its slice of weight (c, E)."""
    xp = b.xp
    var = xp.mean(x * x, axis=-1, keepdims=True)
    return (x / xp.sqrt(var + eps)) * weight


class HyperMix:
    """One hyper-connection read (and, with inject, its write scalars): module doc."""

    def __init__(self, b: Backend, r: Reader, p: str, n_embd: int, count: int, rank: int, eps: float, *,
                 inject: bool = True):
        W = count * n_embd
        self.b, self.E, self.c, self.eps = b, n_embd, count, eps
        self.norm = b.vector(r.req(p + "norm.weight", (W,))).reshape(count, n_embd)
        self.down = b.linear_weight([r.req(p + "down.weight", (W, rank))])
        self.up = b.linear_weight([r.req(p + "up.weight", (rank, W))])
        self.inject = b.linear_weight([r.req(p + "inject.weight", (W, count))]) if inject else None

    def read(self, X: Any) -> tuple[Any, Any]:
        """X (n, c, E) streams -> (u (n, E), w (n, c) write scalars, or None without inject)."""
        b, n, c = self.b, X.shape[0], self.c
        normed = grouped_rms(b, X, self.norm, self.eps)
        flat = normed.reshape(n, c * self.E)
        a = b.linear(self.down, flat) * (1.0 / c)
        a = a * b.sigmoid(a)  # silu
        g = b.sigmoid(b.linear(self.up, a)).reshape(n, c, self.E)
        u = (g * normed).mean(axis=1)
        if self.inject is None:
            return u, None
        w = 2.0 * b.sigmoid(b.linear(self.inject, flat) * (1.0 / c))
        return u, w

    @staticmethod
    def write(X: Any, w: Any, y: Any) -> Any:
        """x_c + w_c * y for every stream: X (n, c, E), w (n, c), y (n, E)."""
        return X + w[:, :, None] * y[:, None, :]
