"""The CUDA decode-window path: kernels that read positions, spans and cache addresses from
the window table (strata/kernels/cuda/fused.cu), and CUDA graphs of whole windows
(strata/backend/cuda_graphs.py).

Each kernel against the generic array code of base.Backend run with xp = cupy (the path
STRATA_CUDA_FUSED=0 takes), on fresh random inputs, outputs in NaN-poisoned memory:
add+norm within float rounding, their Q8_1 blocks and swiglu+Q8_1 bit-exact; RoPE + cache
append bit-exact in the f16 and int8 caches; attention over the caches within 2e-6 relative
for any number of key splits; MoE routing the same experts. Whole windows of tiny synthetic
packs (llama, qwen3moe): graph replays bit-identical to the same window run eagerly, and
within 2e-4 of the generic path (float weights). Skips cleanly without CuPy or a device.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support.gpu import require_cuda, require_synth_tokenizer, synth_for_gpu

cp = require_cuda()

from strata.backend.base import RopeParams  # noqa: E402
from strata.backend.cuda import CudaBackend  # noqa: E402
from strata.kernels.cuda import mmvq  # noqa: E402
from strata.model.kv_cache import KVCache  # noqa: E402
from strata.model.transformer import Span  # noqa: E402

SEED = int.from_bytes(os.urandom(4), "little")
FUSED = CudaBackend(fused=True)
GENERIC = CudaBackend(fused=False)


def rng_of(name: str):
    return np.random.default_rng([SEED, sum(map(ord, name))])


def poison(nbytes: int) -> None:
    junk = cp.full(nbytes // 4 + 4096, np.nan, dtype=cp.float32)
    del junk


def rel(a, b) -> float:
    a, b = np.asarray(cp.asnumpy(a), np.float64), np.asarray(cp.asnumpy(b), np.float64)
    assert a.shape == b.shape and np.isfinite(a).all()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def same(a, b) -> bool:
    return np.array_equal(cp.asnumpy(a), cp.asnumpy(b))


# 6176 values: 7 per thread of 1024, the last only in warp 0; 16384: the most a block holds in
# registers (fused.ADD_NORM_MAX_N), 16 per thread
@pytest.mark.parametrize("rows,n", [(1, 576), (3, 2048), (2, 4096), (2, 6176), (1, 16384)])
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_q8_bit_exact(rows, n, add):
    rng = rng_of(f"arn{rows}{n}{add}")
    x = cp.asarray(rng.standard_normal((rows, n)).astype(np.float32) * 2)
    y = cp.asarray(rng.standard_normal((rows, n)).astype(np.float32)) if add else None
    w = cp.asarray(rng.standard_normal(n).astype(np.float32))
    poison(6 * x.nbytes)
    xo, h = FUSED.add_rms_norm(x, y, w, 1e-5)
    q8 = FUSED.win.q8_of(h)
    xr, hr = GENERIC.add_rms_norm(x, y, w, 1e-5)
    assert same(xo, xr)
    assert rel(h, hr) < 1e-6  # the sum of squares in another order: float rounding
    xh, wh = cp.asnumpy(xr).astype(np.float64), cp.asnumpy(w).astype(np.float64)
    assert rel(h, xh / np.sqrt((xh * xh).mean(-1, keepdims=True) + 1e-5) * wh) < 1e-6
    ref = mmvq.quantize_q8_1(h)
    assert q8 is not None and same(q8.q, ref.q) and same(q8.meta, ref.meta) and same(q8.s, ref.s)


def test_add_rms_norm_past_the_register_rows_takes_the_generic_path():
    """Rows longer than the kernel holds in registers: the kernel wrapper declines (None) and
    the backend computes the generic add + norm (no Q8_1 memo)."""
    n = FUSED.fk.ADD_NORM_MAX_N + 32
    rng = rng_of("arn-long")
    x = cp.asarray(rng.standard_normal((1, n)).astype(np.float32))
    y = cp.asarray(rng.standard_normal((1, n)).astype(np.float32))
    w = cp.asarray(rng.standard_normal(n).astype(np.float32))
    assert FUSED.fk.add_rms_norm_q8(x, y, w, 1e-5) is None
    xo, h = FUSED.add_rms_norm(x, y, w, 1e-5)
    xr, hr = GENERIC.add_rms_norm(x, y, w, 1e-5)
    # (the backend's generic add + norm runs its fused rms_norm kernel: another summation order)
    assert same(xo, xr) and rel(h, hr) < 1e-6 and FUSED.win.q8_of(h) is None


@pytest.mark.parametrize("rows,cols", [(1, 1536), (5, 64)])
def test_swiglu_q8_bit_exact(rows, cols):
    rng = rng_of(f"swq{rows}{cols}")
    gu = cp.asarray(rng.standard_normal((rows, 2 * cols)).astype(np.float32) * 3)
    poison(4 * gu.nbytes)
    y = FUSED.swiglu(gu[:, :cols], gu[:, cols:])
    q8 = FUSED.win.q8_of(y)
    assert same(y, GENERIC.swiglu(gu[:, :cols], gu[:, cols:]))
    ref = mmvq.quantize_q8_1(y)
    assert q8 is not None and same(q8.q, ref.q) and same(q8.meta, ref.meta)


def _caches(kind, n_kv, d, history, rng, n_layer=2):
    """Two caches per history length with identical contents (random keys and values)."""
    pairs = []
    for L in history:
        a = KVCache(cp, n_layer, n_kv, d, 8192, kind)
        b = KVCache(cp, n_layer, n_kv, d, 8192, kind)
        for c in (a, b):
            c.ensure(L + 8)
        for layer in range(n_layer):
            k = cp.asarray(rng.standard_normal((L, n_kv, d)).astype(np.float32))
            v = cp.asarray(rng.standard_normal((L, n_kv, d)).astype(np.float32))
            for c in (a, b):
                c.write(layer, 0, k, v)
        a.length = b.length = L
        pairs.append((a, b))
    return pairs


@pytest.mark.parametrize("kind", ["f16", "int8"])
@pytest.mark.parametrize("H,n_kv,d,history,counts", [
    (9, 3, 64, [0, 37], [5, 1]),  # prefill-like span + decode span
    (32, 8, 128, [300, 5, 900], [1, 4, 2]),  # verification windows of three slots
    (8, 2, 256, [3000], [3]),  # long cache, head_dim 256
    (4, 2, 96, [40, 600], [2, 1]),  # head_dim 96: 12 threads per row, 21 key groups
    (32, 4, 128, [700, 0], [3, 17]),  # 8 query heads per KV head (seed-moe): a prefill chunk
])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attend_matches_generic(kind, H, n_kv, d, history, counts, neox, qk_norm):
    rng = rng_of(f"att{kind}{H}{d}{history}{neox}{qk_norm}")
    pairs = _caches(kind, n_kv, d, history, rng)
    n = sum(counts)
    qkv = cp.asarray(rng.standard_normal((n, (H + 2 * n_kv) * d)).astype(np.float32))
    q = qkv[:, : H * d].reshape(n, H, d)
    k = qkv[:, H * d : (H + n_kv) * d].reshape(n, n_kv, d)
    v = qkv[:, (H + n_kv) * d :].reshape(n, n_kv, d)
    rope = RopeParams(10000.0, d, 1.0, neox)
    spans_f = [Span(a, a.length, c) for (a, _), c in zip(pairs, counts)]
    spans_g = [Span(b, b.length, c) for (_, b), c in zip(pairs, counts)]
    norms = ()
    if qk_norm:  # qwen3's per-head RMSNorm of q and k, fused into the RoPE kernel on the GPU
        norms = tuple(cp.asarray(rng.standard_normal(d).astype(np.float32)) for _ in range(2)) + (1e-6,)
    pos_g = GENERIC.begin_window(spans_g)
    ref = GENERIC.attend(1, q, k, v, spans_g, pos_g, rope, *norms)
    pos_f = FUSED.begin_window(spans_f)
    assert same(pos_f, pos_g)
    def attend_fused(gqa: bool):
        """One block per query head, or (gqa) one per KV group's heads: must give the same bits."""
        saved = FUSED.gqa_min_tokens, FUSED.gqa_min_heads
        FUSED.gqa_min_tokens, FUSED.gqa_min_heads = (0, 1) if gqa else (1 << 30, 1 << 30)
        try:
            return FUSED.attend(1, q, k, v, spans_f, pos_f, rope, *norms)
        finally:
            FUSED.gqa_min_tokens, FUSED.gqa_min_heads = saved

    for splits in (1, 2, 16):
        FUSED.win.splits = splits
        poison(8 * ref.nbytes)
        by_group = attend_fused(True)
        poison(8 * ref.nbytes)
        got = attend_fused(False)
        # with q/k norms the generic path's norm sums in another order, so k differs in its
        # last bits before attention (measured up to 2.6e-6 on the H200)
        assert rel(got, ref) < (1e-5 if qk_norm else 2e-6), f"splits {splits}"
        assert same(got, by_group), f"splits {splits}: several heads per block differ from one head per block"
        q8, q8_ref = FUSED.win.q8_of(got), mmvq.quantize_q8_1(got)  # the output's Q8_1 blocks, made alongside
        assert q8 is not None and same(q8.q, q8_ref.q) and same(q8.meta, q8_ref.meta), f"splits {splits}"
        if splits > 1:  # the last split block merges (counters) as the separate merge launch does
            counters, FUSED.att_counters = FUSED.att_counters, None
            try:
                merged_apart = FUSED.attend(1, q, k, v, spans_f, pos_f, rope, *norms)
            finally:
                FUSED.att_counters = counters
            assert same(got, merged_apart), f"splits {splits}"
            assert not cp.any(counters), "attention_kv leaves its merge counters zeroed"
    if qk_norm:
        return  # the generic (CuPy) norm sums in another order: k differs in its last bits
    for (a, b), c in zip(pairs, counts):  # the new keys and values, bit for bit
        end = a.length + c
        for arrs in (("_k", "_v") if kind == "f16" else ("_k", "_v", "_ks", "_vs")):
            assert same(getattr(a, arrs)[1][:, :end], getattr(b, arrs)[1][:, :end]), arrs


