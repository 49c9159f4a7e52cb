"""Constrained decoding through the scheduler: the mask is applied to the window's rows, the
output follows the grammar, and speculative decoding with drafts the grammar cuts stays
lossless (greedy tokens equal plain decoding's)."""

from __future__ import annotations

import json

import pytest

from strata.engine.protocol import ConstraintSpec, SamplingParams
from tests.support.engines import load_engine, make_seed_moe, run_all
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
    ended = 0
    for seed in range(4):  # sampled rows too (the device sampler's path on the GPU)
        _, text, fin = run_all(core, [prompt], SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                              constraint=ConstraintSpec("json_object")),
                               threaded=False)[0]
        assert text.startswith("{")
        if fin.reason == "stop":  # (a long object may reach max_tokens first)
            assert isinstance(json.loads(text), dict)
            ended += 1
    assert ended >= 1


@pytest.mark.parametrize("batch_mtp", [False, True])
def test_mtp_with_grammar_equals_plain(tmp_path_factory, batch_mtp):
    pack = make_seed_moe(tmp_path_factory.mktemp("seed-moe-grammar"))
    base = ["--pack", str(pack), "--device", "cpu", "--parallel", "2"]
    plain, _ = load_engine(base)
    prompts = [plain.tokenizer.encode(t) for t in ("Once upon a time", "The capital of")]
    params = SamplingParams(max_tokens=24, temperature=0.0, constraint=ConstraintSpec("json_object"))
    want = [(ids, text) for ids, text, _ in run_all(plain, prompts, params, threaded=False)]
    spec, _ = load_engine(base + ["--mtp", str(pack / "mtp"), "--spec", "3"] + (["--batch-mtp"] if batch_mtp else []))
    outs = run_all(spec, prompts if batch_mtp else prompts[:1], params, threaded=False)
    assert [(ids, text) for ids, text, _ in outs] == want[: len(outs)]
    assert all(t.startswith("{") for _, t in want)
    assert sum(s.counters.drafted for s in spec.scheduler.slots) > 0
