"""qwen4exp's own MTP layer as the draft, and speculation on every piece of its state (CPU).

The tiny qwen4exp pack carries its MTP layer as block 4 (`blk.4.nextn.*` and a QSA layer under
the trunk's names); the same layer also comes as an MTP-only GGUF, and under the other writers'
names (strata/pack/mtp_names.py). Checked here:
- the layer's own math (archs/qwen4exp.py MtpLayer) against a float64 recomputation from the
  dequantized tensors: the input projection (one RMS over all the streams, fc_hidden per stream,
  the embedding added to each), the exit mixer and the shared head; its decoder layer is the
  trunk's own class (the trunk's oracle tests check that one);
- every layout loads as the canonical one, bit for bit (the split projection joined at load);
- the draft's own state rolls back: speculative entries cut, then the true ones, equal a draft
  that never saw them;
- lossless: at temperature 0 the tokens with MTP (--spec 3, with and without --batch-mtp, at
  1/2/4 slots; the report's flags with an MTP-only GGUF; --state-checkpoints leaving a slot
  without rollback) equal plain decoding; with sampling the first two tokens keep the target's
  exact joint law (chi-square, tests/test_mtp_sampling.py's helper and its fixed-q check);
- a proposer wrong at chosen positions cuts every state piece back inside a window (QSA KV and
  indexer keys, DeltaNet states and conv windows, the PLE history and token ids): it equals a
  fresh prefill of the same tokens.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata.backend.cpu import CpuBackend
from strata.errors import StrataError
from strata.gguf.reader import GGUFFile
from strata.gguf.writer import GGUFWriter
from strata.model.build import build_model
from strata.model.layers.sparse_attention import SparseAttention
from strata.model.transformer import Span
from strata.mtp.draft import DraftModel, find_draft
from strata.pack.loader import open_pack
from strata.pack.presets import TINY
from strata.pack.synth import synth_pack
from strata.protocol import SamplingParams
from strata.sampling.filters import distribution
from tests.support import reference_model
from tests.support.engines import collect, greedy, load_engine, request, run_all, shared_tiny
from tests.test_hybrid_archs import _assert_same_state
from tests.test_mtp_sampling import chi2_p_value
from tests.test_mtp_sampling import test_scheduler_sampling_with_drafts_matches_exact_distribution as _fixed_q_law

# token ids below the shared packs' vocabulary of 4096
PROMPTS = [[1, 504, 2821, 314, 1115, 30, 1826, 3012, 42, 260, 3777],
           [2, 17, 999, 4095, 1234, 2345, 3456, 60, 61, 62, 1000, 2000, 3000, 7, 8],
           [5, 6, 7, 8, 9, 10],
           [100, 200, 300, 400, 500, 600, 700, 800, 900] * 4]  # 36 tokens: past the indexer's budget
N = 4  # the MTP layer's block: the tiny pack's main stack has 4 layers


def _renamed(src, out, rename):
    """A copy of the GGUF `src` (a pack or an MTP-only file) with block 4's tensors renamed by
    `rename` (suffix -> new suffix, or (embed name, hidden name) to split eh_proj into its two
    column halves)."""
    f = GGUFFile(src)
    w = GGUFWriter(out, alignment=f.alignment)
    w.add_all_metadata(dict(f.metadata), dict(f.metadata_types))
    for name, t in f.tensors.items():
        data = np.asarray(t.data())
        suffix = name.removeprefix(f"blk.{N}.")
        new = rename.get(suffix, suffix)
        if isinstance(new, tuple):  # rows of whole blocks: each half is half of every row's bytes
            rows = data.reshape(int(t.shape[1]), -1)
            half = rows.shape[1] // 2
            for part, cols in zip(new, (rows[:, :half], rows[:, half:])):
                w.add_tensor(f"blk.{N}.{part}", t.ggml_type, (t.shape[0] // 2, t.shape[1]),
                             np.ascontiguousarray(cols).tobytes())
            continue
        w.add_tensor(name if new == suffix else f"blk.{N}.{new}", t.ggml_type, t.shape, data.tobytes())
    w.write()
    return out


LAYOUTS = {
    "28610": {"nextn.eh_proj.weight": ("nextn.embed_proj.weight", "nextn.hidden_proj.weight")},
    "frspec": {"nextn.eh_proj.weight": ("nextn.fc_embd.weight", "nextn.fc_hidden.weight"),
               **{f"nextn.hc_head_{w}.weight": f"nextn.hc_{w}.weight" for w in ("norm", "down", "up")}},
}


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """The shared tiny pack (its MTP layer inside), a trunk + MTP-only GGUF, the MTP-only GGUF
    under each other layout's names."""
    root = tmp_path_factory.mktemp("qwen4exp-mtp")
    out = {"pack": shared_tiny(tmp_path_factory, "qwen4exp") / "model.gguf"}
    synth_pack(replace(TINY["qwen4exp"], vocab=4096), root / "trunk", mtp_dir=root / "mtp",
               progress=lambda *a: None)
    out["trunk"], out["mtp"] = root / "trunk" / "model.gguf", root / "mtp"
    # the report's form: the main stack in two shards named by --native / --ple-gguf
    synth_pack(replace(TINY["qwen4exp"], vocab=4096), root / "split", name="IQ3_S", shards=2,
               progress=lambda *a: None)
    out["split"] = root / "split"
    for name, rename in LAYOUTS.items():
        (root / name).mkdir()
        out[name] = _renamed(root / "mtp" / "mtp.gguf", root / name / "mtp.gguf", rename)
    out["pack-28610"] = _renamed(out["pack"], root / "pack-28610.gguf", LAYOUTS["28610"])
    return out