@pytest.mark.parametrize("n,X,k,norm", [(1, 128, 8, True), (5, 64, 4, False), (3, 4, 2, True), (2, 300, 8, True)])
def test_route_and_combine(n, X, k, norm):
    rng = rng_of(f"route{n}{X}{k}")
    logits = cp.asarray(rng.standard_normal((n, X)).astype(np.float32) * 2)
    ids, w = FUSED.route(logits, k, norm)
    rid, rw = GENERIC.route(logits, k, norm)
    assert same(ids.astype(cp.int64), rid.astype(cp.int64))
    assert rel(w, rw) < 1e-6
    d = cp.asarray(rng.standard_normal((n, k, 96)).astype(np.float32))
    assert rel(FUSED.combine_experts(d, w), GENERIC.combine_experts(d, w)) < 1e-6


def _load(path, backend):
    from strata.model.config import config_from_metadata
    from strata.model.transformer import Transformer
    from strata.pack.loader import open_pack

    pack = open_pack(pack=str(path), native=None, ple_gguf=[])
    return Transformer(backend, config_from_metadata(pack.metadata), lambda name: pack.tensors.get(name))


def _windows(model, windows, kind):
    """Feed windows, each a list of (sequence, token ids[, long prompt]); every window's hidden
    states (host)."""
    caches, outs = {}, []
    for window in windows:
        spans = []
        for seq, ids, *long in window:
            if seq not in caches:
                caches[seq] = model.new_cache(4096, kind)
            c = caches[seq]
            spans.append(Span(c, c.length, len(ids), long_prompt=bool(long and long[0])))
        toks = np.concatenate([np.asarray(ids, np.int64) for _, ids, *_ in window])
        outs.append(cp.asnumpy(model.forward(toks, spans)))
    return outs


