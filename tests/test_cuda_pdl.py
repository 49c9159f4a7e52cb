"""Programmatic dependent launch (strata/kernels/cuda/launch.py, pdl.cuh), on a GPU.

Captured in a CUDA graph, the MMVQ, quantization and fused launches may start while the kernel
before them runs; each must still read the activations (and expert ids) that kernel writes. A chain in which every
launch consumes the previous one's output is captured, its buffers poisoned, and the replay
must give the eager run's bits exactly. Kernels start early enough to read a stale buffer
only where the wait in pdl.cuh is missing or misplaced: the poison then shows. On sm_90+ the
test checks that the launches really took the PDL path. Skips cleanly without CuPy or a device.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support.gpu import require_cuda  # noqa: E402

cp = require_cuda()

from strata.kernels.cuda import fused  # noqa: E402
from strata.kernels.cuda import launch as pdl  # noqa: E402
from strata.kernels.cuda import experts as gx  # noqa: E402
from strata.kernels.cuda import mmvq as gpu  # noqa: E402
from strata.kernels.ggml_types import type_by_name  # noqa: E402
from strata.kernels.random_blocks import random_blocks  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")
DIM = 2048  # every layer square: each output is the next layer's input
CHAIN = ("Q4_K", "IQ3_S", "Q2_0", "IQ4_NL", "Q8_0", "Q4_K")
N_EXPERT, N_USED, EXPERT_ROWS = 8, 2, 512


def _chain_setup(rng, ncols):
    layers = []
    for name in CHAIN:
        t = type_by_name(name)
        norm = cp.asarray(rng.uniform(0.5, 1.5, DIM).astype(np.float32))
        layers.append((t.id, cp.asarray(random_blocks(t.id, DIM, DIM, rng)), norm))
    experts_t = type_by_name("IQ3_S")
    # the experts' address table is made here, never during the capture
    experts = gx.resident_matrices(cp.asarray(np.stack([random_blocks(experts_t.id, EXPERT_ROWS, DIM, rng)
                                                        for _ in range(N_EXPERT)])))
    x0 = cp.asarray(rng.standard_normal((ncols, DIM)).astype(np.float32))
    return layers, (experts_t.id, experts), x0


def _run_chain(layers, experts, x0, bufs):
    """A residual stream as in a decode window: per layer out = W . q8 (mmvq), then
    x = x + out, its RMSNorm and the norm's Q8_1 blocks for the next layer (add_rms_norm_q8, a
    fused kernel); then expert ids from the last x (an ordinary CuPy kernel), the experts'
    mat-vec, new ids from its output and the gate / up pair kernel over them. Every launch but
    the ids' is a PDL one in the captured graph, each reading what the one before it wrote.
    The fused kernel's and the pair's outputs are allocated by their wrappers (the caller keeps
    them); the rest is preallocated."""
    q8s, outs, ids, eout = bufs
    made = []
    gpu.quantize_q8_1(x0, q8s[0])
    x = x0
    for (tid, w, norm_w), q8, q8_next, out in zip(layers, q8s, q8s[1:], outs):
        gpu.mmvq(tid, w, DIM, DIM, q8, out=out)
        x, h = fused.add_rms_norm_q8(x, out, norm_w, 1e-6, q8_next)
        made += [x, h]
    # ids from the last x: written by an ordinary kernel, read by the experts' launch
    _ids_kernel()(x[:, :N_USED], ids)
    eid, ew = experts
    gx.mmvq_experts(eid, ew, ids, x, out=eout, q8=q8s[-1])
    # and the gate / up pair kernel (the compiler once hoisted its id load above the wait)
    _ids_kernel()(eout[:, 0, :N_USED], ids)
    g, u = gx.mmvq_experts_pair(eid, ew, eid, ew, ids, q8s[-1])
    return outs + made + [g, u], ids, eout


def _ids_kernel():
    # writes into the preallocated ids (CuPy's pool must not hand out memory during capture)
    return cp.ElementwiseKernel("float32 h", "int32 e", f"e = ((int)(fabsf(h) * 1000.0f)) % {N_EXPERT}", "pdl_ids")


def _buffers(ncols):
    q8s = [gpu.empty_q8(ncols, DIM) for _ in range(len(CHAIN) + 1)]
    outs = [cp.empty((ncols, DIM), dtype=cp.float32) for _ in CHAIN]
    ids = cp.empty((ncols, N_USED), dtype=cp.int32)
    eout = cp.empty((ncols, N_USED, EXPERT_ROWS), dtype=cp.float32)
    return q8s, outs, ids, eout


def _poison(bufs):
    q8s, outs, ids, eout = bufs
    for q8 in q8s:
        q8.q.fill(77)
        q8.meta.fill(-1)
    for o in outs:
        o.fill(cp.nan)
    ids.fill(-1)  # an out-of-range id gives NaN rows
    eout.fill(cp.nan)


@pytest.mark.parametrize("ncols", [1, 4])
def test_graph_with_pdl_equals_eager(ncols):
    rng = np.random.default_rng([SEED, ncols])
    layers, experts, x0 = _chain_setup(rng, ncols)
    eager_bufs = _buffers(ncols)
    outs, ids, eout = _run_chain(layers, experts, x0, eager_bufs)
    want = [cp.asnumpy(o) for o in outs] + [cp.asnumpy(ids), cp.asnumpy(eout)]
    assert all(np.isfinite(w).all() for w in want)
    assert want[-2].min() >= 0 and want[-2].max() < N_EXPERT  # the ids

    bufs = _buffers(ncols)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _run_chain(layers, experts, x0, bufs)  # compiled and warm before capture
        stream.synchronize()
        stream.begin_capture()
        outs, ids, eout = _run_chain(layers, experts, x0, bufs)
        graph = stream.end_capture()
    for _ in range(3):
        _poison(bufs)
        for o in outs:  # the outputs allocated in the capture too
            o.fill(cp.nan)
        stream.synchronize()
        graph.launch(stream)
        stream.synchronize()
        got = [cp.asnumpy(o) for o in outs] + [cp.asnumpy(ids), cp.asnumpy(eout)]
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), f"output {i} of the captured chain differs from eager"


def test_pdl_is_used_on_hopper(monkeypatch):
    """On sm_90+ the captured mat-vecs go through cuLaunchKernelEx (so the test above tests
    PDL); eager ones through CuPy."""
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("PDL needs sm_90+")
    if os.environ.get(pdl.PDL_ENV) == "0":
        pytest.skip("PDL switched off by " + pdl.PDL_ENV)
    assert pdl.enabled()
    real, calls = pdl._driver(), []

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(pdl, "_driver", lambda: counting)
    rng = np.random.default_rng([SEED, 99])
    t = type_by_name("Q4_K")
    w = cp.asarray(random_blocks(t.id, 256, 256, rng))
    q8 = gpu.quantize_q8_1(cp.asarray(rng.standard_normal((1, 256)).astype(np.float32)))
    out = cp.empty((1, 256), dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        gpu.mmvq(t.id, w, 256, 256, q8, out=out)
        stream.synchronize()
        assert not calls  # eager: CuPy's own launch
        stream.begin_capture()
        gpu.mmvq(t.id, w, 256, 256, q8, out=out)
        stream.end_capture()
    assert len(calls) == 1