def _model_and_draft(path, mtp=None):
    pack = open_pack(pack=str(path))
    m = build_model(CpuBackend(), pack.model_config(), lambda n: pack.tensors.get(n))
    return m, DraftModel(m.b, m.cfg, find_draft(None if mtp is None else str(mtp), pack), m)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_the_mtp_layer_against_float64(packs):
    """The input projection, exit mixer and head (MtpLayer's docstring, from vLLM's
    Qwen4ExpMultiTokenPredictor) from the dequantized tensors in float64: within 1e-5 of the
    largest value (float32 sums; measured 1e-7 to 7e-7)."""
    m, d = _model_and_draft(packs["pack"])
    md, W = reference_model.load(packs["pack"])
    h, E, eps = m.cfg.hybrid, m.cfg.n_embd, m.cfg.rms_eps
    c, p = h.hc_count, f"blk.{N}."
    mtp = d.net.mtp
    assert type(mtp.layer) is type(m.layers[3]) and isinstance(mtp.layer.mixer, SparseAttention)
    assert mtp.layer.mixer.ratio == 4 and mtp.layer.ple is None and not mtp.layer.recurrent
    ids = np.asarray(PROMPTS[3])
    trunk = m.forward(ids, [Span(m.new_cache(64, "f16"), 0, len(ids))])
    assert trunk.shape == (len(ids), c * E)  # the target's hidden rows: its streams
    toks, hid = ids[1:], trunk[:-1]
    seen = {}
    run = mtp.layer.run
    mtp.layer.run = lambda X, *a: seen.setdefault("x", X.copy())  # the decoder layer's input
    mtp.block_out(m.b.embed(m.embd, toks), hid, [Span(d.new_cache(64, "f16"), 0, len(toks))],
                  np.arange(len(toks)))
    mtp.layer.run = run
    e = _rms(np.asarray(W["token_embd.weight"])[toks], np.asarray(W[p + "nextn.enorm.weight"]), eps)
    H = _rms(hid.astype(np.float64), np.asarray(W[p + "nextn.hnorm.weight"]), eps).reshape(-1, c, E)
    eh = np.asarray(W[p + "nextn.eh_proj.weight"])  # (E out, 2E in): [fc_embedding | fc_hidden]
    want = H @ eh[:, E:].T + (e @ eh[:, :E].T)[:, None, :]
    got = seen["x"]
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()

    # the exit mixer (the head's read without inject) and the target's output head
    X = np.random.default_rng(0).standard_normal((5, c * E)).astype(np.float32)
    carry, u = mtp.finish(X)
    assert carry is X
    n = _rms(X.reshape(5, c, E).astype(np.float64), np.asarray(W[p + "nextn.hc_head_norm.weight"]).reshape(c, E), eps)
    a = n.reshape(5, c * E) @ np.asarray(W[p + "nextn.hc_head_down.weight"]).T / c
    g = 1 / (1 + np.exp(-(a / (1 + np.exp(-a))) @ np.asarray(W[p + "nextn.hc_head_up.weight"]).T))
    u_want = (g.reshape(5, c, E) * n).mean(axis=1)
    assert np.abs(u - u_want).max() < 1e-5 * np.abs(u_want).max()
    lg = d.head(u)
    lg_want = u_want @ np.asarray(W["output.weight"]).T
    assert np.abs(lg - lg_want).max() < 1e-5 * np.abs(lg_want).max()


