"""Batch-MTP regression tests: the seed story, lossless verification, rollback, faults.

All on the `seed-moe` synthetic pack (qwen3moe with Q2_0 / IQ4_NL expert downs and an MTP
draft; tests.support.engines.shared_seed_moe, at a 4096-token vocabulary) on the CPU backend,
with real threads driving the scheduler like the server does. Each engine configuration is
loaded once for the module and serves every test that runs it.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.batch.scheduler import FaultInjector, Scheduler, SchedulerConfig
from strata.model.transformer import Span
from strata.mtp.proposer import DraftProposer
from tests.support.engines import chat_prompts, greedy, load_engine, run_all, shared_seed_moe
from tests.support.proposers import ReplayProposer

TEXTS = ["Hello there", "Write a haiku about rain.", "List three colors.", "What is 2+2?"]
REPORT_FLAGS = ["--expert-cache", "auto", "--prefill", "auto:32768", "--max-context", "262144", "--kv", "int8",
                "--kv-resident", "32768", "--expert-profile", "data/expert-profile.bin"]


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return shared_seed_moe(tmp_path_factory)


@pytest.fixture(scope="module")
def plain_core(pack):
    """The pack without MTP, one slot (its model also serves the tests' own schedulers)."""
    core, _ = load_engine(["--pack", str(pack), "--device", "cpu", "--kv", "int8"])
    return core


@pytest.fixture(scope="module")
def plain(plain_core):
    """Reference: plain decoding (no MTP, one slot), greedy, for every prompt."""
    prompts = chat_prompts(plain_core, TEXTS)
    outs = run_all(plain_core, prompts, greedy(20), threaded=False)
    return prompts, [ids for ids, _, _ in outs]


def _mtp_args(pack, batch_mtp: bool) -> list[str]:
    return (["--pack", str(pack), "--mtp", str(pack / "mtp"), "--spec", "3", "--parallel", "4", "--device", "cpu",
             "--kv", "int8"] + (["--batch-mtp"] if batch_mtp else []))


@pytest.fixture(scope="module")
def mtp_cores(pack):
    """--spec 3 --parallel 4 with and without --batch-mtp: (core, start-up lines) by batch_mtp,
    each loaded when a test first asks."""
    cores = {}

    def get(batch_mtp: bool):
        if batch_mtp not in cores:
            cores[batch_mtp] = load_engine(_mtp_args(pack, batch_mtp))
        return cores[batch_mtp]

    return get


@pytest.fixture(scope="module")
def story_core(pack):
    """The report's engine: loaded once, then serving 1, 2 and 4 clients in turn (like a server)."""
    return load_engine(["--pack", str(pack), "--mtp", str(pack / "mtp"), "--spec", "4", "--spec-min-p", "0.5",
                        "--batch-mtp", "--parallel", "4", "--device", "cpu", "--no-native", "Q2_0,IQ4_NL",
                        *REPORT_FLAGS])


def _threaded(core, prompts, params):
    core.start()
    try:
        return run_all(core, prompts, params, threaded=True)
    finally:
        core.stop()


@pytest.mark.parametrize("n_clients", [1, 2, 4])
def test_seed_story_fallback_keeps_serving(story_core, plain, n_clients):
    """The report: --parallel 4 --batch-mtp on a pack with no native kernel for its downs.

    The types are taken out of the native table on purpose (--no-native) so the fallback path
    stays covered even though the table is complete. The engine must say so once at start-up,
    serve 1, 2 and 4 concurrent requests, and give the same tokens as plain decoding.
    """
    core, lines = story_core
    probe = [ln for ln in lines if ln.startswith("strata probe:")]
    assert len(probe) == 1, lines
    assert "batch-MTP off for slots 0-3" in probe[0]
    assert "blk.*.ffn_down_exps are Q2_0" in probe[0] and "IQ4_NL" in probe[0]
    assert "each drafts only in windows where no other slot is busy" in probe[0]
    assert any("--kv-resident is accepted but has no effect" in ln for ln in lines)
    prompts, want = plain
    fallbacks = core.metrics()["batch_mtp_fallbacks"].get("no_native_kernel", 0)
    outs = _threaded(core, prompts[:n_clients], greedy(20))
    assert [o[2].reason for o in outs] == ["length"] * n_clients or all(o[2].reason in ("stop", "length") for o in outs)
    assert [ids for ids, _, _ in outs] == want[:n_clients]
    assert core.scheduler.finished.get("error", 0) == 0
    if n_clients > 1:  # these clients' windows fell back (the count before them aside)
        assert core.metrics()["batch_mtp_fallbacks"].get("no_native_kernel", 0) > fallbacks


@pytest.mark.parametrize("batch_mtp", [True, False])
def test_mtp_greedy_equals_plain(mtp_cores, plain, batch_mtp):
    """All types native: batch-MTP on; each slot verifies [token, drafts...] windows; tokens unchanged."""
    core, lines = mtp_cores(batch_mtp)
    if batch_mtp:
        assert any(ln.startswith("strata probe: batch-MTP on for slots 0-3") for ln in lines), lines
        assert any(ln.startswith("strata verify: batch windows of up to 4 sequences") for ln in lines)
    prompts, want = plain
    outs = _threaded(core, prompts, greedy(20))
    assert [ids for ids, _, _ in outs] == want
    m = core.metrics()
    if batch_mtp:  # windows verified more than one token for several slots at once
        assert sum(1 for s in m["slots"] if s["mtp_drafted"] > 0) >= 2
    # one client alone: MTP runs with or without --batch-mtp
    outs = _threaded(core, prompts[:1], greedy(20))
    assert outs[0][0] == want[0]
    assert core.metrics()["slots"][0]["mtp_drafted"] > m["slots"][0]["mtp_drafted"]


def _scheduler(core, proposer, spec, parallel=2):
    cfg = SchedulerConfig(parallel=parallel, max_ctx=core.n_ctx, kv_kind="int8", prefill_chunk=64, spec=spec,
                          batch_mtp=True)
    return Scheduler(core.model, core.tokenizer, cfg, proposer=proposer,
                     slot_batch_mtp=[(True, None)] * parallel, log=lambda s: None)


@pytest.mark.parametrize("wrong_at,expect", [(set(), 4), ({1}, 0), ({3}, 2), ({4}, 3)])
def test_replayed_proposals_accept_exactly(plain_core, plain, wrong_at, expect):
    """A proposer that replays the target's own continuation (wrong at chosen positions).

    Each window must accept exactly the drafts before the first wrong one, the tokens must
    equal plain decoding, and the main KV cache must be rolled back to the accepted prefix.
    """
    core = plain_core  # (its model, under a scheduler of the test's own)
    prompts, want = plain
    cont = {tuple(p): w for p, w in zip(prompts, want)}
    prop = ReplayProposer(cont, wrong_at, vocab=core.model.n_vocab)
    sch = _scheduler(core, prop, spec=4)
    from tests.support.engines import collect, request

    handles = [sch.submit(request(p, greedy(20))) for p in prompts[:2]]
    while any(s.busy for s in sch.slots) or sch.queue:
        sch._admit()
        sch.step()
        for s in sch.slots:  # rollback: the cache holds exactly the prompt + emitted tokens but the pending one
            if s.busy and not s.prefilling:
                assert s.cache.length == len(s.prompt) + s.n_generated - 1
    outs = [collect(h) for h in handles]
    assert [o[0] for o in outs] == want[:2]
    full = [a for a in prop.expected_accepts]
    assert set(full[: len(full) // 2]) <= {expect, min(expect, 4)} or all(a <= expect for a in full)
    got = sum(s.counters.accepted for s in sch.slots)
    assert got == sum(prop.expected_accepts)
    per_pos = [sum(s.counters.accepted_per_pos[j] for s in sch.slots if len(s.counters.accepted_per_pos) > j)
               for j in range(4)]
    for j in range(4):  # position j+1 is accepted only when no wrong draft comes at or before it
        if j + 1 > expect:
            assert per_pos[j] == 0
        else:
            assert per_pos[j] > 0


def test_rollback_of_main_and_draft_caches(mtp_cores, plain):
    """After windows with rejected drafts, both KV caches equal a fresh recomputation."""
    core, _ = mtp_cores(False)  # (its model and draft, under a scheduler and proposer of the test's own)
    prop = DraftProposer(core.draft, max_ctx=core.n_ctx, kv_kind="f16", chunk=64, min_p=0.0)
    cfg = SchedulerConfig(parallel=1, max_ctx=core.n_ctx, kv_kind="f16", prefill_chunk=64, spec=3, batch_mtp=True)
    sch = Scheduler(core.model, core.tokenizer, cfg, proposer=prop, log=lambda s: None)
    prompts, _ = plain
    from tests.support.engines import request

    h = sch.submit(request(prompts[0], greedy(12)))
    sch._admit()
    s = sch.slots[0]
    for _ in range(6):
        sch.step()
    assert s.busy and s.counters.drafted > s.counters.accepted  # some drafts were rejected
    emitted = [h.events.get_nowait().token_id for _ in range(h.events.qsize())]
    assert len(emitted) == s.n_generated and emitted[-1] == s.pending
    seq = prompts[0] + emitted[:-1]
    assert s.cache.length == len(seq)
    fresh = core.model.new_cache(core.n_ctx, "f16")
    hidden = core.model.forward(np.asarray(seq), [Span(fresh, 0, len(seq))])
    for layer in (0, core.cfg.n_layer - 1):
        k1, v1 = s.cache.read(layer, len(seq))
        k2, v2 = fresh.read(layer, len(seq))
        np.testing.assert_allclose(k1, k2, rtol=1e-2, atol=2e-3)
        np.testing.assert_allclose(v1, v2, rtol=1e-2, atol=2e-3)
    # draft: entry p (p = 1..C) holds (x_p, h_{p-1}) computed from the main model's true hiddens
    c = s.mtp.cache.length
    assert 0 < c <= len(seq)
    full = seq + [s.pending]
    dfresh = core.draft.new_cache(core.n_ctx, "f16")
    core.draft.step(dfresh, np.asarray(full[1 : c + 1]), hidden[:c])
    k1, v1 = s.mtp.cache.read(0, c)
    k2, v2 = dfresh.read(0, c)
    np.testing.assert_allclose(k1, k2, rtol=1e-2, atol=2e-3)
    np.testing.assert_allclose(v1, v2, rtol=1e-2, atol=2e-3)


def test_fault_in_one_slots_mtp_admission(mtp_cores, plain):
    """A fault injected into slot 1's MTP admission: that slot falls back, said once; others keep MTP.
    (The last test on the --batch-mtp engine: slot 1's MTP stays off.)"""
    core, _ = mtp_cores(True)
    before = core.metrics()["slots"]
    assert not before[1]["mtp_failed"]
    lines: list[str] = []
    core.scheduler.faults = FaultInjector("mtp-admit@1")
    core.scheduler.log = lines.append
    prompts, want = plain
    outs = _threaded(core, prompts, greedy(20))
    assert [ids for ids, _, _ in outs] == want
    said = [ln for ln in lines if "MTP admission for slot 1 failed" in ln]
    assert len(said) == 1 and "injected fault" in said[0]
    m = core.metrics()["slots"]
    windows = [a["mtp_windows"] - b["mtp_windows"] for a, b in zip(m, before)]  # these requests' windows
    assert m[1]["mtp_failed"] and windows[1] == 0
    assert sum(1 for i in (0, 2, 3) if windows[i] > 0) >= 2
