"""A hybrid model's slots without a rollback copy of their recurrent state (--state-checkpoints,
strata/engine/checkpoints.py): said once at start-up (and by `strata probe`), they never draft,
with or without --batch-mtp, and decode plain decoding's tokens; their state, updated in place,
follows the two-copy one and refuses every cut but to 0; a failed window ends only their request;
the auto count is what the memory left holds."""

from __future__ import annotations

import numpy as np
import pytest

from strata.backend.cpu import CpuBackend
from strata.batch.faults import FaultInjector
from strata.engine.checkpoints import MARGIN_BYTES, checkpoint_budget, checkpoint_count, plan_checkpoints
from strata.model.state import StateLost
from strata.model.transformer import Span
from strata.pack.presets import TINY
from strata.pack.synth import synth_pack
from tests.support.engines import collect, greedy, load_engine, request, run_all

MiB = 1 << 20
PROMPTS = ([1, 17, 230, 45, 99, 12], [1, 300, 301, 302, 7])  # (short: the tests stay fast)
N = 6  # tokens per answer
NO_COPY_LINE = ("strata: recurrent state: slot 1 has no rollback copy (--state-checkpoints 1): "
                "it decodes one token per window")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen35moe pack with its nextn layer, and plain decoding's tokens for PROMPTS."""
    root = tmp_path_factory.mktemp("checkpoints")
    synth_pack(TINY["qwen35moe"], root, progress=lambda *a: None)
    pack = str(root / "model.gguf")
    core, _ = load_engine(["--pack", pack, "--device", "cpu", "--parallel", "2"])
    prompts = [list(p) for p in PROMPTS]
    want = [ids for ids, _, _ in run_all(core, prompts, greedy(N), threaded=False)]
    return pack, core.model, prompts, want


def one_of_two(pack, *flags):
    """Two slots, --spec 2, slot 0 with a rollback copy and slot 1 without."""
    return load_engine(["--pack", pack, "--device", "cpu", "--parallel", "2", "--spec", "2",
                        "--state-checkpoints", "1", *flags])


def test_batch_mtp_the_slot_without_a_copy_never_drafts(tiny):
    pack, _, prompts, want = tiny
    core, lines = one_of_two(pack, "--batch-mtp")
    assert [ids for ids, _, _ in run_all(core, prompts, greedy(N), threaded=False)] == want
    with_copy, without = core.metrics()["slots"]
    assert with_copy["mtp_drafted"] > 0 and with_copy["batch_mtp"]
    assert (without["mtp_drafted"], without["mtp_windows"], without["batch_mtp"]) == (0, 0, False)
    assert without["batch_mtp_reason"] == "no_checkpoint"
    assert core.scheduler.slots[1].mtp.cache is None  # never admitted to MTP: no draft state made
    assert [ln for ln in lines if ln.startswith("strata: recurrent state: slot")] == [NO_COPY_LINE]
    sizes = next(ln for ln in lines if "Gated DeltaNet layers" in ln)
    assert "per slot x 1 (two copies" in sizes and "per slot x 1 (one copy: no rollback)" in sizes
    assert not any(ln.startswith("strata mtp: slot 1:") for ln in lines)
    probe = [ln for ln in lines if ln.startswith("strata probe:")]
    assert len(probe) == 1 and "batch-MTP on for slot 0; batch-MTP off for slot 1: no rollback copy" in probe[0]


def test_without_batch_mtp_it_does_not_draft_even_alone(tiny):
    """Without --batch-mtp a slot drafts while it is the only one busy: slot 1 outlives slot 0
    and still drafts nothing; the other way round slot 0 drafts."""
    pack, _, prompts, want = tiny
    core, lines = one_of_two(pack)
    assert [ln for ln in lines if ln.startswith("strata: recurrent state: slot")] == [NO_COPY_LINE]
    for long_slot in (1, 0):
        limits = [N if i == long_slot else 2 for i in range(2)]
        handles = [core.submit(request(p, greedy(n))) for p, n in zip(prompts, limits)]
        core.scheduler.run_until_idle()
        assert [collect(h)[0] for h in handles] == [w[:n] for w, n in zip(want, limits)]
        drafted = [s["mtp_drafted"] for s in core.metrics()["slots"]]
        assert drafted[1] == 0
    assert drafted[0] > 0  # (slot 0, alone after slot 1 ended: MTP runs there)


def _states(cache):
    return [np.array(a[cache.active]) for a in cache.conv + cache.ssm]