def _run(model, kind, script):
    """Windows of random tokens: script is a list of windows, each a list of (sequence, n tokens)."""
    rng = np.random.default_rng(7)
    return _windows(model, [[(seq, rng.integers(0, model.n_vocab, n)) for seq, n in w] for w in script], kind)


SCRIPT = [[(0, 12)], [(0, 1)], [(0, 1)], [(0, 3)], [(0, 1), (1, 9)], [(0, 1), (1, 1)], [(0, 1), (1, 1)],
          [(0, 2), (1, 1), (2, 5)], [(0, 1), (1, 1)], [(0, 1)], [(0, 1)], [(0, 100)], [(0, 1)]]


FLOAT_TYPES = {"attn_q": "F16", "attn_k": "F16", "attn_v": "F16", "attn_output": "F16", "output": "F16"}
FLOAT_FFN = {"llama": ("ffn_gate", "ffn_up", "ffn_down"), "qwen3moe": ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
@pytest.mark.parametrize("kind", ["f16", "int8"])
@pytest.mark.parametrize("weights", ["quantized", "float"])
def test_window_graphs_replay_eager_bits(tmp_path, arch, kind, weights):
    """Graph replays equal the eager windows bit for bit. Against the generic path: float
    weights (no activation quantization) agree to float rounding; quantized weights multiply
    Q8_1 activations, where a last-bit difference upstream can flip a rounding (one step of
    amax / 127) and move a row by ~1e-3, so the bound there is looser."""
    types = None
    if weights == "float":
        types = {**FLOAT_TYPES, **{r: "F16" for r in FLOAT_FFN[arch]}}
    path = synth_for_gpu(tmp_path, arch, types=types)
    graphed = CudaBackend(fused=True)
    assert graphed.graphs is not None
    eager = CudaBackend(fused=True)
    eager.graphs = None
    generic = CudaBackend(fused=False)
    got = _run(_load(path, graphed), kind, SCRIPT)
    ref = _run(_load(path, eager), kind, SCRIPT)
    gen = _run(_load(path, generic), kind, SCRIPT)
    assert graphed.graphs.replays >= 5  # repeated shapes replayed, not re-captured
    # float weights: float rounding, plus the odd f16 / int8 cache rounding a last-bit
    # difference flips (measured on the H200: 2.4e-5..6.8e-5)
    bound = 2e-4 if weights == "float" else 1e-2
    for i, (a, b, c) in enumerate(zip(got, ref, gen)):
        assert np.array_equal(a, b), f"window {i}: graph replay differs from the eager window"
        rows = np.linalg.norm(a - c, axis=1) / np.linalg.norm(c, axis=1)
        assert rel(cp.asarray(a), cp.asarray(c)) < bound, f"window {i}: fused vs generic, rows {np.round(rows, 6)}"


def _feed(model, windows, kind="f16"):
    """windows: lists of (sequence, token ids); returns {sequence: its hidden rows in order}."""
    rows = {}
    for window, h in zip(windows, _windows(model, windows, kind)):
        off = 0
        for seq, ids, *_ in window:
            rows.setdefault(seq, []).append(h[off : off + len(ids)])
            off += len(ids)
    return {k: np.concatenate(v) for k, v in rows.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
@pytest.mark.parametrize("kind", ["f16", "int8"])
def test_batch_invariance(tmp_path, arch, kind):
    """A sequence's hidden states do not depend on what shares its windows (other slots, their
    prefill chunks) nor on how many of its own tokens a window takes (MTP verification): bit
    for bit, graphs on. This is what makes MTP and batching lossless at temperature 0 on the GPU."""
    model = _load(synth_for_gpu(tmp_path, arch), CudaBackend(fused=True))
    rng = np.random.default_rng(11)
    s0 = rng.integers(0, model.n_vocab, 20).tolist()
    s1 = rng.integers(0, model.n_vocab, 300).tolist()
    alone = _feed(model, [[(0, s0[:12])]] + [[(0, [t])] for t in s0[12:]], kind)[0]
    shared = _feed(model, [[(1, s1[:100]), (0, s0[:12])], [(0, s0[12:13]), (1, s1[100:290])],
                           [(0, s0[13:16]), (1, s1[290:291])], [(1, s1[291:293]), (0, s0[16:17])],
                           [(0, s0[17:20])]], kind)[0]
    assert alone.shape == shared.shape
    assert np.array_equal(alone, shared), f"rows differ: {np.nonzero((alone != shared).any(1))[0]}"


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_long_prompt_rows_are_batch_invariant(tmp_path, arch, monkeypatch):
    """Long prompts' rows go through dequant + GEMM in fixed row tiles (the weight floor moved
    to 0 so a tiny pack takes that path): the same bits whether the prompt comes in one window
    or in chunks beside other sequences' decode rows and short prompts; those other rows keep
    the MMVQ bits they have alone; and the GEMM rows stay close to the MMVQ rows (f16 against
    Q8_1 activations)."""
    monkeypatch.setenv("STRATA_CUDA_PREFILL_MIN_WEIGHT", "0")
    backend = CudaBackend(fused=True)
    assert backend.prompt_gemm_min_weight == 0 and backend.long_prompt_tokens == 256
    model = _load(synth_for_gpu(tmp_path, arch), backend)
    rng = np.random.default_rng(12)
    p = rng.integers(0, model.n_vocab, 300).tolist()  # the long prompt (sequence 0)
    s1 = rng.integers(0, model.n_vocab, 30).tolist()  # a short prompt, then decoded (sequence 1)
    whole = _feed(model, [[(0, p, True)]])[0]
    chunked = _feed(model, [[(1, s1[:20]), (0, p[:70], True)], [(0, p[70:75], True), (1, s1[20:21])],
                            [(1, s1[21:24]), (0, p[75:], True)]])  # 70, 5 and 225 rows: other tile offsets
    assert np.array_equal(whole, chunked[0]), f"rows differ: {np.nonzero((whole != chunked[0]).any(1))[0]}"
    alone = _feed(model, [[(1, s1[:20])], [(1, s1[20:21])], [(1, s1[21:24])]])[1]
    assert np.array_equal(alone, chunked[1]), "short-prompt and decode rows changed beside a long prompt's"
    if arch == "qwen3moe":  # its prompt rows' experts took the tensor-core kernel (mmq_grouped)
        assert backend.expert_kernels["mmq_experts_grouped"] > 0
    mmvq_rows = _feed(model, [[(0, p, False)]])[0]
    # f16 vs Q8_1 activations through 2 layers of random weights (a sanity bound: a wrong GEMM
    # gives ~1); measured 0.03-0.052 on the qwen3moe pack, whose top-k routing amplifies rounding
    assert rel(cp.asarray(whole), cp.asarray(mmvq_rows)) < 1e-1


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_long_prompt_attention_on_tensor_cores(tmp_path, arch, monkeypatch):
    """A long prompt's rows attend through attention_prefill (these packs' head sizes, 64 and
    128, have kernels): close to the decode kernel's result (f16 queries and softmax weights
    against fp32), and not equal to it (the other kernel did run). Measured on the H200:
    llama under 0.02, qwen3moe 0.041 (its top-k routing amplifies rounding, as in the test
    above); a wrong kernel gives ~1."""
    path = synth_for_gpu(tmp_path, arch)
    tensor_cores = CudaBackend(fused=True)
    assert tensor_cores.prompt_attention
    monkeypatch.setenv("STRATA_CUDA_PROMPT_ATTENTION", "0")
    decode_kernel = CudaBackend(fused=True)
    assert not decode_kernel.prompt_attention
    rng = np.random.default_rng(13)
    p = rng.integers(0, 1024, 300).tolist()
    got = _feed(_load(path, tensor_cores), [[(0, p, True)]])[0]
    ref = _feed(_load(path, decode_kernel), [[(0, p, True)]])[0]
    assert not np.array_equal(got, ref)
    assert rel(cp.asarray(got), cp.asarray(ref)) < 1e-1


def test_head_rows_never_take_the_prompt_path(tmp_path, monkeypatch):
    """A window whose every row wants logits (a long prompt's 1-row last chunk beside a decode
    row): the head's rows are a selection, so they multiply through MMVQ like any head row."""
    monkeypatch.setenv("STRATA_CUDA_PREFILL_MIN_WEIGHT", "0")
    model = _load(synth_for_gpu(tmp_path, "llama"), CudaBackend(fused=True))
    rng = np.random.default_rng(4)
    c0, c1 = model.new_cache(1024, "f16"), model.new_cache(1024, "f16")
    p = rng.integers(0, model.n_vocab, 300)
    model.forward(p[:299], [Span(c0, 0, 299, long_prompt=True)])
    model.forward(rng.integers(0, model.n_vocab, 5), [Span(c1, 0, 5)])
    toks = np.asarray([p[299], 7], np.int64)
    hidden, logits = model.forward(toks, [Span(c0, 299, 1, long_prompt=True), Span(c1, 5, 1)], logit_rows=[0, 1])
    assert same(logits, model.logits(hidden))  # after the window: no prompt rows, plain MMVQ


@pytest.mark.parametrize("arch,kind,case", [("llama", "f16", "mmvq"), ("llama", "int8", "mmvq"),
                                            ("llama", "f16", "gemm"), ("llama", "f16", "gemm, CuPy's cuBLAS"),
                                            ("qwen3moe", "f16", "grouped experts")])
def test_wide_prompt_windows_replay_eager_bits(tmp_path, arch, kind, case, monkeypatch):
    """Prompt chunks wider than a decode window are graphed on their second sighting, and the
    replay reads where the chunk starts and which cache it fills from the window table: three
    sequences' long prompts in chunks of 256 (at 0) and 300 (at 256) give the graphs-off bits,
    the first sequence's eagerly, the second's captured, the third's replayed. Their rows on
    the GEMM path (weight floor 0) are captured too, through Strata's own cuBLAS handle, and so
    are an MoE's prompt rows, whose experts take mmq_grouped on a plan the graph rebuilds from
    each window's ids; with CuPy's cuBLAS wrapper instead (which refuses capture) those shapes
    stay eager (said in kept_eager, nothing on stderr), with the same bits."""
    from strata.backend import cuda_prefill

    blocker = {"gemm, CuPy's cuBLAS": "prompt GEMM (cuBLAS)"}.get(case)
    if case.startswith("gemm"):
        monkeypatch.setenv("STRATA_CUDA_PREFILL_MIN_WEIGHT", "0")
    if case == "gemm, CuPy's cuBLAS":
        init = cuda_prefill.PrefillPath.__init__

        def without_own_handle(self, *a, **k):
            init(self, *a, **k)
            self._blas, self.capturable = None, False

        monkeypatch.setattr(cuda_prefill.PrefillPath, "__init__", without_own_handle)
    path = synth_for_gpu(tmp_path, arch)
    graphed = CudaBackend(fused=True)
    eager = CudaBackend(fused=True)
    eager.graphs = None
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, 1024, 556) for _ in range(3)]
    script = [[(s, p[:256], True)] for s, p in enumerate(prompts)]
    script += [[(s, p[256:], True)] for s, p in enumerate(prompts)]
    script = [script[0], script[3], script[1], script[4], script[2], script[5]]  # each sequence's chunks in order
    got = _windows(_load(path, graphed), script, kind)
    ref = _windows(_load(path, eager), script, kind)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert np.array_equal(a, b), f"window {i}: differs from the graphs-off window"
    g = graphed.graphs
    if case == "gemm":
        assert graphed._prefill is not None and graphed._prefill.capturable  # the GEMM rows did run
    if case == "grouped experts":
        assert graphed.expert_kernels["mmq_experts_grouped"] > 0
    if blocker is None:
        assert len(g.held["wide"]) == 2 and g.replays >= 2 and not g.kept_eager
    else:
        assert not g.held["wide"] and g.kept_eager and all(blocker in reasons for _, reasons in g.kept_eager)
    assert not g.failures