def _draft_rows(m, d):
    """The draft's logits over a prompt's catch-up, from the target's streams."""
    ids = np.asarray(PROMPTS[3])
    trunk = m.forward(ids, [Span(m.new_cache(64, "f16"), 0, len(ids))])
    g, lg = d.step(d.new_cache(64, "f16"), ids[1:], trunk[:-1])
    return g, lg


@pytest.mark.parametrize("layout", ["mtp", *sorted(LAYOUTS), "pack-28610"])
def test_every_layout_loads_as_the_canonical_one(packs, layout):
    """An MTP-only GGUF (--mtp) under each layout's names, and nextn tensors in the pack under
    #28610's (its split projection), draft bit for bit as the pack's canonical layer."""
    m, canonical = _model_and_draft(packs["pack"])
    want = _draft_rows(m, canonical)
    m2, d = _model_and_draft(packs[layout]) if layout.startswith("pack") else \
        _model_and_draft(packs["trunk"], packs[layout])
    got = _draft_rows(m2, d)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_split_projection_of_two_types_is_one_line(packs, tmp_path):
    f = GGUFFile(packs["28610"])
    w = GGUFWriter(tmp_path / "bad.gguf", alignment=f.alignment)
    w.add_all_metadata(dict(f.metadata), dict(f.metadata_types))
    for name, t in f.tensors.items():
        if name.endswith("nextn.hidden_proj.weight"):  # an F32 half beside a Q8_0 one
            w.add_tensor(name, 0, t.shape, np.zeros(int(np.prod(t.shape)), np.float32).tobytes())
            continue
        w.add_tensor(name, t.ggml_type, t.shape, np.asarray(t.data()).tobytes())
    w.write()
    with pytest.raises(StrataError) as e:
        find_draft(str(tmp_path / "bad.gguf"), open_pack(pack=str(packs["trunk"])))
    msg = str(e.value)
    assert "\n" not in msg and "bad.gguf" in msg and "blk.4.nextn.hidden_proj.weight" in msg, msg


def test_the_drafts_own_state_rolls_back(packs):
    """Catch-up, three speculative steps, cut back, the true tokens: the same logits, bit for
    bit, as a draft state that never saw the speculation (its KV and indexer keys)."""
    m, d = _model_and_draft(packs["pack"])
    ids = np.asarray(PROMPTS[3])
    trunk = m.forward(ids, [Span(m.new_cache(64, "f16"), 0, len(ids))])
    k = 30
    clean, cut = d.new_cache(64, "f16"), d.new_cache(64, "f16")
    d.step(clean, ids[1:k], trunk[: k - 1])
    want = d.step(clean, ids[k:], trunk[k - 1 : -1])
    g, _ = d.step(cut, ids[1:k], trunk[: k - 1])
    for t in (7, 8, 9):  # speculation: each step reads the last one's own streams
        g, _ = d.step(cut, np.asarray([t]), g[-1:])
    cut.truncate(k - 1)
    assert cut.length == k - 1
    got = d.step(cut, ids[k:], trunk[k - 1 : -1])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def plain(packs):
    core, _ = load_engine(["--pack", str(packs["pack"]), "--device", "cpu"])
    return [ids for ids, _, _ in run_all(core, PROMPTS, greedy(16), threaded=False)]


