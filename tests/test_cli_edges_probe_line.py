"""The start-up line about batch-MTP says what a slot without it really does, checked against the
run's own counters: a slot alone still drafts and verifies through the one-slot proposer (one
slot: in every window; several slots: in every window no other slot is busy in), and only a window
shared with other slots adds one token for it."""

from __future__ import annotations

import pytest

from strata.backend.kernel_table import table_for_backend
from strata.kernels.probe import SHARED_WINDOWS_ONLY, instead, run_probe
from tests.support.engines import chat_prompts, greedy, load_engine, run_all
from tests.support.model_fixtures import default_model_or_skip

# the default model with its shipped draft (MTP on by default), a short context: fast to load
BASE = ["--batch-mtp", "--device", "cpu", "--max-context", "256", "--threads", "1"]
N_TOKENS = 12


def _probe_line(lines: list[str]) -> str:
    probe = [ln for ln in lines if ln.startswith("strata probe:")]
    assert len(probe) == 1, lines
    return probe[0]


@pytest.fixture(scope="module")
def model():
    return default_model_or_skip()


def test_one_slot_the_line_says_it_drafts_and_it_does(model):
    core, lines = load_engine(BASE)
    line = _probe_line(lines)
    assert line == ("strata probe: batch-MTP off for slot 0: only one slot (--parallel 1): there is nothing to "
                    "batch; it drafts and verifies on its own in every window, as without --batch-mtp")
    [(ids, _, fin)] = run_all(core, chat_prompts(core, ["Write a list of three colours."]), greedy(N_TOKENS),
                              threaded=False)
    slot = core.metrics()["slots"][0]
    assert fin.reason in ("length", "stop") and ids
    assert slot["mtp_windows"] > 0 and slot["mtp_drafted"] > 0, slot


def test_several_slots_draft_alone_and_add_one_token_in_shared_windows(model):
    # the model's main type taken out of the native table: batch-MTP is off for both slots
    core, lines = load_engine([*BASE, "--parallel", "2", "--no-native", "Q4_1"])
    line = _probe_line(lines)
    assert line.startswith("strata probe: batch-MTP off for slots 0-1: ") and "no native MMVQ kernel on cpu" in line
    assert line.endswith(SHARED_WINDOWS_ONLY[1])
    prompts = chat_prompts(core, ["Write a list of three colours.", "Name two rivers."])
    run_all(core, prompts[:1], greedy(N_TOKENS), threaded=False)  # alone: it drafts
    alone = core.metrics()["slots"][0]
    assert alone["mtp_drafted"] > 0, alone
    before = core.metrics()
    run_all(core, prompts, greedy(N_TOKENS), threaded=False)  # together: one token each per shared window
    after = core.metrics()
    fell_back = after["batch_mtp_fallbacks"].get("no_native_kernel", 0) - \
        before["batch_mtp_fallbacks"].get("no_native_kernel", 0)
    shared_windows = after["windows"] - before["windows"]
    assert fell_back > 0 and shared_windows > 0, (before, after)


def test_without_a_draft_one_slot_is_said_to_decode_one_token(model):
    """--spec 0 --batch-mtp --parallel 1: no draft, so not the one-slot clause that says it drafts."""
    core, lines = load_engine([*BASE, "--spec", "0"])
    line = _probe_line(lines)
    assert "no MTP draft" in line and line.endswith("; it decodes one token per window")
    run_all(core, chat_prompts(core, ["Hi"]), greedy(4), threaded=False)
    assert core.draft is None and core.metrics()["slots"][0]["mtp_drafted"] == 0


@pytest.mark.parametrize("code,n,words", [
    ("no_room", 1, "it drafts only in windows where no other slot is busy"),
    ("no_native_kernel", 3, "each drafts only in windows where no other slot is busy"),
    ("no_checkpoint", 2, "they never draft"),
    ("no_draft", 2, "they decode one token per window"),
])
def test_each_reason_has_its_clause(code, n, words):
    assert instead(code, n).startswith(words)


def test_a_lone_slot_without_a_draft_is_no_draft_not_single_slot():
    tensors = {"token_embd.weight": (0, (8, 16)), "blk.0.attn_q.weight": (0, (8, 8))}
    rep = run_probe(tensors, None, "cpu", table_for_backend("cpu", set()), parallel=1, spec=0, batch_mtp=True)
    assert rep.slots[0].reason_code == "no_draft"
