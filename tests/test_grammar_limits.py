"""Grammars past the grammar library's limits and logit_bias tables that leave nothing to
generate: a 400 naming the field when the request is made (a grammar whose first tokens meet a
limit, a table that bans the whole vocabulary), and when met later, that request alone ends
with a clear error the server answers 400 (not the engine's internal error, a 500)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from strata.protocol import ConstraintSpec, SamplingParams
from strata.grammar import GrammarError, compile_constraint, matcher as grammar_matcher
from support import shared_server
from support.shared_server import AUTH, MODEL
from tests.support.engines import run_all
from tests.support.model_fixtures import chat_ids, engine

server = shared_server.module_fixture(__name__)

def _schema(obj: dict) -> ConstraintSpec:
    return ConstraintSpec("json_schema", json.dumps(obj))


@pytest.mark.parametrize("spec, words", [
    (_schema({"type": "string", "pattern": "^a{300000}$"}), "lexer error"),
    (_schema({"type": "string", "pattern": "^((a{100}){100}){100}$"}), "lexer error"),
    (_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}), "max is 2000"),
    (_schema({"type": "object", "properties": {"x" * 1_000_000: {"type": "integer"}}, "required": ["x" * 1_000_000]}),
     "lexer error"),
    (ConstraintSpec("lark", 'start: "Once upon a time, in a land far away, there lived" /a{1000000}/'), "lexer error"),
])
def test_grammars_past_the_library_limits_are_refused_when_compiled(spec, words):
    core = engine(None, 1)
    with pytest.raises(GrammarError) as e:
        compile_constraint(spec, core.tokenizer, core.cfg.vocab_size)
    msg = e.value.message
    assert msg.startswith(f"{spec.kind}: exceeds a limit of the grammar library: ") and words in msg
    assert "\n" not in msg and len(msg) < 400


def test_a_limit_met_mid_output_ends_that_request_with_its_own_error(monkeypatch):
    # the compile-time walk off: the limit is met by the engine, as one past the walk would be
    core = engine(None, 1)
    monkeypatch.setattr(grammar_matcher, "PROBE_STEPS", 0)
    spec = _schema({"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(2001)}})
    compile_constraint(spec, core.tokenizer, core.cfg.vocab_size)  # (cached: the engine takes this one)
    prompt = chat_ids(core, "Give me an object.")
    (brace,) = core.tokenizer.encode("{")  # an open object (not "{}"), where the limit is
    params = SamplingParams(max_tokens=8, temperature=0.0, constraint=spec, logit_bias={brace: 100.0})
    ids, text, fin = run_all(core, [prompt], params, threaded=False)[0]
    assert (fin.reason, fin.code) == ("error", grammar_matcher.LIMIT_CODE)
    assert fin.error.startswith("the grammar library gave up at output token 1: Parser Error: ")
    # and the engine goes on: the next request is served
    _, text, fin = run_all(core, [prompt], SamplingParams(max_tokens=4, temperature=0.0), threaded=False)[0]
    assert fin.reason == "length" and text


def test_every_allowed_token_banned_ends_the_request_naming_logit_bias():
    core = engine(None, 1)
    prompt = chat_ids(core, "Give me an object.")
    spec = ConstraintSpec("json_object")
    grammar = compile_constraint(spec, core.tokenizer, core.cfg.vocab_size)
    first = grammar.matcher()
    mask = np.zeros(first.vocab_words, np.uint32)
    first.fill_mask(mask)
    allowed = [t for t in range(core.cfg.vocab_size) if mask[t // 32] >> (t % 32) & 1]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, constraint=spec,
                            logit_bias={t: float("-inf") for t in allowed})
    ids, text, fin = run_all(core, [prompt], params, threaded=False)[0]
    assert (fin.reason, fin.code) == ("error", grammar_matcher.DEAD_END_CODE) and ids == []
    assert fin.error.startswith("logit_bias: bans every token the grammar allows at output token 1")


def test_a_ban_that_leaves_tokens_is_honoured():
    core = engine(None, 1)
    prompt = chat_ids(core, "Say something.")
    keep = {28, 29, 30, 31}  # any few ids
    banned = {t: float("-inf") for t in range(core.cfg.vocab_size) if t not in keep}
    for seed in range(3):
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, logit_bias=banned)
        ids, _, fin = run_all(core, [prompt], params, threaded=False)[0]
        assert len(ids) == 6 and set(ids) <= keep, ids


def _chat(server, body: dict) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}], **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def test_http_limits_bans_and_honoured_bans(server):
    # a schema past a limit: 400 naming response_format, at once
    props = {f"p{i}": {"type": "integer"} for i in range(2000)}
    r = _chat(server, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": props}}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "exceeds a limit of the grammar library" in err["message"]
    # every id banned: 400 naming logit_bias (before: banned tokens came back with 200)
    vocab = 49152
    r = _chat(server, {"logit_bias": [[t, False] for t in range(vocab)], "max_tokens": 4})
    assert r.status_code == 400 and "logit_bias: bans all" in r.json()["error"]["message"], r.text
    # json_object with every id but a few banned, none of which can start an object: 400 naming logit_bias
    r = _chat(server, {"response_format": {"type": "json_object"}, "max_tokens": 4,
                       "logit_bias": [[t, False] for t in range(vocab) if t not in (0, 1, 2, 28, 29)]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias" and r.json()["error"]["code"] == "grammar_dead_end"
    # the same for a forced tool call
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    r = _chat(server, {"tools": [tool], "tool_choice": "required", "max_tokens": 8,
                       "logit_bias": [[t, False] for t in range(vocab) if t not in (0, 1, 2)]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias" and r.json()["error"]["code"] == "grammar_dead_end"


def test_a_greedy_row_with_nothing_left_does_not_end_as_a_stop():
    # greedy: a row of -inf has its argmax at id 0, the end-of-text token; the mask did not allow
    # it, so the request must not end as if the grammar had finished (before: "stop", empty output)
    core = engine(None, 1)
    prompt = chat_ids(core, "Give me an object.")
    banned = {t: float("-inf") for t in range(core.cfg.vocab_size) if t not in (0, 1, 2)}
    params = SamplingParams(max_tokens=8, temperature=0.0, constraint=ConstraintSpec("json_object"), logit_bias=banned)
    ids, text, fin = run_all(core, [prompt], params, threaded=False)[0]
    assert (fin.reason, fin.code) == ("error", grammar_matcher.DEAD_END_CODE) and text == ""
