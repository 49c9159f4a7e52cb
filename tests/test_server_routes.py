"""llama-server's routes (/tokenize, /detokenize, /props, /slots) and OpenAI's /v1/embeddings,
over real HTTP against a real `strata serve` (its engine child, the test model; the one of
tests/support/shared_server.py, shared with other modules): llama-server's field names, the
API key, the access log, bad input as one 400 naming the field."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from support import shared_server
from support.server_proc import HTTP, metric, openai_client
from support.shared_server import AUTH, KEY, N_CTX

N_EMBD = 576  # SmolLM2-135M's hidden width
VOCAB = 49152

# the key, "smol" served, 2 slots, a context of N_CTX
server = shared_server.module_fixture(__name__)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


def post(server, path: str, body, headers=None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTP.post(server.url + path, content=content, timeout=60,
                     headers={"content-type": "application/json", **AUTH, **(headers or {})})


def get(server, path: str, headers=AUTH) -> httpx.Response:
    return HTTP.get(server.url + path, headers=headers, timeout=30)


def bad(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert "\n" not in err["message"] and "Traceback" not in err["message"]
    return err["message"]


# ---------------------------------------------------------------- /tokenize, /detokenize

def test_tokenize_and_detokenize_round_trip(server):
    text = "Hello, world! The capital of France is Paris."
    ids = post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert ids and all(isinstance(i, int) and 0 <= i < VOCAB for i in ids)
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"content": text}
    # add_special as the vocabulary asks (SmolLM2 adds no BOS): never fewer tokens
    assert len(post(server, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]) >= len(ids)
    assert post(server, "/detokenize", {"tokens": []}).json() == {"content": ""}


def test_tokenize_with_pieces_gives_text_or_bytes(server):
    text = "Hi wörld ü"
    plain = post(server, "/tokenize", {"content": text}).json()["tokens"]
    pieces = post(server, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain
    # a piece is a string when its bytes are UTF-8 alone, else the list of its byte values
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode() == text
    assert any(isinstance(p["piece"], list) for p in pieces), pieces  # 'ü' is split inside its bytes here
    assert all(isinstance(p["piece"], str) for p in pieces[:2])


def test_tokenize_parse_special(server):
    marker = "<|im_start|>"
    assert len(post(server, "/tokenize", {"content": marker}).json()["tokens"]) == 1  # llama-server's default: parsed
    as_text = post(server, "/tokenize", {"content": marker, "parse_special": False}).json()["tokens"]
    assert len(as_text) > 1


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [1, VOCAB]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1], "extra": 1}, "extra"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"content": "x", "add_bos": True}, "add_bos"),
])
def test_token_routes_refuse_bad_bodies(server, path, body, param):
    bad(post(server, path, body), param)


# ---------------------------------------------------------------- /props, /slots

def test_props(server):
    p = get(server, "/props").json()
    settings = p["default_generation_settings"]
    assert settings["n_ctx"] == N_CTX and settings["is_processing"] is False
    params = settings["params"]
    assert params["temperature"] == 1.0 and params["top_p"] == 1.0 and params["top_k"] == 0
    assert params["repeat_last_n"] == 64 and params["repeat_penalty"] == 1.0 and params["n_predict"] == -1
    assert p["total_slots"] == 2
    assert p["model_path"].endswith(".gguf")
    assert "im_start" in p["chat_template"]
    assert isinstance(p["bos_token"], str) and p["eos_token"] == "<|im_end|>"
    assert p["build_info"].startswith("strata ")


def test_slots_idle(server):
    """(What a busy slot shows, by default and with --slots: tests/test_route_privacy.py.)"""
    idle = get(server, "/slots").json()
    assert [s["id"] for s in idle] == [0, 1]
    assert not any(s["is_processing"] for s in idle)


# ---------------------------------------------------------------- /v1/embeddings

def test_embeddings_with_the_openai_client(client, server):
    texts = ["The cat sat on the mat.", "Quantum chromodynamics"]
    r = client.embeddings.create(model="smol", input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1] and r.model == "smol"
    for d in r.data:
        assert len(d.embedding) == N_EMBD
        assert math.isclose(math.sqrt(sum(x * x for x in d.embedding)), 1.0, rel_tol=1e-4)
    n_tokens = sum(len(post(server, "/tokenize", {"content": t, "add_special": True}).json()["tokens"]) for t in texts)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens
    floats = client.embeddings.create(model="smol", input=texts[0], encoding_format="float").data[0].embedding
    as_b64 = client.embeddings.create(model="smol", input=texts[0]).data[0].embedding
    assert floats == pytest.approx(as_b64, abs=1e-7)  # base64 holds the same values as float32
    assert floats == pytest.approx(r.data[0].embedding, abs=1e-4)  # alone or beside another input
    ids = post(server, "/tokenize", {"content": texts[0], "add_special": True}).json()["tokens"]
    by_ids = client.embeddings.create(model="smol", input=ids, encoding_format="float").data[0].embedding
    assert by_ids == pytest.approx(floats, abs=1e-5)  # a prompt of ids is the same prompt


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [1, VOCAB]}, "input[1]"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "word " * 2000}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x", "colour": "red"}, "colour"),
])
def test_embeddings_refuse_bad_bodies(server, body, param):
    r = post(server, "/v1/embeddings", body)
    if param == "input" and body["input"] == "word " * 2000:
        assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"
        return
    bad(r, param)


def test_embeddings_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")


# ---------------------------------------------------------------- key, access log, metrics

ROUTES = [("POST", "/tokenize", {"content": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
          ("GET", "/props", None), ("GET", "/slots", None), ("POST", "/v1/embeddings", {"input": "x"})]


@pytest.mark.parametrize("method,path,body", ROUTES)
def test_every_route_needs_the_key_and_is_logged(server, method, path, body):
    mark = len(server.lines)  # (the lines of these requests, not of earlier ones)
    r = HTTP.request(method, server.url + path, json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = HTTP.request(method, server.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    server.wait_line(rf"strata serve: {method} {path} 401 ", start=mark)
    server.wait_line(rf"strata serve: {method} {path} 200 in=" + (r"\d+ out=0" if "embeddings" in path else "-"),
                     start=mark)


def test_the_engine_froze_what_it_loaded_out_of_the_collectors_sight(server):
    # (strata.server.gc_policy: full collections then skip the model, tokenizer and web app)
    assert metric(server.url, "strata_gc_frozen_objects", AUTH) > 10_000
    assert 'python_gc_collections_total{generation="2"}' in get(server, "/metrics").text


def test_embeddings_are_counted(server):
    assert metric(server.url, 'strata_requests_total{endpoint="embeddings",outcome="stop"}', AUTH) >= 1
    assert "strata_prompt_tokens_cached_total" in get(server, "/metrics").text
