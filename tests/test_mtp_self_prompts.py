"""Training text from requests the target writes itself, and how collection lays out its windows.

Runs the real test model on the CPU backend: it must write whole, distinct user requests from
its own chat template, and the trainer must answer them greedily beside the built-in prompts.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.mtp.train.collect import answer_modes, generate
from strata.mtp.train.self_prompts import user_turn_prefix, write_prompts
from strata.mtp.train.config import TrainConfig
from strata.mtp.train.data import SELF_KIND, _interleave, collect_data, load_target


@pytest.fixture(scope="module")
def core():
    return load_target(None, lambda s: None, "cpu")


def test_the_prefix_ends_where_the_users_text_begins(core):
    prefix = user_turn_prefix(core.chat, core.tokenizer)
    text = core.tokenizer.decode(prefix)
    assert text.endswith("<|im_start|>user\n")
    assert "assistant" not in text.split("<|im_start|>user")[-1]


@pytest.mark.slow
def test_the_target_writes_whole_distinct_requests(core):
    logs: list[str] = []
    texts = write_prompts(core.model, core.tokenizer, core.chat, 6, slots=8, seed=11, max_len=48, log=logs.append)
    assert len(texts) == 6 and len(set(texts)) == 6
    for t in texts:
        assert t == t.strip() and "<|" not in t
        assert len(core.tokenizer.encode(t, add_special=False)) >= 4
    assert any("6 requests written by the target" in line for line in logs)
    # each request from its own random stream: the same seed writes the same requests
    again = write_prompts(core.model, core.tokenizer, core.chat, 6, slots=8, seed=11, max_len=48, log=lambda s: None)
    assert again == texts
    # held-out prompts stay held out: a request equal to one (case and punctuation aside) is dropped
    fewer = write_prompts(core.model, core.tokenizer, core.chat, 6, slots=8, seed=11, max_len=48, log=lambda s: None,
                          exclude=[texts[2].upper() + "!"])
    assert texts[2] not in fewer and fewer[:2] == texts[:2]


@pytest.mark.slow
def test_self_prompts_are_answered_greedily_beside_the_built_ins(core):
    cfg = TrainConfig(pack=None, out="unused", prompts=4, self_prompts=4, max_new=6, slots=8, held_out_per_kind=1,
                      seed=5)
    train, val = collect_data(core, cfg, lambda s: None)
    own = [s for s in train if s.kind == SELF_KIND]
    assert len(own) == 4 and len(train) == 8 and len(val) == 4
    for s in own:  # greedy: every answer token is the target's own argmax (top-1 of its recorded row)
        n_prompt = len(s.tokens) - int((s.top_ids[:, 0] >= 0).sum())
        rows = np.nonzero(s.top_ids[:, 0] >= 0)[0]
        assert rows[0] == n_prompt - 1
        assert all(int(s.tokens[r + 1]) == int(s.top_ids[r, 0]) for r in rows)


def test_decode_windows_hold_one_token_per_sequence(core):
    """Prompts are prefilled in windows of their own, so every other window is a pure decode
    window (what CUDA graphs replay); admissions wait for an eighth of the slots."""
    windows: list[list[int]] = []
    forward = core.model.forward

    def recording(tokens, spans, **kw):
        windows.append([int(sp.count) for sp in spans])
        return forward(tokens, spans, **kw)

    core.model.forward = recording
    try:
        prompts = [("chat", core.tokenizer.encode(f"Question {i}: why?", add_special=True)) for i in range(12)]
        seqs = generate(core.model, prompts, slots=8, max_new=5, sample_every=0, log=lambda s: None)
    finally:
        core.model.forward = forward
    assert len(seqs) == 12
    for counts in windows:
        assert all(c > 1 for c in counts) or all(c == 1 for c in counts), counts
    prompt_windows = [c for c in windows if c[0] > 1]
    assert [len(c) for c in prompt_windows] == [8, 4]  # 8 at once, then the 4 left when 4 slots are free


def test_answer_modes_and_interleave():
    assert answer_modes(6, 2) == [True, False, True, False, True, False]
    assert answer_modes(6, 0, sampled_from=4) == [True, True, True, True, False, False]
    merged = _interleave(list("ab"), list(range(6)))
    assert sorted(map(str, merged)) == sorted(map(str, list("ab") + list(range(6))))
    assert merged[0] == "a" and merged.index("b") <= 4  # spread through, not appended
