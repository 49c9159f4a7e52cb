"""The engine's HTTP layer (strata.server.app) over a small scripted core, on a real uvicorn
on 127.0.0.1: states the real model cannot be driven into on demand (loading, a core error,
drain on shutdown, a held-back text tail). End-to-end behaviour with the real engine is in
test_server_openai.py / test_server_supervision.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from strata.protocol import FinishEvent, RequestHandle, TokenEvent, TopLogprob
from strata.server.app import EngineAPI
from strata.server.engine_state import SHUTDOWN_MESSAGE
from strata.server.serving import bind, serve
from support import raw_http
from support.server_proc import wait_until

REPLY = "hello world"


class ScriptedTokenizer:
    """One token per byte (id = byte + 2); id 1 is BOS."""

    eog_ids = {0}
    vocab_size = 258  # ids 0 and 1, then the bytes
    special_pattern = None  # no special-token texts: request strings pass through as they are

    def encode(self, text, add_special=False, parse_special=True):
        return ([1] if add_special else []) + [b + 2 for b in text.encode()]

    def decode(self, ids):
        return bytes(i - 2 for i in ids if i >= 2).decode("utf-8", "replace")

    def token_bytes(self, token_id):
        return bytes([token_id - 2]) if token_id >= 2 else b"<s>"


class ScriptedChat:
    def render(self, messages, add_generation_prompt=True, tools=None):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class ScriptedCore:
    """Replies REPLY one byte per token (a few ms apart); the prompt 'ERR' fails mid-way; the
    reply's last byte is released as FinishEvent.text_tail, as a pending stop-string prefix would be."""

    model_name = "scripted"
    n_ctx = 64
    parallel = 2
    cfg = pack = opts = draft = None  # no pack behind it (strata/server/served_core.py)

    def __init__(self, delay: float = 0.005):
        self.tokenizer = ScriptedTokenizer()
        self.chat = ScriptedChat()
        self.delay = delay
        self.handles: list[RequestHandle] = []

    def submit(self, req):
        h = RequestHandle(req)
        self.handles.append(h)
        threading.Thread(target=self._run, args=(h,), daemon=True).start()
        return h

    def _run(self, h: RequestHandle) -> None:
        p = h.request.params
        prompt = self.tokenizer.decode(h.request.prompt_ids)
        n = 0
        for i, ch in enumerate(REPLY[:-1]):
            if h.cancelled:
                h.events.put(FinishEvent("cancelled", len(h.request.prompt_ids), n))
                return
            if n == p.max_tokens:
                h.events.put(FinishEvent("length", len(h.request.prompt_ids), n))
                return
            if "ERR" in prompt and i == 3:
                h.events.put(FinishEvent("error", len(h.request.prompt_ids), n, error="device lost"))
                return
            time.sleep(self.delay)
            tops = [TopLogprob(ord(ch) + 2, ch, -0.1), TopLogprob(ord("x") + 2, "x", -2.5)][:p.top_logprobs]
            h.events.put(TokenEvent(ord(ch) + 2, ch, -0.1 if p.logprobs else None, tops if p.logprobs else None))
            n += 1
        h.events.put(FinishEvent("stop", len(h.request.prompt_ids), n + 1, text_tail=REPLY[-1]))

    def queue_depth(self):
        return 0

    def slots_busy(self):
        return sum(1 for h in self.handles if not h.cancelled)

    def metrics(self):
        return {"slots": [{"mtp_windows": 3, "mtp_drafted": 8, "mtp_accepted": 5}],
                "batch_mtp_fallbacks": {"no_kernel": 2}}

    def liveness(self):
        return True, None

    def stop(self):
        pass


