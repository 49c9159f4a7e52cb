"""Write a trained draft as a GGUF in the docs/MTP.md format (no PyTorch needed here).

Matrices are stored Q8_0 (a 576-wide draft block is ~4 MiB instead of ~8 MiB in F16; the
draft only has to agree with the target's argmax, and 8-bit weights keep that), norms F32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata.gguf.constants import ValueType as V
from strata.gguf.writer import GGUFWriter
from strata.kernels.ggml_types import BY_NAME
from strata.kernels.quantize import quantize_q8_0
from strata.mtp.defaults import FINGERPRINT_KEY
from strata.mtp.draft import VOCAB_TENSOR
from strata.pack.draft_rules import MTP_ARCH  # the format's name, which the draft's key table checks

TOP_LEVEL = ("enorm", "hnorm", "eh_proj", "output_norm")  # mtp.<role>.weight; the rest is mtp.blk.<role>.weight


def tensor_name(role: str) -> str:
    return f"mtp.{role}.weight" if role in TOP_LEVEL else f"mtp.blk.{role}.weight"


def write_draft(path: str | Path, weights: dict[str, np.ndarray], *, target_arch: str, n_embd: int,
                name: str = "MTP draft", extra_metadata: dict[str, str] | None = None,
                matrix_type: str = "Q8_0", vocab: np.ndarray | None = None,
                target_fingerprint: str | None = None) -> Path:
    """weights: role -> float32 array, matrices (out, in) as torch/numpy hold them; vocab: the
    draft's vocabulary (ascending token ids, `mtp.vocab`) or None; target_fingerprint: the
    target's (strata.mtp.defaults.target_fingerprint), by which a draft shipped in
    strata/mtp/data/ is found for its model whatever the model's path."""
    w = GGUFWriter(path)
    w.add_metadata("general.architecture", MTP_ARCH, V.STRING)
    w.add_metadata("general.name", name, V.STRING)
    w.add_metadata(f"{MTP_ARCH}.target_architecture", target_arch, V.STRING)
    w.add_metadata(f"{MTP_ARCH}.embedding_length", int(n_embd), V.UINT32)
    for key, value in (extra_metadata or {}).items():
        w.add_metadata(f"{MTP_ARCH}.{key}", str(value), V.STRING)
    if target_fingerprint is not None:
        w.add_metadata(FINGERPRINT_KEY, target_fingerprint, V.STRING)
    order = list(TOP_LEVEL[:3]) + [r for r in weights if r not in TOP_LEVEL] + ["output_norm"]
    for role in order:
        a = np.ascontiguousarray(weights[role], dtype=np.float32)
        ne = tuple(reversed(a.shape))  # ggml order: row length first
        if a.ndim == 2 and matrix_type == "Q8_0" and a.shape[1] % 32 == 0:
            w.add_tensor(tensor_name(role), BY_NAME["Q8_0"].id, ne, quantize_q8_0(a))
        elif a.ndim == 2 and matrix_type == "F16":
            w.add_tensor(tensor_name(role), BY_NAME["F16"].id, ne, a.astype("<f2"))
        else:
            w.add_tensor(tensor_name(role), BY_NAME["F32"].id, ne, a)
    if vocab is not None:
        w.add_tensor(VOCAB_TENSOR, BY_NAME["I32"].id, (int(vocab.size),), np.asarray(vocab, "<i4"))
    return w.write()