def _keep_at_most(monkeypatch, kind: str, n: int) -> None:
    """The graph policy with `kind` windows captured on their second sighting, n of them kept."""
    from strata.backend import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "GRAPH_POLICY", {**cuda_graphs.GRAPH_POLICY, kind: cuda_graphs._Policy(False, n)})


def test_wide_graphs_keep_the_most_recent(tmp_path, monkeypatch):
    """At most the policy's count of wide graphs (MAX_WIDE_GRAPHS) is held; the least recently replayed goes first,
    and its shape, seen again, is captured again (same bits as without graphs)."""
    _keep_at_most(monkeypatch, "wide", 2)
    path = synth_for_gpu(tmp_path, "llama")
    graphed = CudaBackend(fused=True)
    eager = CudaBackend(fused=True)
    eager.graphs = None
    rng = np.random.default_rng(22)
    sizes = [70, 80, 90, 70, 70, 80]  # three wide shapes, each seen several times, two held at once
    script = [[(i, rng.integers(0, 1024, n))] for i, n in enumerate(sizes + sizes)]
    got = _windows(_load(path, graphed), script, "f16")
    ref = _windows(_load(path, eager), script, "f16")
    for i, (a, b) in enumerate(zip(got, ref)):
        assert np.array_equal(a, b), f"window {i}"
    g = graphed.graphs
    held = [k for k, v in g.graphs.items() if v is not None]
    assert len(g.held["wide"]) == 2 and set(held) == set(g.held["wide"])  # the dropped graphs are gone
    assert g.replays >= 3


