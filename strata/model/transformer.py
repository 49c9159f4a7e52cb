"""The model, whatever its architecture: embedding, its blocks, final norm and head, written
against a Backend. Which layers a block stacks is its architecture's business
(strata/model/archs/: ARCHS[cfg.arch].block); nothing here names one.

One forward runs a *window*: the new tokens of one or more sequences, each a contiguous span of
positions appended to that sequence's state. Matrix work is batched over the whole window;
attention runs per span over its own KV cache, a Gated DeltaNet layer per span over its own
recurrent state. A model without recurrent layers keeps a KVCache per sequence; one with them a
HybridCache (recurrent_state.py), whose states a window writes to their second copy and commits
when the whole forward has run, so that truncate can roll both back. Windows, spans and CUDA
graphs live here and never in an architecture's file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from strata.backend.base import Backend
from strata.errors import StrataError
from strata.model.archs import ARCHS
from strata.model.kv_cache import KVCache
from strata.model.layers.block import Block, WindowView
from strata.model.layers.hparams import ModelConfig
from strata.model.layers.rope import rope_params
from strata.model.layers.tensors import Reader, TensorLookup, expect
from strata.model.recurrent_state import REPLAY_TOKENS, HybridCache, RecurrentPool, recurrent_shape

__all__ = ["Span", "TensorLookup", "Transformer", "advance", "load_embedding", "load_head", "reserve"]


@dataclass
class Span:
    """One sequence's tokens in a window: positions [start, start + count) of `cache`.

    long_prompt: these are rows of a prompt long enough (Backend.long_prompt_tokens) for the
    backend's prompt path (CUDA: dequantized weights + GEMM). The scheduler sets it from the
    request alone, never from what shares the window, so a row's arithmetic stays the same
    whatever it is batched with."""

    cache: Any  # a SequenceState (state.py): KVCache or HybridCache
    start: int
    count: int
    long_prompt: bool = False


def reserve(spans: Sequence[Span]) -> None:
    """Before a window: each span must start where its cache ends; the caches get room."""
    for sp in spans:
        if sp.start != sp.cache.length:
            raise RuntimeError(f"span starts at {sp.start} but its cache holds {sp.cache.length}")
        sp.cache.ensure(sp.start + sp.count)


def advance(spans: Sequence[Span]) -> None:
    """After a window: each cache holds its span's positions."""
    for sp in spans:
        sp.cache.length = sp.start + sp.count


def load_embedding(model: Any, backend: Backend, cfg: ModelConfig, get: TensorLookup) -> None:
    """The token embedding (model.embd, .embd_source, .n_vocab), its shape checked."""
    E = cfg.n_embd
    emb = expect(get("token_embd.weight"), "token_embd.weight", None)
    if emb.shape[0] != E:
        raise StrataError(f"tensor token_embd.weight has shape {list(emb.shape)} but the metadata implies [{E}, *]")
    if cfg.vocab_size and emb.shape[1] != cfg.vocab_size:
        raise StrataError(
            f"tensor token_embd.weight has shape {list(emb.shape)} but the metadata implies [{E}, {cfg.vocab_size}]"
        )
    model.n_vocab = emb.shape[1]
    model.embd = backend.embedding(emb)
    model.embd_source = emb


def load_head(model: Any, backend: Backend, cfg: ModelConfig, get: TensorLookup) -> None:
    """The final norm and output head (model.output_norm, .output, .output_source); a pack
    without output.weight ties the head to the embedding."""
    model.output_norm = backend.vector(expect(get("output_norm.weight"), "output_norm.weight", (cfg.n_embd,)))
    out = get("output.weight")
    model.output_source = out if out is not None else model.embd_source
    model.output = backend.linear_weight([model.output_source])


