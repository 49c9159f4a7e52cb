"""Hostile HTTP against a real `strata serve` (and a real `strata engine`) on the test model:
bodies, headers, methods and paths that a client, a fuzzer or a web page may send. Every one
gets a 4xx (never a 5xx, never a hang), and the server keeps serving after each.

Table-driven: CASES lists (name, method, path, headers, body, expected status). Requests are
written byte by byte (tests/support/raw_http.py) so that broken framing can be sent too. The
`strata serve` is the one of tests/support/shared_server.py (its key, its body_timeout of
BODY_TIMEOUT_S, a context of N_CTX), shared with other modules; the `strata engine` is this
module's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from support import raw_http, shared_server
from support.server_proc import HTTP, StrataProcess
from support.shared_server import AUTH, BODY_TIMEOUT_S, KEY, N_CTX

JSON_AUTH = {**AUTH, "Content-Type": "application/json"}
VOCAB = 49152  # SmolLM2
CLIENT_TIMEOUT_S = 20.0  # any answer slower than this is a hang


@dataclass
class Case:
    name: str
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] | list[tuple[str, str]] = field(default_factory=lambda: dict(JSON_AUTH))
    expect: int | tuple[int, int] = (400, 499)  # one status, or an inclusive range
    content_length: int | None = None
    chunked: bool = False


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def chat(name: str, expect=400, **fields) -> Case:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    return Case(name, "POST", "/v1/chat/completions", _json(body), expect=expect)


def comp(name: str, expect=400, **fields) -> Case:
    body = {"prompt": "Hi", "max_tokens": 2, **fields}
    return Case(name, "POST", "/v1/completions", _json(body), expect=expect)


def raw_comp(name: str, text: bytes, expect=400, **kw) -> Case:
    return Case(name, "POST", "/v1/completions", text, expect=expect, **kw)


NESTED = b'{"prompt": "Hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
NESTED_40 = b'{"prompt": "Hi", "x": ' + b"[" * 40 + b"]" * 40 + b"}"

CASES: list[Case] = [
    # ---- methods and routes
    Case("PUT completions", "PUT", "/v1/completions", _json({"prompt": "Hi"}), expect=405),
    Case("DELETE completions", "DELETE", "/v1/completions", expect=405),
    Case("PATCH chat", "PATCH", "/v1/chat/completions", _json({}), expect=405),
    Case("GET chat", "GET", "/v1/chat/completions", expect=405),
    Case("GET completions", "GET", "/v1/completions", expect=405),
    Case("POST models", "POST", "/v1/models", _json({}), expect=405),
    Case("POST health", "POST", "/health", _json({}), expect=405),
    Case("DELETE models id", "DELETE", "/v1/models/x", expect=405),
    Case("made-up method", "BREW", "/v1/completions"),
    Case("OPTIONS without Origin", "OPTIONS", "/v1/completions", expect=405),
    Case("root", "GET", "/", expect=404),
    Case("unknown v2", "GET", "/v2/models", expect=404),
    Case("completions/extra", "POST", "/v1/completions/extra", _json({}), expect=404),
    Case("admin", "GET", "/admin", expect=404),
    Case("docs off", "GET", "/docs", expect=404),
    Case("openapi off", "GET", "/openapi.json", expect=404),
    # ---- path tricks
    Case("model id NUL", "GET", "/v1/models/%00"),
    Case("model id CR LF", "GET", "/v1/models/a%0d%0aX-Injected:%201"),
    Case("model id encoded dot-dot to metrics", "GET", "/v1/models/..%2F..%2Fmetrics", expect=404),
    Case("model id encoded dot-dot, lower case", "GET", "/v1/models/%2e%2e%2f%2e%2e%2fmetrics", expect=404),
    Case("model id raw dot-dot", "GET", "/v1/models/../../metrics", expect=404),
    Case("model id dot-dot to health", "GET", "/v1/models/..%2F..%2Fhealth", expect=404),
    Case("model id dot", "GET", "/v1/models/.", expect=404),
    Case("model id unknown", "GET", "/v1/models/gpt-4", expect=404),
    Case("model id bad percent", "GET", "/v1/models/%zz", expect=404),
    Case("model id invalid UTF-8", "GET", "/v1/models/%ff%fe", expect=404),
    Case("very long path", "GET", "/v1/" + "a" * 8000, expect=(400, 499)),
    Case("longer path than h11 takes", "GET", "/v1/" + "a" * 70000, expect=(400, 499)),
    Case("double slash", "GET", "//v1/models", expect=404),
    Case("raw byte in path", "GET", "/v1/models/\xff", expect=(400, 499)),
    Case("space in path", "GET", "/v1/mo dels", expect=(400, 499)),
    Case("absolute-form target", "GET", "http://evil.example/v1/models", expect=(400, 499)),
    # ---- headers
    Case("huge header", "GET", "/v1/models", headers={**AUTH, "X-Big": "a" * 70000}, expect=(400, 499)),
    Case("many headers", "GET", "/v1/models", headers=[*AUTH.items(), *((f"X-{i}", "v") for i in range(3000))],
         expect=(400, 499)),
    Case("header without colon", "GET", "/v1/models", headers=[*AUTH.items(), ("Broken header line", "")],
         expect=(400, 499)),
    Case("two different Content-Length", "POST", "/v1/completions", _json({"prompt": "Hi"}),
         headers=[*JSON_AUTH.items(), ("Content-Length", "5"), ("Content-Length", "9")], expect=(400, 499)),
    Case("Content-Length not a number", "POST", "/v1/completions", b"{}",
         headers=[*JSON_AUTH.items(), ("Content-Length", "abc")], expect=(400, 499)),
    Case("Content-Length negative", "POST", "/v1/completions", b"{}",
         headers=[*JSON_AUTH.items(), ("Content-Length", "-1")], expect=(400, 499)),
    Case("Host of another site", "GET", "/v1/models", headers={**AUTH, "Host": "evil.example"}, expect=403),
    Case("Host rebinding name with port", "GET", "/v1/models", headers={**AUTH, "Host": "attacker.example:8080"},
         expect=403),
    Case("Host empty", "GET", "/v1/models", headers={**AUTH, "Host": ""}, expect=(400, 403)),
    Case("two Host headers", "GET", "/v1/models", headers=[("Host", "localhost"), ("Host", "evil.example"),
                                                          *AUTH.items()], expect=(400, 403)),
    # ---- API key
    Case("key missing", "GET", "/v1/models", headers={}, expect=401),
    Case("key wrong", "GET", "/v1/models", headers={"Authorization": "Bearer nope"}, expect=401),
    Case("key Basic scheme", "GET", "/v1/models", headers={"Authorization": f"Basic {KEY}"}, expect=401),
    Case("key empty bearer", "GET", "/v1/models", headers={"Authorization": "Bearer "}, expect=401),
    Case("key prefix of the real one", "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY[:-1]}"},
         expect=401),
    Case("key with odd bytes", "GET", "/v1/models", headers={"Authorization": "Bearer \xff\xfe"}, expect=401),
    Case("key missing on metrics", "GET", "/metrics", headers={}, expect=401),
    Case("key missing on completions", "POST", "/v1/completions", _json({"prompt": "Hi"}),
         headers={"Content-Type": "application/json"}, expect=401),
    Case("key missing on an unknown route", "GET", "/secret", headers={}, expect=401),
    Case("key missing on model id", "GET", "/v1/models/x", headers={}, expect=401),
    # ---- Origin and CORS
    Case("foreign Origin", "POST", "/v1/completions", _json({"prompt": "Hi"}),
         headers={**JSON_AUTH, "Origin": "https://evil.example"}, expect=403),
    Case("null Origin", "POST", "/v1/completions", _json({"prompt": "Hi"}),
         headers={**JSON_AUTH, "Origin": "null"}, expect=403),
    Case("foreign Origin, GET models", "GET", "/v1/models", headers={**AUTH, "Origin": "http://evil.example"},
         expect=403),
    Case("foreign preflight", "OPTIONS", "/v1/completions",
         headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}, expect=403),
    Case("localhost look-alike Origin", "GET", "/v1/models",
         headers={**AUTH, "Origin": "http://localhost.evil.example"}, expect=403),
    Case("Origin not a URL", "GET", "/v1/models", headers={**AUTH, "Origin": "::::"}, expect=403),
    # ---- content types
    Case("text/plain body", "POST", "/v1/completions", _json({"prompt": "Hi"}),
         headers={**AUTH, "Content-Type": "text/plain"}, expect=415),
    Case("multipart body", "POST", "/v1/completions", b"--x\r\n\r\n--x--",
         headers={**AUTH, "Content-Type": "multipart/form-data; boundary=x"}, expect=415),
    Case("xml body", "POST", "/v1/chat/completions", b"<a/>", headers={**AUTH, "Content-Type": "application/xml"},
         expect=415),
    Case("text/html body", "POST", "/v1/completions", b"{}", headers={**AUTH, "Content-Type": "text/html"},
         expect=415),
    # ---- framing: size, slowness, chunks
    raw_comp("body over max_request_bytes", b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}', expect=413),
    raw_comp("Content-Length past the discard limit", b"{}", expect=413, content_length=10 ** 12),
    raw_comp("body shorter than its Content-Length", b'{"prompt": "Hi"', expect=408, content_length=100),
    raw_comp("chunked bad JSON", b'{"prompt": ', chunked=True),
    raw_comp("chunked empty", b"", chunked=True),
    Case("chunked bad chunk size", "POST", "/v1/completions", b"zz\r\n{}\r\n0\r\n\r\n",
         headers=[*JSON_AUTH.items(), ("Transfer-Encoding", "chunked")], expect=(400, 499)),
    # ---- bad JSON
    raw_comp("empty body", b""),
    raw_comp("whitespace body", b"   \n "),
    raw_comp("not JSON", b"hello"),
    raw_comp("truncated JSON", b'{"prompt": "Hi"'),
    raw_comp("trailing garbage", b'{"prompt": "Hi"} x'),
    raw_comp("JSON array", b'[{"prompt": "Hi"}]'),
    raw_comp("JSON string", b'"Hi"'),
    raw_comp("JSON number", b"5"),
    raw_comp("JSON null", b"null"),
    raw_comp("bad UTF-8", b'{"prompt": "\xff\xfe"}'),
    raw_comp("UTF-16 body", '{"prompt": "Hi"}'.encode("utf-16")),
    raw_comp("NaN", b'{"prompt": "Hi", "temperature": NaN}'),
    raw_comp("Infinity", b'{"prompt": "Hi", "top_p": Infinity}'),
    raw_comp("-Infinity", b'{"prompt": "Hi", "min_p": -Infinity}'),
    raw_comp("1e400 (inf)", b'{"prompt": "Hi", "temperature": 1e400}'),
    raw_comp("nested 100000 deep", NESTED),
    raw_comp("nested 40 deep", NESTED_40),
    raw_comp("5000-digit integer", b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    raw_comp("4000-digit seed", b'{"prompt": "Hi", "seed": ' + b"9" * 4000 + b"}"),
    raw_comp("lone surrogate in prompt", b'{"prompt": "\\ud800"}'),
    raw_comp("lone low surrogate in a list prompt", b'{"prompt": ["a\\udc00b"]}'),
    raw_comp("lone surrogate in stop", b'{"prompt": "Hi", "stop": ["\\ud83d"]}'),
    raw_comp("lone surrogate in model", b'{"prompt": "Hi", "model": "\\udfff"}'),
    raw_comp("lone surrogate in a key", b'{"prompt": "Hi", "\\ud800": 1}'),
    Case("lone surrogate in chat content", "POST", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x\\ud800"}]}'),
    Case("lone surrogate in a text part", "POST", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}'),
    # ---- chat fields
    chat("messages missing", messages=None),
    chat("messages empty", messages=[]),
    chat("messages not a list", messages="Hi"),
    chat("message not an object", messages=["Hi"]),
    chat("role unknown", messages=[{"role": "wizard", "content": "Hi"}]),
    chat("role missing", messages=[{"content": "Hi"}]),
    chat("content a number", messages=[{"role": "user", "content": 5}]),
    chat("content an image part", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
    chat("text part without text", messages=[{"role": "user", "content": [{"type": "text"}]}]),
    chat("name a number", messages=[{"role": "user", "content": "Hi", "name": 5}]),
    chat("name too long", messages=[{"role": "user", "content": "Hi", "name": "n" * 1000}]),
    chat("too many messages", messages=[{"role": "user", "content": "Hi"}] * 5000),
    chat("temperature a string", temperature="1"),
    chat("temperature negative", temperature=-1),
    chat("temperature 3", temperature=3),
    chat("top_p 0", top_p=0),
    chat("top_p 2", top_p=2),
    chat("top_k negative", top_k=-1),
    chat("top_k 2**40", top_k=2 ** 40),
    chat("min_p 2", min_p=2),
    chat("max_tokens 0", max_tokens=0),
    chat("max_tokens negative", max_tokens=-5),
    chat("max_tokens 2**40", max_tokens=2 ** 40),
    chat("max_tokens a string", max_tokens="5"),
    chat("max_tokens a float", max_tokens=2.5),
    chat("max_completion_tokens 0", max_completion_tokens=0),
    chat("stream a string", stream="yes"),
    chat("stream 1", stream=1),
    chat("stream_options a string", stream_options="x"),
    chat("include_usage a string", stream=True, stream_options={"include_usage": "x"}),
    chat("17 stop strings", stop=[f"s{i}" for i in range(17)]),
    chat("stop string too long", stop="s" * 2000),
    chat("stop a number", stop=5),
    chat("stop list with a number", stop=["a", 5]),
    chat("seed -2", seed=-2),
    chat("seed 2**64", seed=2 ** 64),
    chat("seed a float", seed=1.5),
    chat("seed a string", seed="1"),
    chat("n 2", n=2),
    chat("frequency_penalty 3", frequency_penalty=3),
    chat("logprobs a string", logprobs="x"),
    chat("top_logprobs 21", logprobs=True, top_logprobs=21),
    chat("top_logprobs without logprobs", top_logprobs=2),
    chat("tools named twice", tools=[{"type": "function", "function": {"name": "f"}}] * 2),
    chat("tool_choice naming no tool", tools=[{"type": "function", "function": {"name": "f"}}],
         tool_choice={"type": "function", "function": {"name": "g"}}),
    chat("response_format json_schema without a schema", response_format={"type": "json_schema", "json_schema": {}}),
    chat("response_format schema not a schema", response_format={"type": "json_schema",
                                                                 "json_schema": {"schema": {"type": 5}}}),
    chat("unknown field", colour="blue"),
    chat("logit_bias id past the vocabulary", logit_bias={str(VOCAB): 1}),
    chat("typical_p on", typical_p=0.5),
    chat("model not served", model="gpt-4", expect=404),
    chat("model name too long", model="m" * 1000),
    chat("user a number", user=5),
    chat("ignore_eos a string", ignore_eos="x"),
    Case("chat 10 MB content (cannot fit)", "POST", "/v1/chat/completions",
         _json({"messages": [{"role": "user", "content": "word " * 2_000_000}]})),
    # ---- completions fields
    comp("prompt missing", prompt=None),
    comp("prompt a number", prompt=5),
    comp("prompt empty list", prompt=[]),
    comp("prompt empty id list", prompt=[[]]),
    comp("two prompts", prompt=["a", "b"]),
    comp("two id prompts", prompt=[[1], [2]]),
    comp("id = vocabulary size", prompt=[1, VOCAB]),
    comp("id 10**9", prompt=[1, 10 ** 9]),
    comp("id 2**63", prompt=[1, 2 ** 63]),
    comp("id 2**64", prompt=[1, 2 ** 64]),
    comp("id -1", prompt=[1, -1]),
    comp("id a float", prompt=[1, 1.5]),
    comp("id a string", prompt=[1, "a"]),
    comp("id a boolean", prompt=[True]),
    comp("nested id out of range", prompt=[[1, VOCAB + 7]]),
    comp("ids longer than the context", prompt=[1] * (N_CTX + 10)),
    comp("text longer than the context", prompt="word " * 200_000),
    comp("echo a string", echo="x"),
    comp("logprobs 6", logprobs=6),
    comp("logprobs negative", logprobs=-1),
    comp("suffix", suffix="x"),
    comp("best_of 2", best_of=2),
    comp("seed -7", seed=-7),
    comp("stop 2000 chars", stop=["s" * 2000]),
]


def _expected(case: Case, status: int) -> bool:
    lo, hi = (case.expect, case.expect) if isinstance(case.expect, int) else case.expect
    return lo <= status <= hi


def _still_serving(url: str) -> None:
    r = HTTP.get(url + "/v1/models", headers=AUTH, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200, r.text


server = shared_server.module_fixture(__name__)


@pytest.fixture(scope="module")
def servers(request):
    """A `strata serve` and a `strata engine` (each with the API key), loaded side by side (the
    engine starts first, the shared server then if it is not up yet)."""
    engine = StrataProcess("engine", ["--port", "0", "--api-key", KEY, "--body-timeout", str(BODY_TIMEOUT_S),
                                      "--max-context", str(N_CTX)])
    try:
        serve = request.getfixturevalue("server")
        engine.wait_listening()
        engine.wait_healthy()
        yield {"serve": serve, "engine": engine}
    finally:
        engine.kill_tree()


def test_the_table_is_big_enough():
    assert len(CASES) >= 100
    assert len({c.name for c in CASES}) == len(CASES), "case names are unique"


@pytest.mark.parametrize("target", ["serve", "engine"])
def test_every_hostile_request_gets_a_4xx_and_the_server_serves_on(servers, target):
    proc = servers[target]
    mark = len(proc.lines)  # (the log of this table's requests)
    host = proc.url.split("//", 1)[1]
    wrong: list[str] = []
    for i, case in enumerate(CASES):
        raw = raw_http.build(case.method, case.path, case.headers, case.body, host=host,
                             content_length=case.content_length, chunked=case.chunked)
        r = raw_http.send(proc.url, raw, timeout=CLIENT_TIMEOUT_S)
        if not _expected(case, r.status):
            wrong.append(f"{case.name}: {r.status} {r.body[:200]!r}")
        if r.status >= 400 and r.headers.get("content-type", "").startswith("application/json"):
            err = json.loads(r.body)["error"]  # ours: OpenAI-shaped and one line
            assert "Traceback" not in err["message"] and "\n" not in err["message"], case.name
        if i % 3 == 2 or r.status >= 500 or r.status == 0:
            _still_serving(proc.url)
    assert not wrong, "\n".join(wrong)
    # one real completion at the end: nothing above wedged the engine
    r = HTTP.post(proc.url + "/v1/completions", headers=AUTH, timeout=60,
                  json={"prompt": "The capital of France is", "max_tokens": 4, "seed": -1, "temperature": 0.7})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    out = "\n".join(proc.lines[mark:])
    assert "internal error" not in out, out[out.find("internal error"):][:3000]
