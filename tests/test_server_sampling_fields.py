"""Request fields of /v1/chat/completions and /v1/completions: every field OpenAI's client or
llama-server's clients send is honoured, accepted because it changes nothing, or refused with a
400 naming it (never ignored); the honoured sampling fields (logit_bias in both spellings,
penalties, repeat_last_n, min_tokens) change the tokens as they should; cached prompt tokens in
usage and /metrics. Over real HTTP against a real `strata serve` and the test model, greedy (the
server of tests/support/shared_server.py, shared with other modules)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from strata.server.schemas import ChatCompletionRequest, CompletionRequest
from support import shared_server
from support.server_proc import HTTP, metric, openai_client
from support.shared_server import AUTH, KEY, N_CTX

VOCAB = 49152
SERVER_MD = Path(__file__).resolve().parents[1] / "docs" / "SERVER.md"

# llama-server's own request options (tools/server/README.md, /completion and the chat route)
LLAMA_SERVER_FIELDS = """temperature dynatemp_range dynatemp_exponent top_k top_p min_p n_predict n_indent n_keep
n_cmpl n_cache_reuse stream stop typical_p repeat_penalty repeat_last_n presence_penalty frequency_penalty
dry_multiplier dry_base dry_allowed_length dry_penalty_last_n dry_sequence_breakers xtc_probability xtc_threshold
mirostat mirostat_tau mirostat_eta grammar json_schema seed ignore_eos logit_bias n_probs min_keep t_max_predict_ms
id_slot cache_prompt return_tokens samplers timings_per_token return_progress sse_ping_interval
post_sampling_probs response_fields lora chat_template_kwargs reasoning_format parallel_tool_calls
top_n_sigma""".split()


def known_fields(model) -> set[str]:
    return set(model.model_fields) | set(model.aliases) | set(model.field_rules)


def documented_fields() -> set[str]:
    text = SERVER_MD.read_text()
    section = text[text.index("### Request fields"):text.index("## Validation and limits")]
    return set(re.findall(r"`([a-z_]+)(?:\.[a-z_]+)?`", section))


@pytest.mark.parametrize("model,openai_fields", [
    (ChatCompletionRequest, chat_params.CompletionCreateParamsBase.__annotations__),
    (CompletionRequest, completion_params.CompletionCreateParamsBase.__annotations__),
])
def test_every_field_of_openais_request_and_llama_servers_is_known_and_documented(model, openai_fields):
    fields = set(openai_fields) | {"stream"} | set(LLAMA_SERVER_FIELDS)
    if model is CompletionRequest:
        fields -= {"chat_template_kwargs", "reasoning_format", "parallel_tool_calls"}  # chat-only
    assert not fields - known_fields(model), "neither honoured nor in field_policy's table"
    assert not known_fields(model) - documented_fields(), "missing from docs/SERVER.md's field tables"


# ---------------------------------------------------------------- the server

# the key, "smol" served, 2 slots, a context of N_CTX
server = shared_server.module_fixture(__name__)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


def post(server, path: str, body) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, headers=AUTH, timeout=120)


def complete(server, prompt, **fields) -> dict:
    r = post(server, "/v1/completions", {"prompt": prompt, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(server, text: str) -> list[int]:
    return post(server, "/tokenize", {"content": text}).json()["tokens"]


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "Hi", "max_tokens": 1}

# fields refused at any value but their off one: (field, a value that would change the result)
REFUSED = [("n", 2), ("typical_p", 0.5), ("mirostat", 2), ("dynatemp_range", 0.5), ("xtc_probability", 0.5),
           ("dry_multiplier", 0.8), ("top_n_sigma", 1.0), ("min_keep", 3), ("n_probs", 5), ("n_cmpl", 2),
           ("id_slot", 1), ("t_max_predict_ms", 100), ("n_indent", 2), ("samplers", ["top_k"]),
           ("grammar", "root ::= \"a\""), ("lora", [{"id": 0, "scale": 1}]),
           ("timings_per_token", True), ("return_tokens", True), ("return_progress", True),
           ("post_sampling_probs", True), ("response_fields", ["content"]),
           ("user", 5), ("metadata", {"k": 5}), ("store", "yes"), ("cache_prompt", 1), ("n_keep", -5),
           ("colour", "blue"), ("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0),
           ("repeat_penalty", -1), ("repeat_last_n", -2), ("min_tokens", -1), ("logit_bias", {"abc": 1}),
           ("logit_bias", {"5": 101}), ("logit_bias", [[5, True]]), ("logit_bias", [[5]]),
           ("logit_bias", {str(VOCAB): 1}), ("logit_bias", [[VOCAB + 3, -1]]), ("max_tokens", 0)]
CHAT_REFUSED = [("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
                ("web_search_options", {}), ("verbosity", "low"), ("reasoning_effort", "high"),
                ("reasoning_format", "deepseek"), ("functions", [{"name": "f"}]), ("function_call", "auto"),
                ("moderation", {"model": "omni"}), ("chat_template_kwargs", {"add_generation_prompt": False})]
COMPLETION_REFUSED = [("best_of", 3), ("suffix", "tail")]


@pytest.mark.parametrize("route,field,value", [("chat", f, v) for f, v in REFUSED + CHAT_REFUSED]
                         + [("completions", f, v) for f, v in REFUSED + COMPLETION_REFUSED])
def test_a_field_that_would_change_the_result_is_refused_naming_it(server, route, field, value):
    path, body = ("/v1/chat/completions", CHAT) if route == "chat" else ("/v1/completions", COMPLETION)
    r = post(server, path, {**body, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field + ":"), err
    assert "\n" not in err["message"]


NO_OPS = {"n": 1, "typical_p": 1.0, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "dynatemp_range": 0,
          "dynatemp_exponent": 1, "xtc_probability": 0, "xtc_threshold": 0.1, "dry_multiplier": 0, "dry_base": 1.75,
          "dry_allowed_length": 2, "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n"], "top_n_sigma": -1,
          "min_keep": 0, "n_probs": 0, "n_cmpl": 1, "id_slot": -1, "t_max_predict_ms": 0, "n_indent": 0,
          "samplers": None, "grammar": "", "json_schema": None, "lora": [], "timings_per_token": False,
          "return_tokens": False, "return_progress": False, "post_sampling_probs": False, "response_fields": None,
          "user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
          "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
          "prompt_cache_options": {"ttl": "1h"}, "cache_prompt": True, "n_cache_reuse": 0, "n_keep": -1,
          "sse_ping_interval": 5, "seed": -1}


def test_no_op_values_are_accepted_and_change_nothing(server):
    plain = complete(server, "The capital of France is", max_tokens=4)
    with_no_ops = complete(server, "The capital of France is", max_tokens=4, best_of=1, suffix="", **NO_OPS)
    assert with_no_ops["choices"][0]["text"] == plain["choices"][0]["text"]
    chat = {**CHAT, "max_tokens": 4, "temperature": 0}
    r = post(server, "/v1/chat/completions", {**chat, **NO_OPS, "prediction": {"type": "content", "content": "x"},
                                              "modalities": ["text"], "audio": None, "reasoning_format": "none",
                                              "stream_options": None, "parallel_tool_calls": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == post(server, "/v1/chat/completions", chat).json()[
        "choices"][0]["message"]["content"]


# ---------------------------------------------------------------- honoured fields change the tokens

def test_logit_bias_forces_and_bans_tokens(client, server):
    (hello,) = token_ids(server, "Hello")
    forced = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=3, temperature=0,
                                       logit_bias={str(hello): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "Hello" * 3
    first = complete(server, "The capital of France is", max_tokens=1)["choices"][0]["text"]
    (first_id,) = token_ids(server, first)
    for spelling in ({str(first_id): -100}, [[first_id, False]]):  # OpenAI's and llama-server's
        banned = complete(server, "The capital of France is", max_tokens=1, logit_bias=spelling)
        assert banned["choices"][0]["text"] != first
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, logit_bias={str(hello): 100})
    assert chat.choices[0].message.content == "Hello" * 2


REPETITIVE = "one one one one one one one one one one one one"


def test_penalties_change_a_repetitive_answer(server):
    base = complete(server, REPETITIVE, max_tokens=8, ignore_eos=True)["choices"][0]["text"]
    for penalty in ({"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert complete(server, REPETITIVE, max_tokens=8, ignore_eos=True, **penalty)["choices"][0]["text"] != base
    # (a presence penalty of 2, its most, lowers a repeat once: too little to flip this greedy answer)
    assert complete(server, REPETITIVE, max_tokens=8, ignore_eos=True, presence_penalty=2.0, frequency_penalty=1.0)[
        "choices"][0]["text"] != complete(server, REPETITIVE, max_tokens=8, ignore_eos=True, frequency_penalty=1.0)[
        "choices"][0]["text"]
    # repeat_last_n 0: the penalties look at no token
    off = complete(server, REPETITIVE, max_tokens=8, ignore_eos=True, frequency_penalty=2.0, repeat_last_n=0)
    assert off["choices"][0]["text"] == base
    # llama-server's spelling is the same field
    a = complete(server, REPETITIVE, max_tokens=8, ignore_eos=True, repetition_penalty=1.3, repeat_last_n=-1)
    b = complete(server, REPETITIVE, max_tokens=8, ignore_eos=True, repeat_penalty=1.3, repeat_last_n=-1)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_min_tokens_holds_the_end_back(client):
    ask = [{"role": "user", "content": "Reply with the single word: yes"}]
    short = client.chat.completions.create(model="smol", messages=ask, max_tokens=40, temperature=0)
    assert short.choices[0].finish_reason == "stop", short
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(model="smol", messages=ask, max_tokens=40, temperature=0,
                                            extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.chat.completions.create(model="smol", messages=ask, max_tokens=4, extra_body={"min_tokens": 5})


def test_max_tokens_minus_one_means_the_rest_of_the_context(server):
    r = complete(server, [19556] * (N_CTX - 6), max_tokens=-1, ignore_eos=True)  # room for 6 tokens
    assert r["usage"]["completion_tokens"] == 6
    assert complete(server, "Hi", n_predict=3, ignore_eos=True)["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- cached prompt tokens

LONG = "Here is a long shared system prompt about the history of bread. " * 12  # several 64-token blocks


def test_cached_tokens_in_usage_streams_and_metrics(client, server):
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model="smol", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model="smol", messages=messages, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 64 <= cached < again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content  # reuse changes nothing
    chunks = list(client.chat.completions.create(model="smol", messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert metric(server.url, "strata_prompt_tokens_cached_total", AUTH) >= 2 * cached
    legacy = complete(server, LONG, max_tokens=1)
    assert json.dumps(legacy["usage"]).count("cached_tokens") == 1
