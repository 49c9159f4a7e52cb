"""The draft block's hyperparameters and RoPE tables, shared by both trainers (no PyTorch here).

`Dims` is the target's attention geometry that the draft block reuses; `rope_cos_sin` the
float32 angle tables that net.py (PyTorch) and xp_net.py (numpy / CuPy) both rotate with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Dims:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    rope_dim: int
    rope_scale: float
    rope_neox: bool
    rms_eps: float


def dims_of(cfg) -> Dims:
    """The draft's Dims from a target's ModelConfig."""
    return Dims(cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rope_base, cfg.rope_dim, cfg.rope_scale,
                cfg.traits.rope_neox, cfg.rms_eps)


def rope_cos_sin(dims: Dims, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n, rope_dim / 2) float32 for positions 0..n-1 (angles in float64)."""
    half = dims.rope_dim // 2
    inv = dims.rope_base ** (-np.arange(0, half, dtype=np.float64) * 2.0 / dims.rope_dim)
    ang = (np.arange(n, dtype=np.float64)[:, None] / dims.rope_scale) * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
