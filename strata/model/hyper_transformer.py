"""The model of an architecture whose residual is hyper-connection streams (qwen4exp: ArchSpec
.residual_streams), on Transformer's interface (forward, logits, caches, the replay of recurrent
layers), so that the engine, the scheduler and speculation run it unchanged.

A window: each sequence's token ids are stored in its state (the n-gram layers read them), the
embedding is copied into every stream (transformers models/qwen4_exp/modeling_qwen4_exp.py:1463),
the architecture's layers run on the streams (ArchSpec.block: run(X, spans, positions, table)),
and the head's mix (layers/hyper_connections.py) gives the (n, n_embd) rows the output projection
reads. A sequence's state is a Qwen4ExpCache (qwen4exp_state.py): the KV cache, the Gated
DeltaNet states, the indexer keys, the ids and the PLE history, all committed once the whole
window has run and rolled back together. Windows run eagerly (no captured graphs).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np

from strata.backend.base import Backend
from strata.model.archs import ARCHS
from strata.model.kv_cache import KVCache
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.hyper_connections import HyperMix
from strata.model.layers.rope import rope_params
from strata.model.layers.tensors import Reader, TensorLookup
from strata.model.qwen4exp_state import Qwen4ExpCache
from strata.model.recurrent_state import REPLAY_TOKENS, RecurrentPool, recurrent_shape
from strata.model.transformer import Span, Transformer, advance, load_embedding, reserve


def dense_note(cfg: ModelConfig) -> str | None:
    """The one line said at load when no attention layer selects keys (every compress ratio 0)."""
    h = cfg.hybrid
    att = [i for i, rec in enumerate(h.recurrent) if not rec]
    if not att or any(h.compress_ratios[i] for i in att if i < len(h.compress_ratios)):
        return None
    return (f"strata: {cfg.arch}: attention.compress_ratios are 0 on all {len(att)} attention layers: they "
            f"attend to every earlier token, without the indexer's selection (as llama.cpp does; the converter "
            f"writes this when transformers >= 5.23 renamed the layer types)")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class HyperTransformer(Transformer):
    """Module doc. `say` takes the load's notes (default: stderr)."""

    draft_graphable = False

    def __init__(self, backend: Backend, cfg: ModelConfig, get: TensorLookup,
                 progress: Callable[[int, int], None] | None = None, say: Callable[[str], None] | None = None):
        b, h = backend, cfg.hybrid
        self.b, self.cfg, self.spec = b, cfg, ARCHS[cfg.arch]
        self.rope = rope_params(cfg)
        load_embedding(self, b, cfg, get)
        self.layers: list[Any] = []
        n_rec = n_att = 0
        for i, rec in enumerate(h.recurrent):
            index = n_rec if rec else n_att
            self.layers.append(self.spec.block(b, cfg, Reader(get, f"blk.{i}."), self.rope, i, index))
            n_rec, n_att = n_rec + rec, n_att + (not rec)
            if progress:
                progress(i + 1, cfg.n_layer)
        self.n_attention = n_att
        self.recurrent_layers = [layer for layer in self.layers if layer.recurrent]
        self.graphable = False
        self.head_mix = HyperMix(b, Reader(get, ""), "output_hc_", cfg.n_embd, h.hc_count, h.hc_rank, cfg.rms_eps,
                                 inject=False)
        out = get("output.weight")
        self.output_norm = None  # the head's mix stands in for the final norm
        self.output_source = out if out is not None else self.embd_source
        self.output = b.linear_weight([self.output_source])
        self.replay_tokens = REPLAY_TOKENS
        self.state_shape = recurrent_shape(cfg)
        self.pool: RecurrentPool | None = None
        note = dense_note(cfg)
        if note is not None:
            (say or _stderr)(note)

    def new_cache(self, max_ctx: int, kind: str, checkpoint: bool = True) -> Qwen4ExpCache:
        c, h = self.cfg, self.cfg.hybrid
        kv = KVCache(self.b.xp, max(1, self.n_attention), c.n_head_kv, c.head_dim, max_ctx, kind)
        if self.pool is None:
            self.pool = RecurrentPool(self.b.xp, self.state_shape, self.replay_tokens)
        cache = Qwen4ExpCache(self.b.xp, kv, self.pool, checkpoint, n_index_layers=max(1, self.n_attention),
                              index_dim=h.idx_dim, ple_rows=h.ple_history_rows, ple_width=h.hc_count * c.n_embd)
        cache.replayer = self._replay
        return cache

    def forward(self, tokens: Any, spans: Sequence[Span], logit_rows: Any = None) -> Any:
        """Transformer.forward's contract: the head's mix (n, n_embd), or with logit_rows the
        pair (mix, logits of those rows); every state commits once the whole window has run."""
        b, xp = self.b, self.b.xp
        reserve(spans)
        ids = np.asarray(b.to_host(tokens), np.int64).reshape(-1)
        rows, off = [], 0
        for sp in spans:
            sp.cache.begin(sp.start, sp.count)
            sp.cache.write_tokens(sp.start, ids[off : off + sp.count])
            rows.append(sp.cache.table_row(off, sp.count))
            off += sp.count
        table = b.asarray(np.asarray(rows, np.int64))
        positions = b.begin_window(spans)
        x = b.embed(self.embd, tokens)
        X = xp.repeat(x[:, None, :], self.cfg.hybrid.hc_count, axis=1)
        for layer in self.layers:
            X = layer.run(X, spans, positions, table)
        b.end_blocks()
        out = self.head_mix.read(X)[0]
        for sp in spans:
            sp.cache.commit()
        advance(spans)
        if logit_rows is not None:
            return out, self.logits(out[xp.asarray(np.asarray(logit_rows, np.int64))])
        return out

    def run_window(self, x: Any, spans: Sequence[Span], kv_spans: Sequence[Span] | None = None,
                   table: Any = None) -> Any:
        raise NotImplementedError("hyper-connection models run windows through forward (their layers read token ids)")