@pytest.mark.parametrize("batch_mtp", [True, False])
def test_mtp_greedy_equals_plain(packs, plain, batch_mtp):
    args = ["--pack", str(packs["pack"]), "--spec", "3", "--parallel", "4", "--device", "cpu"]
    core, lines = load_engine(args + (["--batch-mtp"] if batch_mtp else []))
    assert any("draft" in ln and "nextn layer 4 of the pack" in ln for ln in lines), lines
    assert any(ln.startswith("strata: recurrent state: 3 Gated DeltaNet layers") for ln in lines), lines
    for n in (1, 2, 4):
        outs = run_all(core, PROMPTS[:n], greedy(16), threaded=False)
        assert [ids for ids, _, _ in outs] == plain[:n]
    slots = core.metrics()["slots"]
    assert sum(s["mtp_drafted"] for s in slots) > 0 and sum(s["mtp_windows"] for s in slots) > 0


def test_the_reports_config_with_an_mtp_only_gguf(packs):
    """The main stack in two shards (--pack DIR --native ... --ple-gguf ...), --mtp an MTP-only
    GGUF, --spec 4 --spec-min-p 0.5 --batch-mtp, parallel 4, served by real threads as the
    server drives it; and --spec 4 at min-p 0 (where this random draft drafts at all)."""
    want_core, _ = load_engine(["--pack", str(packs["trunk"]), "--device", "cpu", "--kv", "int8"])
    want = [ids for ids, _, _ in run_all(want_core, PROMPTS, greedy(16), threaded=False)]
    shards = ["--pack", str(packs["split"]), "--native", "IQ3_S-00001-of-00002.gguf",
              "--ple-gguf", "IQ3_S-00002-of-00002.gguf"]
    for min_p in ("0.5", "0"):
        core, lines = load_engine([*shards, "--mtp", str(packs["mtp"]), "--spec", "4",
                                   "--spec-min-p", min_p, "--batch-mtp", "--parallel", "4", "--device", "cpu",
                                   "--kv", "int8"])
        assert any("--mtp" in ln and "nextn layer 4" in ln for ln in lines), lines
        assert sum(ln.startswith("strata probe:") for ln in lines) == 1
        core.start()
        try:
            for n in (1, 2, 4):
                outs = run_all(core, PROMPTS[:n], greedy(16), threaded=True)
                assert [ids for ids, _, _ in outs] == want[:n]
                assert all(o[2].reason in ("length", "stop") for o in outs)
        finally:
            core.stop()
        assert core.scheduler.finished.get("error", 0) == 0
    assert sum(s["mtp_drafted"] for s in core.metrics()["slots"]) > 0


def test_a_slot_without_a_state_checkpoint_decodes_plainly(packs, plain):
    """--state-checkpoints 1 at 2 slots: slot 1 keeps one state copy, so it never drafts (its
    windows cannot be cut back); both give plain decoding's tokens."""
    core, lines = load_engine(["--pack", str(packs["pack"]), "--spec", "3", "--parallel", "2", "--batch-mtp",
                               "--state-checkpoints", "1", "--device", "cpu"])
    assert any("one copy: no rollback" in ln for ln in lines), lines
    outs = run_all(core, PROMPTS[:2], greedy(16), threaded=False)
    assert [ids for ids, _, _ in outs] == plain[:2]
    slots = core.metrics()["slots"]
    assert slots[0]["mtp_drafted"] > 0 and slots[1]["mtp_drafted"] == 0