def test_mixed_windows_are_captured_when_seen_again_and_few_are_kept(tmp_path, monkeypatch):
    """A window with a multi-token span beside decoding rows (a prompt arriving while others
    decode) runs eagerly the first time its shape is seen and is captured the second; at most
    the policy's count of such graphs is kept, the least recently replayed dropped. Decode
    windows are captured at first sight. Every window has the graphs-off bits."""
    _keep_at_most(monkeypatch, "mixed", 2)
    path = synth_for_gpu(tmp_path, "llama")
    graphed = CudaBackend(fused=True)
    eager = CudaBackend(fused=True)
    eager.graphs = None
    model, ref_model = _load(path, graphed), _load(path, eager)
    g = graphed.graphs
    rng = np.random.default_rng(24)
    got = _windows(model, [[(0, rng.integers(0, 1024, 4))]], "f16")  # a prompt alone: seen once, eager
    got += _windows(model, [[(0, [5])]], "f16")  # a decode window: captured at once
    assert g.captures == 1
    decode_keys = set(g.graphs)
    sizes = (6, 9, 6, 11, 9, 6, 11)  # the prompt beside one decoding row
    windows = [[(0, [7]), (1, rng.integers(0, 1024, n))] for n in sizes]
    counts = []
    for w in windows:
        got += _windows(model, [w], "f16")
        counts.append(g.captures)
    # 6 eager, 9 eager, 6 captured, 11 eager, 9 captured, 6 replayed, 11 captured (9 dropped)
    assert counts == [1, 1, 2, 2, 3, 3, 4], counts
    live = {k for k, v in g.graphs.items() if v is not None}
    assert len(g.held["mixed"]) == 2 and live - decode_keys == set(g.held["mixed"])  # the dropped one is gone
    rng = np.random.default_rng(24)
    ref = _windows(ref_model, [[(0, rng.integers(0, 1024, 4))]], "f16") + _windows(ref_model, [[(0, [5])]], "f16")
    ref += [_windows(ref_model, [[(0, [7]), (1, rng.integers(0, 1024, n))]], "f16")[0] for n in sizes]
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert np.array_equal(a, b), f"window {i}"


