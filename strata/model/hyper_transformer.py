"""The model of an architecture whose residual is hyper-connection streams (qwen4exp: ArchSpec
.residual_streams), on Transformer's interface (forward, logits, caches, the replay of recurrent
layers), so that the engine, the scheduler and speculation run it unchanged.

A window: each sequence's token ids are stored in its state (the n-gram layers read them), the
embedding is copied into every stream (transformers models/qwen4_exp/modeling_qwen4_exp.py:1463),
the architecture's layers run on the streams (ArchSpec.block: run(X, spans, positions, table)),
and the window's hidden rows are the streams after the last layer, (n, c n_embd): what the MTP
layer reads (vLLM keeps the same "pre-final-mixer multi stream" for its drafter:
vllm/models/qwen4_exp/nvidia/model.py, Qwen4ExpModel.forward). `logits` applies the head's mix
(layers/hyper_connections.py) and the output projection to them. A sequence's state is a
Qwen4ExpCache (qwen4exp_state.py): the KV cache, the Gated DeltaNet states, the indexer keys, the
ids and the PLE history, all committed once the whole window has run and rolled back together;
the MTP layer's is an MtpState (draft_cache). Windows run eagerly (no captured graphs).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import numpy as np

from strata.backend.base import Backend
from strata.gguf.row_source import HostTables
from strata.model.archs import ARCHS
from strata.model.kv_cache import KVCache
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.hyper_connections import HyperMix
from strata.model.layers.rope import rope_params
from strata.model.layers.tensors import Reader, TensorLookup
from strata.model.qwen4exp_state import MtpState, Qwen4ExpCache
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
    """Module doc. `say` takes the load's notes (default: stderr); `tables` reads the tensors that
    stay on the host (the n-gram table) by rows, in the mode --ple-io picks (default: mmap)."""

    draft_graphable = False

    def __init__(self, backend: Backend, cfg: ModelConfig, get: TensorLookup,
                 progress: Callable[[int, int], None] | None = None, say: Callable[[str], None] | None = None,
                 tables: HostTables | None = None):
        b, h = backend, cfg.hybrid
        tables = tables if tables is not None else HostTables()  # (one for every layer: a shared table opens once)
        self.b, self.cfg, self.spec = b, cfg, ARCHS[cfg.arch]
        self.rope = rope_params(cfg)
        load_embedding(self, b, cfg, get)
        self.layers: list[Any] = []
        n_rec = n_att = 0
        for i, rec in enumerate(h.recurrent):
            index = n_rec if rec else n_att
            self.layers.append(self.spec.block(b, cfg, Reader(get, f"blk.{i}.", tables), self.rope, i, index))
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

    # --- what a sequence keeps beside its KV cache (the engine's start-up lines) ------------
    def _ple_bytes(self, checkpoint: bool) -> int:
        """The PLE history (Qwen4ExpConfig.extra_state_bytes)."""
        return self.cfg.hybrid.extra_state_bytes(self.cfg.n_embd, self.replay_tokens, checkpoint)

    def state_bytes(self, checkpoint: bool = True) -> int:
        """Private bytes per sequence besides what grows with its length: the DeltaNet states
        (Transformer.state_bytes) and the PLE history."""
        return super().state_bytes(checkpoint) + self._ple_bytes(checkpoint)

    def checkpoint_bytes(self) -> int:
        return super().checkpoint_bytes() + self._ple_bytes(True) - self._ple_bytes(False)

    def position_bytes(self) -> int:
        """What one more position costs a sequence beside its KV cache
        (Qwen4ExpConfig.extra_position_bytes)."""
        return self.cfg.hybrid.extra_position_bytes(self.n_attention)

    def state_line(self, checkpoint: bool = True) -> str:
        """The state a slot keeps, in words (the start-up line of this family)."""
        h, MiB = self.cfg.hybrid, float(1 << 20)
        rec = Transformer.state_bytes(self, checkpoint)
        return (f"{h.n_recurrent} Gated DeltaNet layers {rec / MiB:.1f} MiB, PLE history "
                f"{self._ple_bytes(checkpoint) / 1024:.1f} KiB ({h.ple_history_rows} rows of {h.hc_count} streams); "
                f"per position beside the KV cache of {self.n_attention} attention layers: indexer keys and the "
                f"token id, {self.position_bytes()} bytes")

    def draft_cache(self, max_ctx: int, kind: str) -> MtpState:
        """The MTP layer's state for one sequence (its attention layer's KV and indexer keys)."""
        c = self.cfg
        return MtpState(self.b.xp, KVCache(self.b.xp, 1, c.n_head_kv, c.head_dim, max_ctx, kind), c.hybrid.idx_dim)

    def forward(self, tokens: Any, spans: Sequence[Span], logit_rows: Any = None) -> Any:
        """Transformer.forward's contract, where the hidden rows are the streams after the last
        layer, (n, c n_embd) (what the MTP layer reads; `logits` mixes them), or with logit_rows
        the pair (streams, logits of those rows); every state commits once the whole window has run."""
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
        for sp in spans:
            sp.cache.commit()
        advance(spans)
        out = X.reshape(X.shape[0], -1)
        if logit_rows is not None:
            return out, self.logits(out[xp.asarray(np.asarray(logit_rows, np.int64))])
        return out

    def logits(self, hidden: Any) -> Any:
        """The head on streams rows (n, c n_embd): its mix, then the output projection."""
        return self.b.linear(self.output, self.head_input(hidden))

    def head_input(self, hidden: Any) -> Any:
        """The head's mix of the streams rows (n, c n_embd) -> (n, n_embd): what the output
        projection reads and what an embedding request averages."""
        c = self.cfg.hybrid.hc_count
        return self.head_mix.read(hidden.reshape(hidden.shape[0], c, -1))[0]

    def run_window(self, x: Any, spans: Sequence[Span], kv_spans: Sequence[Span] | None = None,
                   table: Any = None) -> Any:
        raise NotImplementedError("hyper-connection models run windows through forward (their layers read token ids)")
