"""The hybrid model: embedding, a stack of Gated DeltaNet and gated-attention layers, final norm
and head, with the same window interface as strata.model.transformer.Transformer (forward,
run_window, logits, new_cache), so the scheduler, the MTP draft and the server take it as is.

A sequence's cache is a HybridCache (strata/model/recurrent_state.py): the attention layers'
KV cache and the recurrent layers' state, which a window writes to its second copy and commits
when the forward is done, so that truncate can roll both back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from strata.backend.base import Backend, RopeParams
from strata.model.config import ModelConfig
from strata.model.hybrid.config import frozen_rope_pairs
from strata.model.hybrid.layers import DeltaNet, HybridLayer
from strata.model.kv_cache import KVCache
from strata.model.recurrent_state import HybridCache, RecurrentPool, RecurrentShape
from strata.model.transformer import Span, TensorLookup, advance, load_embedding, load_head, reserve

# decode windows (1 + drafts) up to this many tokens can be cut back inside; --spec beyond raises it
REPLAY_TOKENS = 16


def rope_of(cfg: ModelConfig) -> RopeParams:
    h = cfg.hybrid
    return RopeParams(cfg.rope_base, cfg.rope_dim, cfg.rope_scale, True, frozen_rope_pairs(h.sections, cfg.rope_dim))


class HybridModel:
    # the CUDA window graphs and fused drafting capture Transformer windows only
    graphable = False

    def __init__(self, backend: Backend, cfg: ModelConfig, get: TensorLookup,
                 progress: Callable[[int, int], None] | None = None):
        self.b = backend
        self.cfg = cfg
        h = cfg.hybrid
        self.rope = rope_of(cfg)
        load_embedding(self, backend, cfg, get)
        self.layers: list[HybridLayer] = []
        n_rec = n_att = 0
        for i, recurrent in enumerate(h.recurrent):
            index = n_rec if recurrent else n_att
            self.layers.append(HybridLayer(backend, cfg, get, f"blk.{i}.", self.rope, recurrent, index))
            n_rec, n_att = n_rec + recurrent, n_att + (not recurrent)
            if progress:
                progress(i + 1, cfg.n_layer)
        self.n_attention = n_att
        self.recurrent_layers = [layer for layer in self.layers if layer.recurrent]
        load_head(self, backend, cfg, get)
        self.replay_tokens = REPLAY_TOKENS
        self.state_shape = RecurrentShape(n_layer=n_rec, conv_rows=h.d_conv - 1, channels=h.conv_dim,
                                          heads=h.n_v_heads, head_v=h.d_state, head_k=h.d_state,
                                          replay_width=DeltaNet.replay_width(cfg))
        self.pool = RecurrentPool(backend.xp, self.state_shape)

    # --- per sequence ----------------------------------------------------------------------
    def new_cache(self, max_ctx: int, kind: str) -> HybridCache:
        c = self.cfg
        kv = KVCache(self.b.xp, max(1, self.n_attention), c.n_head_kv, c.head_dim, max_ctx, kind)
        cache = HybridCache(self.b.xp, kv, self.pool, self.replay_tokens)
        cache.replayer = self._replay
        return cache

    def state_bytes(self) -> int:
        """Private bytes per sequence besides its KV cache (the start-up line, docs/MTP.md)."""
        return HybridCache.state_bytes(self.state_shape, self.replay_tokens)

    def _replay(self, cache: HybridCache, inputs: list[Any]) -> None:
        for layer, kept in zip(self.recurrent_layers, inputs):
            layer.mixer.replay(cache, layer.index, kept)

    # --- windows ---------------------------------------------------------------------------
    def forward(self, tokens: Any, spans: Sequence[Span], logit_rows: Any = None) -> Any:
        """As Transformer.forward: final-normed hidden states (n, n_embd), or with logit_rows the
        pair (hidden, logits of those rows). The caches advance and their states commit only
        once the whole window has run (a failure leaves every sequence as it was)."""
        b = self.b
        reserve(spans)
        for sp in spans:
            sp.cache.begin(sp.start, sp.count)
        out = self.run_window(b.embed(self.embd, tokens), spans)
        if logit_rows is not None:
            out = (out, self.logits(out[b.xp.asarray(np.asarray(logit_rows, np.int64))]))
        for sp in spans:
            sp.cache.commit()
        advance(spans)
        return out

    def run_window(self, x: Any, spans: Sequence[Span]) -> Any:
        b = self.b
        kv_spans = [Span(sp.cache.kv, sp.start, sp.count, sp.long_prompt) for sp in spans]
        positions = b.begin_window(kv_spans)
        rows, off = [], 0
        for sp in spans:
            rows.append(sp.cache.table_row(off, sp.count))
            off += sp.count
        table = b.asarray(np.asarray(rows, np.int32))  # one upload per window, every layer reads it
        y = None
        for layer in self.layers:
            x, y = layer.run(x, y, spans, kv_spans, positions, table)
        b.end_blocks()
        return b.add_rms_norm(x, y, self.output_norm, self.cfg.rms_eps)[1]

    def logits(self, hidden: Any) -> Any:
        return self.b.linear(self.output, hidden)

    # --- the MTP draft (strata.mtp.draft) ---------------------------------------------------
    def draft_parts(self, cfg: ModelConfig, get: TensorLookup, prefix: str) -> tuple[ModelConfig, Any, Any]:
        """The nextn layer: a gated-attention layer with this model's FFN, at KV layer 0 of the
        draft's own cache. -> (config, block weights (unused: the layer holds them), runner)."""
        layer = HybridLayer(self.b, cfg, get, prefix, self.rope, recurrent=False, index=0)
        return cfg, None, layer
