"""The hybrid family on the CUDA backend: the Gated DeltaNet kernels (delta_net.cu) against the
backend's generic ops on the same device, whole models against the CPU backend on F16 packs
(where the GPU's matrix products do not round activations to 8 bits), and MTP with the pack's
nextn layer decoding exactly as plain decoding on the GPU at 1, 2 and 4 slots."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.gpu import require_cuda, require_synth_tokenizer

cp = require_cuda()

from strata.backend.base import Backend  # noqa: E402
from strata.backend.cpu import CpuBackend  # noqa: E402
from strata.backend.cuda import CudaBackend  # noqa: E402
from strata.model.build import build_model  # noqa: E402
from strata.model.layers.delta_net import DeltaNet  # noqa: E402
from strata.model.transformer import Span  # noqa: E402
from strata.pack.loader import open_pack  # noqa: E402
from strata.pack.presets import TINY  # noqa: E402
from strata.pack.synth import synth_pack  # noqa: E402
from tests.support import oracle  # noqa: E402
from tests.support.engines import chat_prompts, greedy, load_engine, run_all  # noqa: E402

ARCHS = ("qwen35moe", "qwen35", "qwen3next")
IDS = [1, 200, 300, 4000, 50, 60, 70, 80, 9, 1234]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    require_synth_tokenizer()
    root = tmp_path_factory.mktemp("hybrid-gpu")
    out = {}
    for arch in ARCHS:
        synth_pack(TINY[arch], root / arch, progress=lambda *a: None)
        out[arch] = root / arch
        out[arch + "-f16"] = oracle.write_pack(arch, root / (arch + "-f16"))
    return out


def _model(path, backend):
    pack = open_pack(pack=str(path))
    return build_model(backend, pack.model_config(), lambda n: pack.tensors.get(n))


def _logprobs(model, ids):
    cache = model.new_cache(64, "f16")
    _, logits = model.forward(np.asarray(ids), [Span(cache, 0, len(ids))], logit_rows=list(range(len(ids))))
    z = np.asarray(model.b.to_host(logits), np.float64)
    z = z - z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_equal_the_generic_ops(packs, arch):
    """Several sequences in one window (prompt rows and decode rows): the kernels' outputs and
    every state they write equal the generic per-sequence ops'."""
    b = CudaBackend()
    m = _model(packs[arch], b)
    caches = [m.new_cache(64, "f16") for _ in range(3)]
    m.forward(np.asarray(IDS[:5]), [Span(caches[0], 0, 5)])  # a state to start from
    spans = [Span(caches[0], 5, 3), Span(caches[1], 0, 6), Span(caches[2], 0, 1)]
    layer = m.recurrent_layers[0]
    rng = np.random.default_rng(0)
    n = sum(sp.count for sp in spans)
    proj = cp.asarray(rng.standard_normal((n, DeltaNet.replay_width(m.cfg)), dtype=np.float32))
    for sp in spans:
        sp.cache.begin(sp.start, sp.count)
    rows, off = [], 0
    for sp in spans:
        rows.append(sp.cache.table_row(off, sp.count))
        off += sp.count
    table = cp.asarray(np.asarray(rows, np.int64))
    got = b.delta_net_window(layer.mixer, proj, m.pool, 0, table, len(spans), True)
    after_kernel = cp.array(m.pool.ssm), cp.array(m.pool.conv)  # the generic ops write the same copies again
    outs, off = [], 0
    h = layer.mixer.h
    for sp in spans:
        p = proj[off : off + sp.count]
        o = layer.mixer._mix(sp.cache, 0, p)  # generic ops (Backend's) on the same arrays
        z = p[:, h.conv_dim : h.conv_dim + h.value_dim].reshape(sp.count, h.n_v_heads, h.d_state)
        outs.append(Backend.swiglu(b, z, Backend.rms_norm(b, o, layer.mixer.norm, m.cfg.rms_eps)).reshape(sp.count, -1))
        off += sp.count
    want = cp.concatenate(outs)
    np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(want), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(cp.asnumpy(m.pool.ssm), cp.asnumpy(after_kernel[0]), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(cp.asnumpy(m.pool.conv), cp.asnumpy(after_kernel[1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_model_matches_the_cpu_on_f16_weights(packs, arch):
    gpu = _logprobs(_model(packs[arch + "-f16"], CudaBackend()), IDS)
    cpu = _logprobs(_model(packs[arch + "-f16"], CpuBackend()), IDS)
    top = np.argsort(-cpu, axis=1)[:, :5]
    assert np.abs(np.take_along_axis(gpu, top, 1) - np.take_along_axis(cpu, top, 1)).max() < 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_nextn_mtp_greedy_equals_plain_on_the_gpu(packs, arch, monkeypatch):
    """Plain decoding without graphs is the reference: MTP windows replayed from graphs (their
    recurrent table an input), cut back inside by the verifier, give the same tokens."""
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")
    plain, _ = load_engine(["--pack", str(packs[arch]), "--device", "cuda"])
    monkeypatch.delenv("STRATA_CUDA_GRAPHS")
    prompts = chat_prompts(plain, ["Hello there", "Write a haiku about rain.", "List three colors.", "What is 2+2?"])
    want = [ids for ids, _, _ in run_all(plain, prompts, greedy(12), threaded=False)]
    for batch in ([], ["--batch-mtp"]):
        core, lines = load_engine(["--pack", str(packs[arch]), "--spec", "3", "--parallel", "4", "--device", "cuda",
                                   *batch])
        for n in (1, 2, 4):
            outs = run_all(core, prompts[:n], greedy(12), threaded=False)
            assert [ids for ids, _, _ in outs] == want[:n], (arch, batch, n)
        assert sum(s["mtp_drafted"] for s in core.metrics()["slots"]) > 0
        graphs = core.backend.graphs
        assert graphs is None or graphs.replays > 0  # windows replayed graphs
        if graphs is not None:  # the nextn draft's steps too (a chain of greedy steps per window)
            assert any(key[0][0].startswith("draft") and g is not None for key, g in graphs.graphs.items())


@pytest.mark.parametrize("arch", ARCHS)
def test_a_state_without_a_rollback_copy_updates_in_place(packs, arch):
    """A cell with one copy (--state-checkpoints): the kernels read and write the same copy in
    place, beside a two-copy cell in the same windows, and give it the two-copy cell's state and
    logits bit for bit (each thread reads the state elements it writes before writing them)."""
    b = CudaBackend()
    m = _model(packs[arch], b)
    one, two = m.new_cache(64, "f16", checkpoint=False), m.new_cache(64, "f16")
    assert b.delta_net_kernels(m.cfg.hybrid)
    for start, toks in ((0, IDS[:5]), (5, IDS[5:6]), (6, IDS[6:9])):
        n = len(toks)
        _, logits = m.forward(np.asarray(toks + toks), [Span(one, start, n), Span(two, start, n)],
                              logit_rows=list(range(2 * n)))
        z = cp.asnumpy(logits)
        np.testing.assert_array_equal(z[:n], z[n:])
    for a, c in zip(one.conv + one.ssm, two.conv + two.ssm):
        np.testing.assert_array_equal(cp.asnumpy(a[one.active]), cp.asnumpy(c[two.active]))


def test_a_slot_without_a_rollback_copy_decodes_plain_tokens(packs, monkeypatch):
    """--state-checkpoints 1 of 2 with --batch-mtp, windows replayed from graphs: both slots give
    plain decoding's tokens, slot 1 drafts nothing."""
    arch = "qwen35moe"
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")
    plain, _ = load_engine(["--pack", str(packs[arch]), "--device", "cuda"])
    monkeypatch.delenv("STRATA_CUDA_GRAPHS")
    prompts = chat_prompts(plain, ["Hello there", "List three colors."])
    want = [ids for ids, _, _ in run_all(plain, prompts, greedy(12), threaded=False)]
    core, lines = load_engine(["--pack", str(packs[arch]), "--spec", "2", "--parallel", "2", "--device", "cuda",
                               "--batch-mtp", "--state-checkpoints", "1"])
    assert [ids for ids, _, _ in run_all(core, prompts, greedy(12), threaded=False)] == want
    drafted = [s["mtp_drafted"] for s in core.metrics()["slots"]]
    assert drafted[0] > 0 and drafted[1] == 0
    assert sum(ln.startswith("strata: recurrent state: slot 1 has no rollback copy") for ln in lines) == 1
    assert core.backend.graphs is None or core.backend.graphs.replays > 0
