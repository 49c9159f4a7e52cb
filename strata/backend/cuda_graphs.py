"""CUDA graphs for decode and verification windows.

A window of a small model is hundreds of short kernels; launched one by one from Python it
costs ~20 us of host time each, far more than the GPU work. So the first window of each
shape (tokens, spans, attention splits, KV kind) runs once eagerly and is then captured into
a CUDA graph; later windows of that shape copy their inputs into the graph's own buffers and
replay it in one launch.

What makes a window replayable: the model code reads nothing per window from the host
(positions, which cache a token belongs to, cache lengths and addresses all come from the
window table on the device, see strata/kernels/cuda/fused.cu), and every buffer the graph
touches outlives it. CuPy has no graph-private memory pool, so the runner brings its own: a
MemoryPool used only while warming up and capturing. The warm-up run allocates from it
exactly what the capture will ask for, so no memory is allocated during capture, and no
array outside the graphs is ever handed memory a graph writes. Graphs share that pool: they
run one at a time on one stream and each replay's output is copied out before the next.

Which shapes are captured, and how many are kept, depends on the window's kind (GRAPH_POLICY):
- decode windows (every span one token) are captured at first sight and all kept: there are
  few (slots x attention splits x KV kind) and every step replays one;
- windows with a multi-token span of up to MAX_GRAPH_TOKENS tokens (a short prompt beside the
  decoding slots, a verification window) are captured on their second sighting and at most
  MAX_MIXED_GRAPHS are kept, the least recently replayed dropped first. Prompts arrive at any
  time and of any length, so most such mixes are seen once: capturing each at first sight cost
  two eager runs of host time while the other streams waited (1-3 captures a round of 8
  streaming clients through `strata serve` on the H200, still after 16 rounds), and kept a graph
  per mix for the server's lifetime;
- wide windows (a prompt's chunk, up to STRATA_CUDA_WIDE_GRAPH_TOKENS tokens) likewise, at most
  MAX_WIDE_GRAPHS of them (their buffers are large).
Their prompt rows read where the prompt starts and which cache it fills from the window table
(attention_prefill_window), so a full chunk's graph serves every long prompt of any slot. A
window whose warm-up needed something a graph cannot hold (cuBLAS without Strata's handle for
a long prompt's GEMM rows, an experts' plan by CuPy's sort, a host upload:
cuda_window.Capture.blockers) keeps that shape eager, silently: that is the path it always took.

STRATA_CUDA_GRAPHS=0 turns graphs off (every window eager).
"""

from __future__ import annotations

import gc
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from strata.backend.cuda_window import Capture, TableFeed

GRAPHS_ENV = "STRATA_CUDA_GRAPHS"
# Windows of up to this many tokens are graphed at first sight: decode and MTP verification
# windows of up to 8 slots x (1 + 7 drafts) would be 64.
MAX_GRAPH_TOKENS = 64
# Wide windows up to this many tokens may be graphed (prefill chunks: a --prefill 512 budget's
# full chunk); 0 turns that off.
WIDE_GRAPH_TOKENS_ENV = "STRATA_CUDA_WIDE_GRAPH_TOKENS"
WIDE_GRAPH_TOKENS = 1024
MAX_WIDE_GRAPHS = 4
MAX_MIXED_GRAPHS = 32
SEEN_ONCE_LIMIT = 4096  # shapes remembered as seen once (the oldest forgotten first)

# A wide window is captured only while the device has this much memory free: its graph keeps a
# prompt chunk's activations in the graphs' pool beside the blocks its eager runs left in CuPy's
# (a card filled by its pack and caches keeps its prompt chunks eager, as before graphs took them).
WIDE_GRAPH_MIN_FREE_BYTES = 4 << 30


@dataclass(frozen=True)
class _Policy:
    first_sight: bool  # captured the first time the shape is seen (else the second)
    keep: int | None  # graphs of this kind kept, least recently replayed dropped first (None: all)


GRAPH_POLICY = {"decode": _Policy(True, None), "mixed": _Policy(False, MAX_MIXED_GRAPHS),
                "wide": _Policy(False, MAX_WIDE_GRAPHS)}


def window_kind(spans: Sequence[Any]) -> str:
    counts = [int(sp.count) for sp in spans]
    if sum(counts) > MAX_GRAPH_TOKENS:
        return "wide"
    return "decode" if max(counts) == 1 else "mixed"


@dataclass
class _Graph:
    graph: Any
    inputs: dict[str, Any]  # name -> the buffer the graph reads (token ids, hidden rows, ...)
    outputs: tuple[Any, ...]  # the arrays the graph writes
    packed: Any  # one int64 device buffer: the window table, then every host int64 input (views of it)
    packed_names: tuple[str, ...]  # the host int64 inputs inside `packed`, in order


