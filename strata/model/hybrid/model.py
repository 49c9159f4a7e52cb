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


def recurrent_shape(cfg: ModelConfig) -> RecurrentShape:
    """A sequence's recurrent state, from the config alone (`strata probe` sizes it unloaded)."""
    h = cfg.hybrid
    return RecurrentShape(n_layer=h.n_recurrent, conv_rows=h.d_conv - 1, channels=h.conv_dim,
                          heads=h.n_v_heads, head_v=h.d_state, head_k=h.d_state,
                          replay_width=DeltaNet.replay_width(cfg))


def rope_of(cfg: ModelConfig) -> RopeParams:
    h = cfg.hybrid
    return RopeParams(cfg.rope_base, cfg.rope_dim, cfg.rope_scale, True, frozen_rope_pairs(h.sections, cfg.rope_dim))


class HybridModel:
    # Fused drafting (a draft step inside the target's window) is built for Transformer windows
    # only; this model's own windows take graphs by themselves (forward, with DeltaNet kernels).
    graphable = False
    # The nextn draft is a gated-attention layer with this model's FFN and no recurrent state: its
    # steps (and a chain of k greedy steps) replay captured graphs like a Transformer draft's.
    draft_graphable = True

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
        self.state_shape = recurrent_shape(cfg)
        self.pool: RecurrentPool | None = None  # made with the first cache (replay_tokens is final then)

    # --- per sequence ----------------------------------------------------------------------
    def new_cache(self, max_ctx: int, kind: str, checkpoint: bool = True) -> HybridCache:
        """A sequence's cache; checkpoint False: one state copy, no rollback (recurrent_state.py)."""
        c = self.cfg
        kv = KVCache(self.b.xp, max(1, self.n_attention), c.n_head_kv, c.head_dim, max_ctx, kind)
        if self.pool is None:
            self.pool = RecurrentPool(self.b.xp, self.state_shape, self.replay_tokens)
        cache = HybridCache(self.b.xp, kv, self.pool, checkpoint)
        cache.replayer = self._replay
        return cache

    def state_bytes(self, checkpoint: bool = True) -> int:
        """Private bytes per sequence besides its KV cache (the start-up line, docs/MTP.md)."""
        return HybridCache.state_bytes(self.state_shape, self.replay_tokens, checkpoint)

    def checkpoint_bytes(self) -> int:
        """What a sequence's rollback copy costs: the second state copy and the replay inputs."""
        return HybridCache.checkpoint_bytes(self.state_shape, self.replay_tokens)

    def _replay(self, cache: HybridCache, inputs: list[Any]) -> None:
        for layer, kept in zip(self.recurrent_layers, inputs):
            layer.mixer.replay(cache, layer.index, kept)

    # --- windows ---------------------------------------------------------------------------
    def forward(self, tokens: Any, spans: Sequence[Span], logit_rows: Any = None) -> Any:
        """As Transformer.forward: final-normed hidden states (n, n_embd), or with logit_rows the
        pair (hidden, logits of those rows). The caches advance and their states commit only
        once the whole window has run (a failure leaves every sequence as it was). On a backend
        with window graphs and DeltaNet kernels (CUDA) the window replays a captured graph: the
        recurrent table, like the KV window table, is an input read on the device."""
        b = self.b
        reserve(spans)
        for sp in spans:
            sp.cache.begin(sp.start, sp.count)
        kv_spans = [Span(sp.cache.kv, sp.start, sp.count, sp.long_prompt) for sp in spans]
        rows, off = [], 0
        for sp in spans:
            rows.append(sp.cache.table_row(off, sp.count))
            off += sp.count
        table = np.asarray(rows, np.int64)
        graphs = getattr(b, "graphs", None)
        if graphs is not None and b.delta_net_kernels(self.cfg.hybrid) and graphs.takes(kv_spans, wide=True):
            out = self._graphed(graphs, tokens, spans, kv_spans, table, logit_rows)
        else:
            out = self.run_window(b.embed(self.embd, tokens), spans, kv_spans, b.asarray(table))
            if logit_rows is not None:
                out = (out, self.logits(out[b.xp.asarray(np.asarray(logit_rows, np.int64))]))
        for sp in spans:
            sp.cache.commit()
        advance(spans)
        return out

    def _graphed(self, graphs: Any, tokens: Any, spans: Sequence[Span], kv_spans: Sequence[Span],
                 table: np.ndarray, logit_rows: Any) -> Any:
        b = self.b
        if self.embd.blocks is not None:  # embedding gathered on the device: ids are the input
            inputs = {"tokens": np.asarray(tokens, np.int64)}
        else:
            inputs = {"x": b.embed_host(self.embd, tokens)}
        inputs["recurrent"] = table
        if logit_rows is not None:
            inputs["rows"] = np.asarray(logit_rows, np.int64)

        def window(d):
            x = b.embed(self.embd, d["tokens"]) if "tokens" in d else d["x"]
            h = self.run_window(x, spans, kv_spans, d["recurrent"])
            return (h, self.logits(h[d["rows"]])) if "rows" in d else (h,)

        outs = graphs.run_fn(("hybrid", id(self)), window, inputs, kv_spans, borrow=(False, True))
        return outs if logit_rows is not None else outs[0]

    def run_window(self, x: Any, spans: Sequence[Span], kv_spans: Sequence[Span], table: Any) -> Any:
        """The device work of a window: layers, then the final norm. Reads spans on the host
        only for what a window's shape fixes; cells, copies and rows come from `table`."""
        b = self.b
        positions = b.begin_window(kv_spans)
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