class Running:
    def __init__(self, api: EngineAPI):
        self.api = api
        sock = bind("127.0.0.1", 0)
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        self.thread = threading.Thread(target=serve, args=(api.app, sock), daemon=True)
        self.thread.start()
        assert wait_until(self._up, 60)

    def _up(self) -> bool:
        try:
            httpx.get(self.url + "/health", timeout=1)
            return True
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.api.app.state.uvicorn_server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def running():
    servers: list[Running] = []

    def start(core=None, **kw) -> Running:
        api = EngineAPI(**kw)
        if core is not None:
            api.attach(core)
        servers.append(Running(api))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def sse_events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_loading_then_ready(running):
    s = running()
    r = httpx.get(s.url + "/health")
    assert r.status_code == 503 and r.json()["status"] == "loading"
    r = httpx.post(s.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
    s.api.attach(ScriptedCore())
    assert httpx.get(s.url + "/health").json() == {"status": "ok"}
    r = httpx.post(s.url + "/v1/chat/completions", json=CHAT)
    body = r.json()
    assert body["choices"][0]["message"]["content"] == REPLY  # the held-back tail is appended
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": len("<user>hi<assistant>") + 1, "completion_tokens": len(REPLY),
                             "total_tokens": len("<user>hi<assistant>") + 1 + len(REPLY),
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_stream_carries_tail_finish_and_usage(running):
    s = running(ScriptedCore())
    r = httpx.post(s.url + "/v1/chat/completions",
                   json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    ev = sse_events(r.text)
    assert ev[-1] == "[DONE]" and ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1] if e["choices"])
    assert text == REPLY
    assert [e["choices"][0]["finish_reason"] for e in ev[:-1] if e["choices"]][-1] == "stop"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == len(REPLY)


def test_completion_logprobs_legacy_shape(running):
    s = running(ScriptedCore())
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 3, "logprobs": 2, "echo": True})
    c = r.json()["choices"][0]
    assert c["text"] == "ab" + REPLY[:3] and c["finish_reason"] == "length"
    lp = c["logprobs"]
    assert lp["tokens"] == list(REPLY[:3]) and lp["token_logprobs"] == [-0.1] * 3
    assert lp["top_logprobs"][0] == {"h": -0.1, "x": -2.5} and lp["text_offset"] == [2, 3, 4]


def test_core_error_mid_generation(running):
    s = running(ScriptedCore())
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "ERR"})
    assert r.status_code == 500 and r.json()["error"]["message"] == "device lost"
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "ERR", "stream": True})
    ev = sse_events(r.text)
    assert ev[-1] == "[DONE]" and ev[-2]["error"]["message"] == "device lost"


def test_context_overflow_and_api_key(running):
    s = running(ScriptedCore(), api_key="k")
    assert httpx.post(s.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "x" * 80}, headers={"Authorization": "Bearer k"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "exceed_context_size_error"
    assert (err["n_prompt_tokens"], err["n_ctx"]) == (81, 64)


def test_client_disconnect_cancels_generation(running):
    core = ScriptedCore(delay=0.5)
    s = running(core)
    with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "a", "stream": True}) as r:
        for line in r.iter_lines():
            if '"text":"h"' in line:
                break
    assert wait_until(lambda: core.handles and core.handles[0].cancelled, 60)
    # and a plain (non-stream) request whose client leaves once it is submitted (11 tokens at
    # 0.5 s: it is still running then)
    host, port = s.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(raw_http.build("POST", "/v1/completions", {"Content-Type": "application/json"},
                                    json.dumps({"prompt": "b"}).encode(), host=f"{host}:{port}"))
        assert wait_until(lambda: len(core.handles) == 2, 60)
        assert not core.handles[1].cancelled
    assert wait_until(lambda: core.handles[1].cancelled, 60)


def test_drain_refuses_new_and_ends_running_streams(running):
    s = running(ScriptedCore(delay=0.3))  # 11 tokens: 3.3 s, far past the drain's 0.2 s grace
    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(
        httpx.post(s.url + "/v1/completions", json={"prompt": "a", "stream": True}, timeout=60).text))
    t.start()
    assert wait_until(lambda: s.api.live, 60)  # submitted: running when the drain begins
    loop_call = s.api.app.state.uvicorn_server._loop.call_soon_threadsafe
    loop_call(s.api.begin_drain, 0.2)
    assert wait_until(lambda: httpx.get(s.url + "/health").status_code == 503, 60)
    assert httpx.post(s.url + "/v1/completions", json={"prompt": "b"}).status_code == 503
    t.join(60)
    ev = sse_events(got[0])
    assert ev[-1] == "[DONE]" and ev[-2]["error"]["message"] == SHUTDOWN_MESSAGE


def test_metrics_from_the_core(running):
    s = running(ScriptedCore())
    httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    text = httpx.get(s.url + "/metrics").text
    assert 'strata_requests_total{endpoint="completions",outcome="length"} 1.0' in text
    assert 'strata_mtp_accepted_tokens_total{slot="0"} 5.0' in text
    assert 'strata_batch_mtp_fallbacks_total{reason="no_kernel"} 2.0' in text
    assert "strata_completion_tokens_total 2.0" in text