def _packed_names(inputs: dict[str, Any]) -> tuple[str, ...]:
    """The inputs that travel in the packed buffer: host int64 arrays (ids, rows, ...). One
    host-to-device copy per replay instead of one per input (~10 us of host time each)."""
    return tuple(k for k, v in inputs.items() if isinstance(v, np.ndarray) and v.dtype == np.int64)


def _pack(table: np.ndarray, inputs: dict[str, Any], names: tuple[str, ...]) -> np.ndarray:
    return np.concatenate([table.reshape(-1)] + [inputs[k].reshape(-1) for k in names])


class WindowGraphs:
    def __init__(self, backend: Any):
        cp = backend.xp
        self.b = backend
        # a blocking stream: ordered with the legacy stream the rest of the engine uses, so
        # inputs written before a replay and outputs read after it need no events
        self.stream = cp.cuda.Stream(non_blocking=False)
        self.pool = cp.cuda.MemoryPool()
        self.graphs: dict[tuple, _Graph | None] = {}  # None: capture failed, that shape runs eagerly
        self.replays = 0
        self.wide_tokens = int(os.environ.get(WIDE_GRAPH_TOKENS_ENV, WIDE_GRAPH_TOKENS))
        self.seen_once: OrderedDict[tuple, None] = OrderedDict()  # shapes captured when seen again
        self.held: dict[str, OrderedDict[tuple, None]] = {kind: OrderedDict() for kind, p in GRAPH_POLICY.items()
                                                          if p.keep is not None}  # least recent first
        self.captures = 0
        self.kept_eager: list[tuple[int, tuple[str, ...]]] = []  # (tokens, blockers) of shapes kept eager
        self.failures: list[str] = []  # one line per failed capture (also written to stderr)

    def takes(self, spans: Sequence[Any], wide: bool = False) -> bool:
        """Whether a window of these spans runs through the graphs. wide: the caller's window
        may be a prompt's chunk (the main model's forward); the draft's steps keep to decode
        sizes."""
        n = sum(int(sp.count) for sp in spans)
        limit = max(MAX_GRAPH_TOKENS, self.wide_tokens) if wide else MAX_GRAPH_TOKENS
        return 0 < n <= limit and self.b.caches_on_device(spans)

    def run(self, model: Any, tokens: Any, spans: Sequence[Any], logit_rows: Any = None) -> Any:
        """The main model's window as Transformer.forward returns it: final-normed hidden
        states (n, n_embd), and with logit_rows the logits of those rows too (head in the graph)."""
        b = self.b
        if model.embd.blocks is not None:  # embedding gathered on the device: ids are the input
            inputs = {"tokens": np.asarray(tokens, np.int64)}
        else:
            inputs = {"x": b.embed_host(model.embd, tokens)}
        if logit_rows is not None:
            inputs["rows"] = np.asarray(logit_rows, np.int64)

        def window(d):
            x = b.embed(model.embd, d["tokens"]) if "tokens" in d else d["x"]
            h = model.run_window(x, spans)
            return (h, model.logits(h[d["rows"]])) if "rows" in d else (h,)

        # the logits go to the host at once: lent, not copied
        outs = self.run_fn(("model", id(model)), window, inputs, spans, borrow=(False, True))
        return outs if logit_rows is not None else outs[0]

    def run_fn(self, owner: tuple, window, inputs: dict[str, Any], spans: Sequence[Any],
               borrow: tuple[bool, ...] = (), more: Sequence[Sequence[Any]] = ()) -> tuple[Any, ...]:
        """Run window(device inputs) -> tuple of device arrays for these spans: eagerly and
        captured the first time a shape is seen, replayed after. inputs: name -> numpy or
        cupy array (their shapes are part of the key). Arrays out are fresh copies, except
        output i with borrow[i] true: the graph's own buffer, valid until its next replay
        (for results read at once, e.g. copied to the host). more: the spans of further
        windows the function begins after the first, in order (a chain of draft steps in one
        graph); every window's table is worked out here, on the host, before the replay."""
        b = self.b
        windows = [spans, *more]
        tables = [b.window_table(w) for w in windows]  # builds cache tables here, never during capture
        table = tables[0] if len(tables) == 1 else np.concatenate(tables)
        parts, off = [], 0
        for w, t in zip(windows, tables):
            parts.append((off, len(t), b.splits_for(w)))
            off += len(t)
        shapes = tuple((k, v.shape, str(v.dtype)) for k, v in inputs.items())
        key = (owner, shapes, tuple(len(w) for w in windows), tuple(p[2] for p in parts), spans[0].cache.kind,
               tuple(b.prompt_layout(w) for w in windows))
        kind = window_kind(spans)
        held = self.held.get(kind)
        with self.stream:
            if key not in self.graphs:
                if not GRAPH_POLICY[kind].first_sight and key not in self.seen_once:  # eager, remembered
                    self.seen_once[key] = None
                    if len(self.seen_once) > SEEN_ONCE_LIMIT:
                        self.seen_once.popitem(last=False)
                    return self._eager(window, inputs, table, parts)
                if kind == "wide" and (b.free_bytes() or 0) < WIDE_GRAPH_MIN_FREE_BYTES:  # too little memory left
                    self.graphs[key] = None
                    self.kept_eager.append((sum(int(sp.count) for sp in spans), ("device memory",)))
                    return self._eager(window, inputs, table, parts)
                g, outs = self._capture(window, inputs, spans, table, parts)
                self.graphs[key] = g
                self.captures += 1
                if held is not None and g is not None:
                    self._hold(kind, key)
                return outs
            g = self.graphs[key]
            if g is None:
                return self._eager(window, inputs, table, parts)
            if held is not None:
                held.move_to_end(key)
            for k, v in inputs.items():
                if k in g.packed_names:
                    continue
                if isinstance(v, np.ndarray):
                    g.inputs[k].set(v)
                else:
                    g.inputs[k][...] = v  # device to device, on this stream (ordered after v's writer)
            g.packed.set(_pack(table, inputs, g.packed_names))
            g.graph.launch(stream=self.stream)
            self.replays += 1
            lend = borrow + (False,) * (len(g.outputs) - len(borrow))
            return tuple(o if keep else o.copy() for o, keep in zip(g.outputs, lend))

    def _hold(self, kind: str, key: tuple) -> None:
        """Keep the new graph; past its kind's limit drop the least recently replayed (a shape
        that returns is captured again: it is still marked seen)."""
        held = self.held[kind]
        held[key] = None
        while len(held) > GRAPH_POLICY[kind].keep:
            old, _ = held.popitem(last=False)
            del self.graphs[old]

    def _capture(self, window, inputs: dict[str, Any], spans: Sequence[Any], table: Any, parts: list):
        cp, b = self.b.xp, self.b
        # the graph's own input buffers: the table and the host int64 inputs as views of one
        names = _packed_names(inputs)
        packed = cp.asarray(_pack(table, inputs, names))
        win = packed[: table.size].reshape(table.shape)
        static, off = {}, table.size
        for k, v in inputs.items():
            if k in names:
                static[k] = packed[off : off + v.size].reshape(v.shape)
                off += v.size
            else:
                static[k] = cp.array(v)
        b.capture = Capture(active=True, feed=TableFeed(win, parts))
        try:
            with cp.cuda.using_allocator(self.pool.malloc):
                warm = window(static)  # the real result, and the pool's blocks
            outs = tuple(o.copy() for o in warm)  # outside the pool: the caller keeps them
            del warm
            b.win.drop_shared()  # would pin pool blocks the capture expects free
            if b.capture.blockers:  # this shape takes a path no graph holds: it stays eager
                self.kept_eager.append((sum(int(sp.count) for sp in spans), tuple(sorted(b.capture.blockers))))
                return None, outs
            # no garbage collection inside the capture: collecting an earlier backend's graphs or
            # memory pool frees device memory (cudaFree), which invalidates a capture (the likely
            # cause of one capture in a test run on the H200 that failed with "capture invalidated")
            collecting = gc.isenabled()
            gc.disable()
            try:
                b.capture.feed.next = 0
                with cp.cuda.using_allocator(self.pool.malloc):
                    self._begin_capture()
                    try:
                        gouts = window(static)
                    finally:
                        graph = self.stream.end_capture()
            except Exception as e:  # a setup whose CuPy/driver cannot capture this window:
                # its result is already computed (warm-up); this shape runs eagerly from now on
                line = (f"strata: CUDA graph capture of a {sum(sp.count for sp in spans)}-token window failed "
                        f"({type(e).__name__}: {e}); windows of that shape run without a graph")
                self.failures.append(line)
                sys.stderr.write(line + "\n")
                return None, outs
            finally:
                b.win.drop_shared()
                if collecting:
                    gc.enable()
        finally:
            b.capture = Capture()
        return _Graph(graph, static, gouts, packed, names), outs

    def _begin_capture(self) -> None:
        self.stream.begin_capture()

    def _eager(self, window, inputs: dict[str, Any], table: Any, parts: list) -> tuple[Any, ...]:
        """A window of a shape that could not be captured: the same calls, launched one by one."""
        cp, b = self.b.xp, self.b
        b.capture.feed = TableFeed(cp.asarray(table), parts)
        try:
            return tuple(window({k: cp.asarray(v) for k, v in inputs.items()}))
        finally:
            b.capture.feed = None