def _state(cache, n):
    """Every piece of a qwen4exp sequence's state as of its length n: (KV rows, the float32
    pieces: indexer keys, DeltaNet states and conv windows, PLE history; the token ids)."""
    kv = [np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in cache.kv.read(i, n)])
          for i in range(len(cache.index.arrays))]
    index = [np.array(a[:n]) for a in cache.index.arrays]
    recurrent = [np.array(a[cache.active]) for a in cache.conv + cache.ssm]
    return kv, index + recurrent + [np.array(cache.ple_hist)], np.array(cache.tokens[:n])


def _assert_same_kv(got, want, cfg, n_tokens):
    """f16 KV rows: the float32 bound of _assert_same_state (tests/test_hybrid_archs.py) on the
    values before rounding, plus the one f16 rounding step that such a difference may cross."""
    eps = float(np.finfo(np.float32).eps)
    n = n_tokens * cfg.n_layer * 2 * cfg.n_embd
    for a, b in zip(got, want, strict=True):
        tol = eps * np.sqrt(np.log(b.size) * n) * float(np.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=2.0**-10, atol=tol)


@pytest.mark.parametrize("wrong_at,expect", [(set(), 3), ({1}, 0), ({2}, 1), ({3}, 2)])
def test_replayed_proposals_cut_every_state_piece(packs, plain, wrong_at, expect):
    """A proposer replaying the target's continuation, wrong at chosen positions: each window
    accepts exactly the drafts before the first wrong one and is cut back inside; tokens equal
    plain decoding and every state piece equals a fresh prefill's."""
    from strata.batch.scheduler import Scheduler, SchedulerConfig
    from tests.support.proposers import ReplayProposer

    core, _ = load_engine(["--pack", str(packs["pack"]), "--device", "cpu"])
    prop = ReplayProposer({tuple(p): w for p, w in zip(PROMPTS, plain)}, wrong_at, vocab=core.model.n_vocab)
    cfg = SchedulerConfig(parallel=2, max_ctx=core.n_ctx, kv_kind="f16", prefill_chunk=64, spec=3, batch_mtp=True)
    sch = Scheduler(core.model, core.tokenizer, cfg, proposer=prop, slot_batch_mtp=[(True, None)] * 2,
                    log=lambda s: None)
    handles = [sch.submit(request(p, greedy(16))) for p in PROMPTS[:2]]
    checked = 0
    while any(s.busy for s in sch.slots) or sch.queue:
        sch._admit()
        sch.step()
        for s in sch.slots:
            if s.busy and not s.prefilling and s.n_generated > 2 and checked < 6:
                seq = s.prompt + plain[PROMPTS.index(s.prompt)][: s.n_generated - 1]
                assert s.cache.length == len(seq)
                fresh = core.model.new_cache(core.n_ctx, "f16")
                core.model.forward(np.asarray(seq), [Span(fresh, 0, len(seq))])
                got_kv, got, got_ids = _state(s.cache, len(seq))
                want_kv, want, want_ids = _state(fresh, len(seq))
                np.testing.assert_array_equal(got_ids, want_ids)
                _assert_same_state(got, want, core.model.cfg, len(seq))
                _assert_same_kv(got_kv, want_kv, core.model.cfg, len(seq))
                checked += 1
    assert checked == 6
    assert [collect(h)[0] for h in handles] == plain[:2]
    assert sum(s.counters.accepted for s in sch.slots) == sum(prop.expected_accepts)
    assert max(prop.expected_accepts) == expect


def test_sampling_with_drafts_from_a_fixed_q_keeps_the_distribution(packs):
    """The other families' check (tests/test_mtp_sampling.py) on this pack: drafts from a fixed
    q that overlaps the target's support in part, so windows both accept and reject (and cut
    every state piece back) under sampling."""
    _fixed_q_law(packs["pack"])


