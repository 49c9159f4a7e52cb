"""The HTTP edge, one test per way a request used to take the server down or get around it:
negative seeds, token ids outside the vocabulary, big bodies blocking the event loop, the
engine child reachable without the key, bad bodies answered with 500, a body that never
arrives, content types, Host / Origin / CORS, path parameters reaching other routes.

End to end against a real `strata serve` on the test model; the pure policies are also
checked directly."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import quote

import httpx
import pytest

from strata.server.edge import EdgePolicy, content_type_ok
from strata.server.errors import APIError
from strata.server.strict_json import parse_json_object
from support import raw_http
from support.early import Early, finish, selected, strata_later
from support.server_proc import HTTP, start_serve

KEY = "edge-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 49152  # SmolLM2
N_CTX = 8192  # big enough that a ~500 KB prompt passes the early length check and is tokenized


GENERATE = ["generate", "--max-context", "256", "--prompt", "Hi", "--max-tokens", "2", "--temperature", "0.8",
            "--json"]


@pytest.fixture(scope="module", autouse=True)
def early(request):
    """The two `strata generate` runs start with the module: they load the model while the
    server does (their test, before any that times the server, waits for them)."""
    e = Early()
    try:
        if selected(request, "test_generate_seed_minus_one_is_random_and_a_bad_seed_is_one_line"):
            for seed in ("-5", "-1"):
                e.start(f"generate {seed}", lambda seed=seed: strata_later(*GENERATE, "--seed", seed))
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = {"api_key": KEY, "body_timeout": 1.0, "parallel": 2, "args": ["--max-context", str(N_CTX)],
           "allowed_origins": ["https://app.example"], "allowed_hosts": ["myhost.lan"]}
    p = start_serve(tmp_path_factory.mktemp("edge"), cfg)
    try:
        p.wait_healthy()
        yield p
    finally:
        p.kill_tree()


def post(server, path: str, body, timeout: float = 60.0, **headers) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, headers={**AUTH, **headers}, timeout=timeout)


def complete(server, **fields) -> httpx.Response:
    return post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **fields})


def assert_serving(server) -> None:
    r = complete(server, max_tokens=1)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- seeds

def test_seed_minus_one_means_random_and_the_engine_serves_on(server):
    for _ in range(2):  # -1 once wedged the engine's thread: the second request then hung
        r = complete(server, seed=-1, temperature=0.8)
        assert r.status_code == 200, r.text
    assert_serving(server)


@pytest.mark.parametrize("seed", [-2, -(2 ** 70), 2 ** 64])
def test_other_seeds_outside_the_range_are_400_naming_seed(server, seed):
    r = complete(server, seed=seed, temperature=0.8)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert_serving(server)


def test_generate_seed_minus_one_is_random_and_a_bad_seed_is_one_line(early):
    run = lambda seed: early.take(f"generate {seed}", lambda: strata_later(*GENERATE, "--seed", seed))  # noqa: E731
    bad = finish(run("-5"), timeout=120)
    assert bad.returncode == 2 and "--seed" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    ok = finish(run("-1"), timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout.strip().splitlines()[-1])["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------- token ids

@pytest.mark.parametrize("bad_id", [VOCAB, 10 ** 9, 2 ** 63, -1])
def test_token_ids_outside_the_vocabulary_are_400_naming_the_index(server, bad_id):
    r = complete(server, prompt=[1, bad_id])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt[1]", r.text
    assert_serving(server)


def test_ids_inside_the_vocabulary_still_work(server):
    r = complete(server, prompt=[1, VOCAB - 1, 42])
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3, r.text


# ---------------------------------------------------------------- big bodies off the event loop

class Stream(threading.Thread):
    """A long stream; `gaps` are the seconds between its chunks."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.arrivals: list[float] = []
        self.started = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        try:
            with HTTP.stream("POST", self.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"text":"' in line:
                        self.arrivals.append(time.monotonic())
                        self.started.set()
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:
            pass  # the server is stopped at the end of the module, maybe while this still reads

    def max_gap(self, since: float) -> float:
        times = [t for t in self.arrivals if t >= since]
        return max((b - a for a, b in zip(times, times[1:])), default=float("inf"))


HUGE = {"messages": [{"role": "user", "content": "word " * 2_000_000}]}  # 10 MB: cannot fit
BIG = {"messages": [{"role": "user", "content": "word " * 100_000}]}  # 500 KB: tokenized, then too long


def refusal_seconds(server, body: dict) -> float:
    """How long the server takes to refuse `body` (too long for the context) on its own."""
    t0 = time.monotonic()
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error", r.text
    return time.monotonic() - t0


def test_big_bodies_do_not_stall_other_requests_or_streams(server):
    stream = Stream(server.url)
    stream.start()
    assert stream.started.wait(60)
    # the baseline, measured here under whatever else this machine runs: one big body refused on
    # its own, and the stream's own gaps meanwhile
    t_base = time.monotonic()
    one_big_s = min(refusal_seconds(server, BIG) for _ in range(2))
    base_gap = stream.max_gap(t_base)
    answers: list[httpx.Response] = []
    senders = [threading.Thread(target=lambda b=b: answers.append(post(server, "/v1/chat/completions", b)))
               for b in (HUGE, BIG, BIG)]
    t0 = time.monotonic()
    for t in senders:
        t.start()
    latencies = []
    while any(t.is_alive() for t in senders) and time.monotonic() - t0 < 120:  # (a guard against a hang)
        t1 = time.monotonic()
        assert HTTP.get(server.url + "/v1/models", headers=AUTH, timeout=60).status_code == 200
        latencies.append(time.monotonic() - t1)
        time.sleep(0.05)
    for t in senders:
        t.join(60)
    handled_s = time.monotonic() - t0
    gap = stream.max_gap(t0)
    stream.stop.set()
    assert [r.status_code for r in answers] == [400] * 3
    assert {r.json()["error"]["type"] for r in answers} == {"exceed_context_size_error"}
    # Before, the 10 MB body was tokenized on the event loop: ~60 times what one big body takes
    # here, and every request and stream waited that long. Off the loop and refused before
    # tokenizing, the three take a few big bodies' time; a request to the loop never waits as
    # long as a few big bodies take, and the stream pauses no longer than its own gaps or a few
    # big bodies (a stream's gaps on a loaded 2-core machine reach seconds with nothing else to do).
    assert handled_s < 15 * one_big_s, (handled_s, one_big_s)
    assert max(latencies) < 5 * one_big_s, (latencies, one_big_s)
    assert gap < 10 * max(base_gap, one_big_s), (gap, base_gap, one_big_s)


def test_a_body_that_cannot_fit_is_refused_before_tokenizing(server):
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": "word " * 2_000_000})
    huge_s = time.monotonic() - t0
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error", r.text
    assert "at least" in r.json()["error"]["message"]  # (an estimate from its size: no tokens counted)
    # 20 times the text of a body that is tokenized, refused in about that body's time (measured
    # alongside): tokenizing it would take some 20 times as long
    big_s = refusal_seconds(server, BIG)
    assert huge_s < 5 * big_s, (huge_s, big_s)


# ---------------------------------------------------------------- the engine child's secret

def _engine_port(server) -> int:
    import re
    m = re.findall(r"engine pid \d+ listens on port (\d+)", server.output())
    return int(m[-1])


@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
                                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                         ("GET", "/nothing-here")])