def test_wide_windows_stay_eager_when_device_memory_is_short(tmp_path, monkeypatch):
    """A wide window's second sighting is captured only while the device has
    WIDE_GRAPH_MIN_FREE_BYTES free (the graph's pool would hold a prompt chunk's activations
    beside CuPy's): with little free (simulated) that shape stays eager, said in kept_eager,
    with the graphs-off bits; decode windows are graphed as before."""
    path = synth_for_gpu(tmp_path, "llama")
    graphed = CudaBackend(fused=True)
    monkeypatch.setattr(graphed, "free_bytes", lambda: 1 << 20)
    eager = CudaBackend(fused=True)
    eager.graphs = None
    rng = np.random.default_rng(23)
    script = [[(s, rng.integers(0, 1024, 80))] for s in range(3)] + [[(0, [5])], [(0, [6])]]
    got = _windows(_load(path, graphed), script, "f16")
    ref = _windows(_load(path, eager), script, "f16")
    for i, (a, b) in enumerate(zip(got, ref)):
        assert np.array_equal(a, b), f"window {i}"
    g = graphed.graphs
    assert not g.held["wide"] and g.kept_eager == [(80, ("device memory",))] and g.replays >= 1


def _batch_mtp_equals_plain(tmp_path, spec: int, lengths: tuple[int, int], tokens: int, seed: int,
                            extra: tuple[str, ...] = ()):
    """--batch-mtp at 4 slots on the seed-moe pack against plain decoding, greedy, 6 prompts of
    random lengths in [lengths): the same tokens. Returns the MTP engine."""
    from tests.support.engines import greedy, load_engine, make_seed_moe, run_all

    require_synth_tokenizer()
    pack = make_seed_moe(tmp_path / "seed")
    base = ["--pack", str(pack), "--device", "cuda", "--parallel", "4", *extra]
    plain, _ = load_engine(base)
    mtp, _ = load_engine(base + ["--mtp", str(pack / "mtp"), "--spec", str(spec), "--batch-mtp"])
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 1000, int(rng.integers(*lengths))).tolist() for _ in range(6)]
    want = [r[0] for r in run_all(plain, prompts, greedy(tokens), threaded=False)]
    got = [r[0] for r in run_all(mtp, prompts, greedy(tokens), threaded=False)]
    assert got == want
    return mtp