class Transformer:
    # An MTP draft's block (attention and an FFN, no recurrent state) may replay captured graphs.
    draft_graphable = True

    def __init__(self, backend: Backend, cfg: ModelConfig, get: TensorLookup,
                 progress: Callable[[int, int], None] | None = None):
        self.b = backend
        self.cfg = cfg
        self.spec = ARCHS[cfg.arch]
        self.rope = rope_params(cfg)
        load_embedding(self, backend, cfg, get)
        kinds = cfg.hybrid.recurrent if cfg.hybrid is not None else (False,) * cfg.n_layer
        self.layers: list[Block] = []
        n_rec = n_att = 0
        for i, recurrent in enumerate(kinds):
            index = n_rec if recurrent else n_att  # within its kind: the state's or the KV cache's layer
            self.layers.append(self.spec.block(backend, cfg, Reader(get, f"blk.{i}."), self.rope, i, index))
            n_rec, n_att = n_rec + recurrent, n_att + (not recurrent)
            if progress:
                progress(i + 1, cfg.n_layer)
        self.n_attention = n_att
        self.recurrent_layers = [layer for layer in self.layers if layer.recurrent]
        # Fused drafting (a draft step inside the target's window) is built for attention-only
        # windows; a model with recurrent layers takes graphs of its own windows (forward).
        self.graphable = not self.recurrent_layers
        load_head(self, backend, cfg, get)
        self.replay_tokens = REPLAY_TOKENS
        self.state_shape = recurrent_shape(cfg) if self.recurrent_layers else None
        self.pool: RecurrentPool | None = None  # made with the first cache (replay_tokens is final then)

    # --- per sequence ----------------------------------------------------------------------
    def new_cache(self, max_ctx: int, kind: str, checkpoint: bool = True) -> KVCache | HybridCache:
        """A sequence's state; checkpoint False: one recurrent state copy, no rollback
        (recurrent_state.py; a KV cache always rolls back)."""
        c = self.cfg
        kv = KVCache(self.b.xp, max(1, self.n_attention), c.n_head_kv, c.head_dim, max_ctx, kind)
        if self.state_shape is None:
            return kv
        if self.pool is None:
            self.pool = RecurrentPool(self.b.xp, self.state_shape, self.replay_tokens)
        cache = HybridCache(self.b.xp, kv, self.pool, checkpoint)
        cache.replayer = self._replay
        return cache

    def state_bytes(self, checkpoint: bool = True) -> int:
        """Private bytes per sequence besides its KV cache (the start-up line, docs/MTP.md)."""
        if self.state_shape is None:
            return 0
        return HybridCache.state_bytes(self.state_shape, self.replay_tokens, checkpoint)

    def state_line(self, checkpoint: bool = True) -> str | None:
        """The pieces of a sequence's state beyond the recurrent one, in words for the start-up
        line; None where there are none (a family with more says so: hyper_transformer.py)."""
        return None

    def checkpoint_bytes(self) -> int:
        """What a sequence's rollback copy costs: the second state copy and the replay inputs."""
        if self.state_shape is None:
            return 0
        return HybridCache.checkpoint_bytes(self.state_shape, self.replay_tokens)

    def _replay(self, cache: HybridCache, inputs: list[Any]) -> None:
        for layer, kept in zip(self.recurrent_layers, inputs):
            layer.mixer.replay(cache, layer.index, kept)

    # --- windows ---------------------------------------------------------------------------
    def forward(self, tokens: Any, spans: Sequence[Span], logit_rows: Any = None) -> Any:
        """Run a window; returns the final-normed hidden states (n, n_embd), or with
        `logit_rows` (row indices) the pair (hidden, logits of those rows).

        Caches advance: each span's cache.length becomes start + count; recurrent states commit
        only once the whole window has run (a failure leaves every sequence as it was). A
        backend with window graphs (CUDA) replays a captured graph of the window (head
        included) for windows it takes."""
        reserve(spans)
        if self.recurrent_layers:
            out = self._forward_recurrent(tokens, spans, logit_rows)
        else:
            out = self._forward_kv(tokens, spans, logit_rows)
        advance(spans)
        return out

    def _forward_kv(self, tokens: Any, spans: Sequence[Span], logit_rows: Any) -> Any:
        b = self.b
        graphs = b.graphs
        if graphs is not None and graphs.takes(spans, wide=True):
            return graphs.run(self, tokens, spans, logit_rows)
        out = self.run_window(b.embed(self.embd, tokens), spans)
        if logit_rows is not None:
            out = (out, self.logits(out[b.xp.asarray(np.asarray(logit_rows, np.int64))]))
        return out

    def _forward_recurrent(self, tokens: Any, spans: Sequence[Span], logit_rows: Any) -> Any:
        """The window's recurrent table, like the KV window table, is an input read on the
        device, so a backend with DeltaNet kernels captures these windows too."""
        b = self.b
        for sp in spans:
            sp.cache.begin(sp.start, sp.count)
        kv_spans = [Span(sp.cache.kv, sp.start, sp.count, sp.long_prompt) for sp in spans]
        rows, off = [], 0
        for sp in spans:
            rows.append(sp.cache.table_row(off, sp.count))
            off += sp.count
        table = np.asarray(rows, np.int64)
        graphs = b.graphs
        if graphs is not None and b.delta_net_kernels(self.cfg.hybrid) and graphs.takes(kv_spans, wide=True):
            out = self._graphed(graphs, tokens, spans, kv_spans, table, logit_rows)
        else:
            out = self.run_window(b.embed(self.embd, tokens), spans, kv_spans, b.asarray(table))
            if logit_rows is not None:
                out = (out, self.logits(out[b.xp.asarray(np.asarray(logit_rows, np.int64))]))
        for sp in spans:
            sp.cache.commit()
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

    def run_window(self, x: Any, spans: Sequence[Span], kv_spans: Sequence[Span] | None = None,
                   table: Any = None) -> Any:
        """The device work of a window from its embedded tokens x (n, n_embd): blocks, then the
        final norm. Reads spans on the host only for what a window's shape fixes (what a graph
        captures): positions through b.begin_window, recurrent cells, copies and rows from `table`."""
        x, y = self.run_blocks(x, spans, kv_spans, table)
        return self.b.add_rms_norm(x, y, self.output_norm, self.cfg.rms_eps)[1]

    def run_blocks(self, x: Any, spans: Sequence[Span], kv_spans: Sequence[Span] | None = None,
                   table: Any = None) -> tuple[Any, Any]:
        """All blocks; the residual stream after the last one is x + y (layers/block.py).
        kv_spans: the spans over the sequences' KV caches (default: spans themselves)."""
        kv_spans = spans if kv_spans is None else kv_spans
        w = WindowView(spans, kv_spans, self.b.begin_window(kv_spans), table)
        y = None
        for layer in self.layers:
            x, y = layer.run(x, y, w)
        self.b.end_blocks()
        return x, y

    def logits(self, hidden: Any) -> Any:
        return self.b.linear(self.output, hidden)

    def head_input(self, hidden: Any) -> Any:
        """What the output head reads from forward's hidden rows (n, n_embd): the rows themselves,
        already final-normed (an embedding request averages these)."""
        return hidden

    # --- the MTP draft (strata.mtp.draft) ---------------------------------------------------
    def draft_parts(self, cfg: ModelConfig, get: TensorLookup, prefix: str) -> tuple[ModelConfig, Block]:
        """An MTP draft's block, built by this architecture from the same layers as its own
        (ArchSpec.draft_block), at KV layer 0 of the draft's cache. -> (the draft's config, block)."""
        return self.spec.draft_block(self.b, cfg, get, prefix, self.rope)