def test_sampling_with_the_mtp_draft_keeps_the_distribution(packs):
    """The first two tokens at temperature 1, top-k 3, with the MTP layer drafting (--spec 2):
    their counts over 300 seeds against the exact joint law from the model's own logits. (The
    tiny pack's random draft rarely shares the target's top 3: this checks the rejections' law,
    the fixed-q test above the acceptances'.)"""
    core, _ = load_engine(["--pack", str(packs["pack"]), "--device", "cpu", "--spec", "2"])
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=3)
    h = core.model.forward(np.asarray(prompt), [Span(core.model.new_cache(core.n_ctx, "f16"), 0, len(prompt))])
    p_first = distribution(core.model.logits(h[-1:])[0], params)
    exact = {}
    for t in np.nonzero(p_first)[0]:
        seq = prompt + [int(t)]
        h2 = core.model.forward(np.asarray(seq), [Span(core.model.new_cache(core.n_ctx, "f16"), 0, len(seq))])
        p2 = distribution(core.model.logits(h2[-1:])[0], params)
        for u in np.nonzero(p2)[0]:
            exact[(int(t), int(u))] = p_first[t] * p2[u]
    keys = sorted(exact)
    counts = np.zeros(len(keys))
    for seed in range(300):
        ids, _, _ = run_all(core, [prompt], SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=seed),
                            threaded=False)[0]
        counts[keys.index((ids[0], ids[1]))] += 1
    assert sum(s["mtp_drafted"] for s in core.metrics()["slots"]) > 0
    assert chi2_p_value(counts, np.array([exact[k] for k in keys])) > 1e-3


def test_the_state_a_slot_keeps(packs):
    """The numbers the start-up lines state per slot: the DeltaNet states and the PLE history
    (three copies, and with a checkpoint the rows of a window that may be cut inside), and the
    draft's KV (at the kind's size, as the nextn drafts count it) and indexer keys per position
    at full context."""
    from strata.model.transformer import Transformer

    m, d = _model_and_draft(packs["pack"])
    h, c = m.cfg.hybrid, m.cfg
    row = 4 * h.hc_count * c.n_embd
    assert m.state_bytes() - Transformer.state_bytes(m) == (3 * h.ple_history_rows + m.replay_tokens) * row
    assert m.state_bytes(False) - Transformer.state_bytes(m, False) == 3 * h.ple_history_rows * row
    assert m.position_bytes() == 4 * h.idx_dim + 8  # one attention layer's raw indexer keys, the token id
    assert "PLE history" in m.state_line() and "indexer keys" in m.state_line()
    per_position = 2 * c.n_head_kv * c.head_dim * 2 + 4 * h.idx_dim
    assert d.state_bytes(1000, "f16") - d.state_bytes(0, "f16") == 1000 * per_position


def test_compress_ratios_without_the_mtp_layers_entry_take_the_trunks():
    """A converter may write compress_ratios for the trunk only beside an MTP layer counted in
    block_count: the MTP layer then takes the trunk's ratio; any other length is one line."""
    from strata.errors import StrataError
    from strata.model.config import config_from_metadata
    from strata.pack.loader import open_pack

    md = dict(open_pack(pack="tests/data/qwen4exp/qwen4exp-tiny-f16.gguf").metadata)
    ratios = list(md["qwen4exp.attention.compress_ratios"])
    rec = list(md["qwen4exp.attention.recurrent_layers"])
    n = md["qwen4exp.block_count"]

    def config(extra_ratios, blocks):
        m = {**md, "qwen4exp.block_count": n + blocks, "qwen4exp.nextn_predict_layers": 1,
             "qwen4exp.attention.compress_ratios": ratios + extra_ratios,
             "qwen4exp.attention.recurrent_layers": rec + [False] * blocks}
        return config_from_metadata(m, label="p")

    trunk = next(r for r, r_rec in zip(ratios, rec) if not r_rec and r)
    assert config([], 1).hybrid.nextn_ratio == trunk
    assert config([2], 1).hybrid.nextn_ratio == 2
    with pytest.raises(StrataError, match=r"compress_ratios: must have one entry per block \(10 in block_count, or 9"):
        config([], 2)