def test_the_engine_child_refuses_every_route_without_the_secret(server, method, path):
    url = f"http://127.0.0.1:{_engine_port(server)}{path}"
    for headers in ({}, AUTH):  # the user's key does not open the engine either
        r = HTTP.request(method, url, json={"prompt": "Hi", "max_tokens": 1} if method == "POST" else None,
                         headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text)
    # (the key, and only it, opens the engine; it is in neither argv nor the environment:
    # tests/test_engine_child_handshake.py)


@pytest.mark.parametrize("method,path", [("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/models/x"),
                                         ("POST", "/v1/completions"), ("GET", "/nothing-here")])
def test_the_api_key_guards_every_route_but_health(server, method, path):
    r = HTTP.request(method, server.url + path, timeout=30)
    assert r.status_code == 401, (path, r.text)
    assert HTTP.get(server.url + "/health", timeout=30).status_code == 200


# ---------------------------------------------------------------- bodies that gave 500

@pytest.mark.parametrize("name,body,param", [
    ("deep nesting", b'{"prompt": "Hi", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "body"),
    ("5000-digit integer", b'{"prompt": "Hi", "max_tokens": ' + b"7" * 5000 + b"}", None),
    ("surrogate in chat content", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content"),
    ("surrogate in a prompt", b'{"prompt": "\\udc00"}', "prompt"),
    ("surrogate in stop", b'{"prompt": "Hi", "stop": ["x", "\\ud800"]}', "stop[1]"),
    ("surrogate in model", b'{"prompt": "Hi", "model": "\\ud800"}', "model"),
    ("NaN", b'{"prompt": "Hi", "temperature": NaN}', None),
    ("Infinity", b'{"prompt": "Hi", "top_p": Infinity}', None),
])
def test_bad_bodies_are_400_naming_the_field(server, name, body, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = HTTP.post(server.url + path, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, (name, r.text)
    assert r.json()["error"]["param"] == param, (name, r.text)


def test_a_nul_inside_content_is_fine(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a\u0000b"}], "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_a_body_that_never_arrives_gets_408_and_the_connection_closes(server):
    host = server.url.split("//", 1)[1]
    raw = raw_http.build("POST", "/v1/completions", {**AUTH, "Content-Type": "application/json"},
                         b'{"prompt": "Hi"', host=host, content_length=200)
    u = server.url.split("//", 1)[1].split(":")
    with socket.create_connection((u[0], int(u[1])), timeout=20) as s:
        t0 = time.monotonic()
        s.sendall(raw)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break  # closed by the server
            data += chunk
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert 0.9 < time.monotonic() - t0 < 10
    assert_serving(server)


# ---------------------------------------------------------------- content types, Host, Origin

@pytest.mark.parametrize("content_type,status", [
    (None, 200), ("application/json", 200), ("application/json; charset=utf-8", 200),
    ("application/x-www-form-urlencoded", 200),  # curl -d
    ("text/plain", 415), ("text/plain;charset=UTF-8", 415), ("multipart/form-data; boundary=x", 415),
])
def test_content_type_policy(server, content_type, status):
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    r = HTTP.post(server.url + "/v1/completions", content=json.dumps({"prompt": "Hi", "max_tokens": 1}),
                  headers=headers, timeout=60)
    if content_type is None:
        assert "content-type" not in r.request.headers
    assert r.status_code == status, r.text


@pytest.mark.parametrize("headers,status", [
    ({"Host": "evil.example"}, 403),
    ({"Host": "rebind.attacker.example:8080"}, 403),
    ({"Host": "myhost.lan:8080"}, 200),  # allowed_hosts
    ({"Host": "localhost:1234"}, 200),
    ({"Host": "[::1]:8080"}, 200),
    ({"Origin": "https://evil.example"}, 403),
    ({"Origin": "null"}, 403),
    ({"Origin": "http://localhost:3000"}, 200),
    ({"Origin": "http://127.0.0.1:5173"}, 200),
    ({"Origin": "https://app.example"}, 200),  # allowed_origins
])
def test_host_and_origin_policy(server, headers, status):
    r = HTTP.get(server.url + "/v1/models", headers={**AUTH, **headers}, timeout=30)
    assert r.status_code == status, (headers, r.text)
    if "Origin" in headers and status == 200:
        assert r.headers["access-control-allow-origin"] == headers["Origin"]
    if status == 403:
        assert "access-control-allow-origin" not in r.headers


def test_cors_preflight_for_allowed_origins_only(server):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    ok = HTTP.options(server.url + "/v1/chat/completions", headers={**ask, "Origin": "http://localhost:3000"},
                      timeout=30)
    assert ok.status_code == 204
    assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    bad = HTTP.options(server.url + "/v1/chat/completions", headers={**ask, "Origin": "https://evil.example"},
                       timeout=30)
    assert bad.status_code == 403


# ---------------------------------------------------------------- path parameters

def test_model_ids_cannot_reach_other_engine_routes(server):
    for path in ("/v1/models/..%2F..%2Fmetrics", "/v1/models/%2e%2e%2F%2e%2e%2Fmetrics", "/v1/models/..%2Fhealth"):
        r = HTTP.get(server.url + path, headers=AUTH, timeout=30)
        assert r.status_code == 404 and "strata_" not in r.text, (path, r.text)
    r = HTTP.get(server.url + "/v1/models/%00", headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    name = HTTP.get(server.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
    r = HTTP.get(server.url + "/v1/models/" + quote(name, safe=""), headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["id"] == name  # a name with spaces still reaches the engine


# ---------------------------------------------------------------- the pure pieces

@pytest.mark.parametrize("raw,fragment", [
    (b'{"a": NaN}', "NaN"), (b'{"a": -Infinity}', "-Infinity"), (b'{"a": ' + b"1" * 4400 + b"}", "digits"),
    (b'{"a": ' + b"[" * 33 + b"]" * 33 + b"}", "nested"), (b'{"a": ' + b"[" * 3000 + b"]" * 3000 + b"}", "nested"),
    (b'{"m": [{"c": "\\ud800"}]}', "m[0].c"), (b'\xff', "UTF-8"), (b"[]", "JSON object"),
])
def test_strict_json_refusals(raw, fragment):
    with pytest.raises(APIError) as e:
        parse_json_object(raw)
    assert e.value.status == 400 and fragment in e.value.message


def test_strict_json_keeps_what_is_valid():
    assert parse_json_object('{"e": "\\ud83d\\ude00", "n": "a\\u0000b"}'.encode()) == {"e": "😀", "n": "a\0b"}


def test_edge_policy_defaults_follow_the_bind_address():
    local = EdgePolicy.for_bind("127.0.0.1")
    assert local.host_ok("localhost:8080") and local.host_ok("127.0.0.1") and local.host_ok("[::1]:1")
    assert not local.host_ok("evil.example") and local.host_ok(None)
    public = EdgePolicy.for_bind("0.0.0.0")
    assert public.host_ok("anything.example")
    listed = EdgePolicy.for_bind("0.0.0.0", allowed_hosts=["Box.LAN"])
    assert listed.host_ok("box.lan:80") and not listed.host_ok("other.lan")
    assert local.origin_ok("http://localhost:3000") and local.origin_ok("https://127.0.0.1")
    assert not local.origin_ok("http://localhost.evil.example") and not local.origin_ok("null")
    assert EdgePolicy.for_bind("127.0.0.1", allowed_origins=["*"]).origin_ok("https://any.example")
    assert content_type_ok("application/vnd.api+json") and not content_type_ok("text/plain")
