"""qwen3next packs whose DeltaNet layers hold one fused `blk.N.ssm_in.weight` (q, k, v and the
output gate z together, as earlier llama.cpp converters wrote them) instead of `attn_qkv.weight` +
`attn_gate.weight`: the fused tensor's rows are put once, at load, in the order of those two, so
the layers and both backends read one input projection whichever form the pack holds.

The layout, from llama.cpp (facts, no code):

- src/models/qwen3next.cpp, load_arch_tensors: a recurrent layer's `ssm_in` {n_embd, 2 key_dim +
  2 value_dim}, `attn_qkv` {n_embd, 2 key_dim + value_dim} and `attn_gate` {n_embd, value_dim} are
  all optional (TENSOR_NOT_REQUIRED); `ssm_ba` {n_embd, 2 n_v_heads} is required in either form.
- same file, build_qkvz: with `attn_qkv` present its output is the conv input and `attn_gate`'s is
  z. Otherwise ("legacy" path) the `ssm_in` output of a token is viewed as n_k_heads groups of
  2 d_k + 2 r d_v values (r = n_v_heads / n_k_heads, d_k = d_v = ssm.state_size); group g holds
  [q (d_k) | k (d_k) | v (r d_v) | z (r d_v)]; the conv input is q of every group in group order,
  then every k, then every v, and z is every group's z in order (value head g r + i).
- convert_hf_to_gguf.py, Qwen3NextModel.modify_tensors: today's converter does that regrouping on
  Hugging Face's in_proj_qkvz (per key group q, k, v, z) and writes attn_qkv = [q... | k... |
  v...] and attn_gate = [z...]; gguf-py/gguf/tensor_mapping.py maps in_proj_qkvz to
  SSM_IN, the name earlier converters wrote it under unchanged. in_proj_ba goes to SSM_BETA_ALPHA
  unchanged in both, per key group [b (r) | a (r)], which build_layer_attn_linear splits by a
  reshape whichever input form the layer has: a legacy `ssm_ba` is what DeltaNet reads already
  (DeltaNetTraits.fused_ba). `ssm_conv1d`'s channels follow the conv input [q | k | v] in both forms.
- src/llama-arch.cpp, LLM_ARCH_QWEN3NEXT: blk.%d.ssm_in, blk.%d.attn_qkv, blk.%d.attn_gate,
  blk.%d.ssm_ba.

A row of a ggml matrix (ne0 weights, one output) is whole quantization blocks, so putting rows in
another order is a permutation of byte rows: exact for every type, nothing dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.backend.base import SourceView, TensorSource
from strata.kernels.ggml_types import type_by_id
from strata.model.layers.delta_net_hparams import HybridConfig


def split_row_order(h: HybridConfig) -> np.ndarray:
    """For each row of [attn_qkv | attn_gate] (q of every key group, then k, v, z), the row of
    the fused ssm_in it comes from."""
    r = h.n_v_heads // h.n_k_heads
    widths = (h.d_state, h.d_state, r * h.d_state, r * h.d_state)  # one key group's q, k, v, z
    starts = np.cumsum((0, *widths[:-1]))
    groups = np.arange(h.n_k_heads)[:, None] * sum(widths)  # each group's first row
    return np.concatenate([(groups + start + np.arange(width)).reshape(-1)
                           for start, width in zip(starts, widths)])


@dataclass(frozen=True)
class RowsInOrder(SourceView):
    """A 2-D tensor seen with its rows (ggml ne1) taken in `order`: a TensorSource whose raw
    blocks are the source's byte rows permuted."""

    order: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.src.shape[0]), len(self.order))

    def data(self) -> np.ndarray:
        row_bytes = type_by_id(self.ggml_type).row_bytes(int(self.src.shape[0]))
        rows = np.asarray(self.src.data()).reshape(-1, row_bytes)
        return np.ascontiguousarray(rows[self.order]).reshape(-1)


def split_ssm_in(src: TensorSource, h: HybridConfig) -> TensorSource:
    """The fused ssm_in as the rows of attn_qkv followed by attn_gate's (what DeltaNet fuses)."""
    return RowsInOrder(src, split_row_order(h))