def test_batch_mtp_with_graphed_draft_equals_plain(tmp_path):
    """The seed story on the GPU: --batch-mtp at 4 slots, the draft's steps replayed as graphs
    too, gives plain decoding's tokens (greedy), and the draft graphs were used."""
    mtp = _batch_mtp_equals_plain(tmp_path, 3, (5, 40), 20, 5)
    graphs = mtp.model.b.graphs
    assert any(key[0][0] == "draft-chain" for key in graphs.graphs), "the draft never ran as a graph chain"
    assert graphs.replays > 0


def test_batch_mtp_with_long_prompts_equals_plain(tmp_path, monkeypatch):
    """Long prompts (their rows through GEMM, chunked by a small --prefill budget that the
    slots share, so chunks fall differently in the two runs) with --batch-mtp at 4 slots: the
    greedy tokens of plain decoding."""
    monkeypatch.setenv("STRATA_CUDA_PREFILL_MIN_WEIGHT", "0")
    mtp = _batch_mtp_equals_plain(tmp_path, 3, (256, 420), 16, 9, ("--prefill", "300"))
    assert mtp.model.b.long_prompt_tokens == 256


def test_fused_drafting_equals_plain_and_replays_one_graph(tmp_path, monkeypatch):
    """STRATA_MTP_FUSED=1, --spec 1, --batch-mtp at 4 slots: windows verify and draft for the
    next window in one graph; greedy tokens equal plain decoding."""
    monkeypatch.setenv("STRATA_MTP_FUSED", "1")
    mtp = _batch_mtp_equals_plain(tmp_path, 1, (5, 40), 24, 6)
    assert mtp.scheduler.cfg.fused_drafts
    graphs = mtp.model.b.graphs
    assert any(key[0][0] == "model+next-draft" for key in graphs.graphs), "no fused window was graphed"


