"""Constrained decoding through the scheduler: the mask is applied to the window's rows, the
output follows the grammar, and speculative decoding with drafts the grammar cuts stays
lossless (greedy tokens equal plain decoding's)."""

from __future__ import annotations

import json

import pytest

from strata.protocol import ConstraintSpec, SamplingParams
from tests.support.engines import load_engine, request, run_all, shared_seed_moe
from tests.support.model_fixtures import chat_ids, engine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def test_json_schema_output_parses_and_ends():
    core = engine(None, 4)
    prompt = chat_ids(core, "Give me a person as JSON.")
    spec = ConstraintSpec("json_schema", json.dumps(SCHEMA))
    ids, text, fin = run_all(core, [prompt], SamplingParams(max_tokens=60, temperature=0.0, constraint=spec),
                             threaded=False)[0]
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and fin.reason == "stop"
    # sampled rows too (the device sampler's path on the GPU): four seeds in one go, each in its
    # own slot with its own matcher, their masked rows side by side in each window. 32 tokens
    # each: seed 2's object ends at 14 tokens; the other three write long objects that reach
    # max_tokens first (as they do at 60)
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=seed, constraint=ConstraintSpec("json_object"))
              for seed in range(4)]
    handles = [core.submit(request(prompt, p)) for p in params]
    core.scheduler.run_until_idle()
    ended = 0
    for h in handles:
        _, text, fin = h.collect(timeout=120)
        assert text.startswith("{")
        if fin.reason == "stop":  # (a long object may reach max_tokens first)
            assert isinstance(json.loads(text), dict)
            ended += 1
    assert ended >= 1


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return shared_seed_moe(tmp_path_factory)


@pytest.fixture(scope="module")
def moe_plain(moe):
    """Plain decoding of both prompts (two slots), once for both parametrizations."""
    plain, _ = load_engine(["--pack", str(moe), "--device", "cpu", "--parallel", "2"])
    prompts = [plain.tokenizer.encode(t) for t in ("Once upon a time", "The capital of")]
    want = [(ids, text) for ids, text, _ in run_all(plain, prompts, GRAMMAR_PARAMS, threaded=False)]
    return prompts, want


GRAMMAR_PARAMS = SamplingParams(max_tokens=24, temperature=0.0, constraint=ConstraintSpec("json_object"))


@pytest.mark.parametrize("batch_mtp", [False, True])
def test_mtp_with_grammar_equals_plain(moe, moe_plain, batch_mtp):
    prompts, want = moe_plain
    base = ["--pack", str(moe), "--device", "cpu", "--parallel", "2"]
    spec, _ = load_engine(base + ["--mtp", str(moe / "mtp"), "--spec", "3"] + (["--batch-mtp"] if batch_mtp else []))
    outs = run_all(spec, prompts if batch_mtp else prompts[:1], GRAMMAR_PARAMS, threaded=False)
    assert [(ids, text) for ids, text, _ in outs] == want[: len(outs)]
    assert all(t.startswith("{") for _, t in want)
    assert sum(s.counters.drafted for s in spec.scheduler.slots) > 0
