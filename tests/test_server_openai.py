"""End to end: the official `openai` client and raw HTTP against a real `strata serve`
(real engine child process, bundled SmolLM2 test model, real HTTP on 127.0.0.1): the server
that tests/support/shared_server.py starts from its CONFIG, shared with other modules."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from support import shared_server
from support.server_proc import HTTP, metric, openai_client, wait_until
from support.shared_server import AUTH, KEY, N_CTX

HI = [{"role": "user", "content": "Name three colors."}]

# started from shared_server.CONFIG: JSON with comments, "smol" served, the key, 2 slots, a
# queue of 8, a context of N_CTX, and the unknown key "homepage"
server = shared_server.module_fixture(__name__)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


def post(server, path: str, body, headers=None, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTP.post(server.url + path, content=content, timeout=timeout,
                     headers={"content-type": "application/json", **AUTH, **(headers or {})})


def test_unknown_config_key_is_named_in_a_warning(server):
    assert "unknown key(s) ignored: homepage" in server.output()


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_chat_stream_and_usage_agree(client):
    full = client.chat.completions.create(model="smol", messages=HI, max_tokens=6, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    u = full.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and 0 < u.completion_tokens <= 6

    # the same question as OpenAI list-form content: the same prompt, the same greedy answer
    parts = [{"role": "user", "content": [{"type": "text", "text": HI[0]["content"]}]}]
    chunks = list(client.chat.completions.create(
        model="smol", messages=parts, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=2))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the stream says what the plain answer said
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.model_dump() == u.model_dump()
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == u.completion_tokens  # one logprob entry per generated token
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob


def test_completions_exact_prompt_count_and_echo(client):
    ids = [504, 3575, 282, 4649, 314]  # a prompt given as token ids: its count is exact
    r = client.completions.create(model="smol", prompt=ids, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"
    echoed = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=2,
                                       temperature=0, echo=True, extra_body={"ignore_eos": True})
    text = echoed.choices[0].text
    assert text.startswith("The capital of France is") and len(text) > len("The capital of France is")


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model="smol", prompt="One, two, three, four,", max_tokens=6,
                                     temperature=0).choices[0].text
    stop = base.strip().split()[1] if len(base.strip().split()) > 1 else base.strip()[-1]
    cut = client.completions.create(model="smol", prompt="One, two, three, four,", max_tokens=6,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base[:base.index(stop)]


def test_client_errors(client, server):
    with pytest.raises(openai.BadRequestError, match="n: only 1"):
        client.chat.completions.create(model="smol", messages=HI, n=2)
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.chat.completions.create(model="nope", messages=HI)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="hello " * 700, max_tokens=4)
    err = e.value.body if "type" in e.value.body else e.value.body["error"]
    assert err["type"] == "exceed_context_size_error"
    assert err["n_ctx"] == N_CTX and err["n_prompt_tokens"] > N_CTX


BAD_BODIES = [
    (b"{bad json", "not valid JSON"),
    (b"", "empty"),
    (b"[1, 2]", "JSON object"),
    (b"\xff\xfe{}", "UTF-8"),
    (b"{}", "messages: required"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"content": "x"}]}', "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "text"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', "stop"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50, "logprobs": true}', "top_logprobs"),
]


@pytest.mark.parametrize("body,words", BAD_BODIES)
def test_bad_bodies_are_400_naming_the_problem(server, body, words):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert words in err["message"]


def test_http_edge_cases_then_still_serving(server):
    assert post(server, "/v1/completions", {"prompt": ["a", "b"]}).status_code == 400
    assert post(server, "/v1/completions", {"prompt": 7}).status_code == 400
    huge = b'{"prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}'
    r = post(server, "/v1/completions", huge)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large_error"
    assert HTTP.get(server.url + "/v1/chat/completions", headers=AUTH).status_code == 405
    r = HTTP.get(server.url + "/v2/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = post(server, "/v1/chat/completions", {"messages": HI}, headers={"Authorization": ""})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert HTTP.get(server.url + "/health").json() == {"status": "ok"}  # no key needed
    r = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_more_clients_than_slots_all_complete(server):
    results: list[httpx.Response] = []

    def one(i: int) -> None:
        results.append(post(server, "/v1/completions", {"prompt": f"Count to {i}:", "max_tokens": 2,
                                                        "ignore_eos": True}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [r.status_code for r in results] == [200] * 3
    assert all(r.json()["usage"]["completion_tokens"] == 2 for r in results)


def test_disconnect_frees_the_slot(server):
    body = {"prompt": "Tell a very long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    for _ in range(2):  # fill both slots, then walk away
        with HTTP.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and '"text":"' in line:
                    break
    # (a guard against a hang only: the slots are freed once the engine hears of the disconnects)
    assert wait_until(lambda: metric(server.url, "strata_slots_busy", AUTH) == 0, 60), "slots still busy"
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200


def test_metrics_names(server):
    text = HTTP.get(server.url + "/metrics", headers=AUTH).text
    for name in ("strata_server_requests_total", "strata_server_engine_restarts_total", "strata_server_queue_depth",
                 "strata_requests_total", "strata_prompt_tokens_total", "strata_completion_tokens_total",
                 "strata_slots_busy", "strata_queue_depth", "strata_mtp_windows_total",
                 "strata_mtp_drafted_tokens_total", "strata_mtp_accepted_tokens_total"):
        assert f"\n{name}" in text, name
    assert metric(server.url, "strata_completion_tokens_total", AUTH) > 0