def test_draft_chain_equals_step_by_step(tmp_path):
    """k greedy draft steps in one graph (each fed the last one's argmax on the device) give
    the same ids, top probabilities and draft cache as k step_last calls."""
    from tests.support.engines import load_engine, make_seed_moe

    require_synth_tokenizer()
    pack = make_seed_moe(tmp_path / "seed")
    core, _ = load_engine(["--pack", str(pack), "--device", "cuda", "--mtp", str(pack / "mtp"), "--spec", "3"])
    d, xp = core.draft, core.model.b.xp
    rng = rng_of("chain")
    E = core.model.cfg.n_embd
    chained, stepped, seen = [], [], []
    for n in (5, 1, 3):
        hist, toks = rng.integers(10, 1000, 7), rng.integers(10, 1000, n)
        h0 = xp.asarray(rng.standard_normal((7, E)).astype(np.float32))
        h1 = xp.asarray(rng.standard_normal((n, E)).astype(np.float32))
        for items in (chained, stepped, seen):
            c = d.new_cache(256, "f16")
            d.step_last([(c, hist, h0)], full=False)
            items.append((c, toks, h1))
    k = 3
    # a chain of multi-token spans is a "mixed" window: eager at its first sighting, captured
    # at its second (GRAPH_POLICY); the one compared is that second, graphed run
    d.chain_greedy(seen, k)
    ids, tops = d.chain_greedy(chained, k)
    g, (sid, stop) = d.step_last(stepped, full=False)
    committed = [c.length for c, _, _ in stepped]
    want_ids, want_tops = [sid], [stop]
    for _ in range(k - 1):
        g, (sid, stop) = d.step_last([(c, [int(t)], g[i : i + 1]) for i, ((c, _, _), t) in enumerate(zip(stepped, sid))],
                                     full=False)
        want_ids.append(sid)
        want_tops.append(stop)
    assert np.array_equal(ids, np.stack(want_ids, axis=1))
    assert np.array_equal(tops, np.stack(want_tops, axis=1))
    for (ca, _, _), (cb, _, _), length in zip(chained, stepped, committed):
        assert ca.length == length
        assert same(ca._k[0][:, :length], cb._k[0][:, :length]) and same(ca._v[0][:, :length], cb._v[0][:, :length])
    assert any(key[0][0] == "draft-chain" for key in core.model.b.graphs.graphs)


def test_failed_capture_falls_back_to_eager_windows(tmp_path, capsys):
    """A setup that cannot capture a window (simulated: begin_capture raises) still serves it:
    the shape runs eagerly from then on, said once on stderr, results as without graphs."""
    path = synth_for_gpu(tmp_path, "llama")
    graphed = CudaBackend(fused=True)

    def refuse(*a, **k):
        raise RuntimeError("capture not supported here")

    graphed.graphs._begin_capture = refuse
    eager = CudaBackend(fused=True)
    eager.graphs = None
    got = _run(_load(path, graphed), "f16", SCRIPT)
    ref = _run(_load(path, eager), "f16", SCRIPT)
    for a, b in zip(got, ref):
        assert np.array_equal(a, b)
    assert graphed.graphs.failures and all(g is None for g in graphed.graphs.graphs.values())
    assert "run without a graph" in capsys.readouterr().err