def test_one_copy_updates_in_place_and_refuses_cuts(tiny, monkeypatch):
    _, m, _, _ = tiny
    ids = [1, 200, 300, 4000, 50, 60, 70]
    one, two = m.new_cache(64, "f16", checkpoint=False), m.new_cache(64, "f16")
    assert (one.checkpointed, two.checkpointed) == (False, True)
    for c in (one, two):
        m.forward(np.asarray(ids[:6]), [Span(c, 0, 6)])
        m.forward(np.asarray(ids[6:]), [Span(c, 6, 1)])
    for a, b in zip(_states(one), _states(two)):
        np.testing.assert_array_equal(a, b)  # the generic ops read the whole state before writing it
    with pytest.raises(StateLost, match="cannot go back to position 6"):
        one.truncate(6)
    one.truncate(7)  # where it is: nothing to do
    monkeypatch.setattr(m.layers[-1].ffn, "run", None)  # the forward raises in the last layer
    with pytest.raises(TypeError):
        m.forward(np.asarray([5]), [Span(one, 7, 1)])
    assert one.length == 7
    with pytest.raises(StateLost, match="a window failed"):  # its DeltaNet layers ran already
        one.truncate(7)
    one.truncate(0)  # a new sequence: always possible
    assert one.length == 0 and all(not a.any() for a in _states(one))


def test_a_failed_window_ends_only_the_request_without_a_copy(tiny):
    pack, _, prompts, want = tiny
    core, lines = one_of_two(pack, "--batch-mtp")
    sch = core.scheduler
    sch.log = lines.append
    a, b = (sch.submit(request(p, greedy(N))) for p in prompts)  # slots 0 and 1
    for _ in range(4):  # both prefilled and decoding
        sch._admit()
        sch._guarded_step()
    assert sch.slots[1].n_generated > 0
    sch.faults = FaultInjector("window-raise@1")  # every window with slot 1 raises after its forward
    sch.run_until_idle()
    ids, _, fin = collect(a)
    assert fin.reason == "length" and ids == want[0]  # its window rolled back and reran alone
    ids, _, fin = collect(b)
    assert fin.reason == "error" and fin.code == "internal_error"
    assert "injected fault at window-raise for slot 1" in fin.error and "no rollback copy" in fin.error
    assert ids and ids == want[1][: len(ids)]
    assert sum("which has no rollback copy; the request ends" in ln for ln in lines) == 1
    sch.faults = FaultInjector("")
    h = sch.submit(request(prompts[0], greedy(1)))  # slot 0 (free first); then slot 1 from a clean state
    g = sch.submit(request(prompts[1], greedy(N)))
    sch.run_until_idle()
    assert (collect(h)[0], collect(g)[0]) == (want[0][:1], want[1])


def test_auto_count_is_what_the_memory_left_holds():
    assert checkpoint_count(100, 250, 4) == 2
    assert checkpoint_count(100, 0, 4) == 0
    assert checkpoint_count(100, 10**9, 4) == 4
    assert checkpoint_count(100, None, 4) == 4  # free memory unknown: every slot, as before
    assert checkpoint_budget(1000, "cpu", 2, 100) == 800  # less one state copy per slot
    assert checkpoint_budget(MARGIN_BYTES["cuda"] + 500, "cuda", 2, 100) == 300  # less the GPU's margin
    assert checkpoint_budget(100, "cuda", 2, 100) == 0
    assert checkpoint_budget(None, "cuda", 2, 100) is None
    per = int(148.2 * MiB)
    plan = plan_checkpoints(None, 4, per, 2 * per + 96 * MiB)
    assert plan.flags() == [True, True, False, False]
    assert plan.line() == ("strata: recurrent state: slots 2-3 have no rollback copy (needs 148.2 MiB each, "
                           "96.0 MiB left): they decode one token per window")
    assert plan_checkpoints(9, 4, per, 0).count == 4  # asked: at most every slot, whatever the memory
    assert plan_checkpoints(9, 4, per, 0).line() is None


def test_auto_in_the_engine_and_in_strata_probe(tiny, monkeypatch, capsys):
    """The engine sizes auto from its backend's free memory; `strata probe` says what it would do."""
    from strata.cli.main import main

    pack, m, _, _ = tiny
    one, per = m.state_bytes(checkpoint=False), m.checkpoint_bytes()
    # the memory left once the weights are loaded (before, room for them: the pack is checked against it)
    monkeypatch.setattr(CpuBackend, "free_bytes", lambda self: 3 * one + per + per // 2 if self.held_bytes() else 1 << 40)
    core, lines = load_engine(["--pack", pack, "--device", "cpu", "--parallel", "3"])
    assert [s.rolls_back for s in core.scheduler.slots] == [True, False, False]
    left = (3 * one + per + per // 2 - 3 * one - per) / MiB
    assert (f"strata: recurrent state: slots 1-2 have no rollback copy (needs {per / MiB:.1f} MiB each, "
            f"{left:.1f} MiB left): they decode one token per window") in lines
    assert main(["probe", "--pack", pack, "--device", "cpu", "--parallel", "2", "--spec", "2", "--batch-mtp",
                 "--state-checkpoints", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert NO_COPY_LINE in out
    assert any(ln.startswith("strata probe: batch-MTP on for slot 0; batch-MTP off for slot 1") for ln in out)
