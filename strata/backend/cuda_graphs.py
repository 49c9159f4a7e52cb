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

STRATA_CUDA_GRAPHS=0 turns graphs off (every window eager).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

GRAPHS_ENV = "STRATA_CUDA_GRAPHS"
# Windows of up to this many tokens replay graphs: decode and MTP verification windows of up
# to 8 slots x (1 + 7 drafts) would be 64; prefill chunks are long and run eagerly.
MAX_GRAPH_TOKENS = 64  # (within graphs, wide windows take MMVQ launches: cuBLAS is not capturable)


def graphs_enabled() -> bool:
    return os.environ.get(GRAPHS_ENV, "1") != "0"


@dataclass
class _Graph:
    graph: Any
    inp: Any  # input buffer: token ids (n,) int64 (embedding gathered on the device) or rows (n, n_embd)
    win: Any  # window table buffer
    out: Any  # the final-normed hidden states the graph writes


class WindowGraphs:
    def __init__(self, backend: Any):
        cp = backend.xp
        self.b = backend
        # a blocking stream: ordered with the legacy stream the rest of the engine uses, so
        # inputs written before a replay and outputs read after it need no events
        self.stream = cp.cuda.Stream(non_blocking=False)
        self.pool = cp.cuda.MemoryPool()
        self.graphs: dict[tuple, _Graph] = {}
        self.replays = 0

    def takes(self, spans: Sequence[Any]) -> bool:
        n = sum(int(sp.count) for sp in spans)
        return 0 < n <= MAX_GRAPH_TOKENS and self.b._cuda_caches(spans)

    def run(self, model: Any, tokens: Any, spans: Sequence[Any]) -> Any:
        """The window's final-normed hidden states (n, n_embd), caches written, as
        model.run_window computes them."""
        b = self.b
        table = b.window_table(spans)  # builds cache tables here, never during capture
        splits = b.splits_for(spans)
        on_device = model.embd.blocks is not None
        inp = np.asarray(tokens, np.int64) if on_device else b.embed_host(model.embd, tokens)
        key = (id(model), inp.shape[0], len(spans), splits, spans[0].cache.kind)
        g = self.graphs.get(key)
        with self.stream:
            if g is None:
                g, out = self._capture(model, spans, table, inp, splits)
                self.graphs[key] = g
                return out
            g.inp.set(inp)
            g.win.set(table)
            g.graph.launch(stream=self.stream)
            self.replays += 1
            return g.out.copy()

    def _capture(self, model: Any, spans: Sequence[Any], table: Any, inp_host: Any, splits: int):
        cp, b = self.b.xp, self.b
        inp = cp.asarray(inp_host)
        win = cp.asarray(table)

        def window():
            x = b.embed(model.embd, inp) if inp.ndim == 1 else inp
            return model.run_window(x, spans)

        b._win_static, b.splits, b.capturing = win, splits, True
        try:
            with cp.cuda.using_allocator(self.pool.malloc):
                warm = window()  # the real result, and the pool's blocks
            out = warm.copy()  # outside the pool: the caller keeps it
            del warm
            b._q8_memo = None  # would pin a pool block the capture expects free
            with cp.cuda.using_allocator(self.pool.malloc):
                self.stream.begin_capture()
                try:
                    gout = window()
                finally:
                    graph = self.stream.end_capture()
            b._q8_memo = None
        finally:
            b._win_static, b.capturing = None, False
        return _Graph(graph, inp, win, gout), out
