"""Nothing whose cost a request decides runs on the engine's event loop, and every piece of
request work has a bound checked before it is spent: a big /tokenize, a chat template that spins
for its whole time limit, an embeddings call of hundreds of inputs and a huge `tools` list each
end only themselves, while /health answers and a stream beside them keeps going.

One `strata engine` (a tiny synthetic pack whose chat template spins when a request sets
chat_template_kwargs {"spin": true}, and shows the tools as JSON), 2 slots, queue bound 3, on
real HTTP. Latencies are compared with the duration of the request that causes them, measured
in the same test, never with fixed seconds."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from support.server_proc import HTTP, StrataProcess, healthy

KEY = "loop-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
N_CTX = 2048
# spins until the template's limits stop it (its 2 s, before its 4M loop steps: each step does
# some work), only when a request asks: the load check's sample conversation renders at once
SPIN = ("{% if spin %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% set x = (i ~ '-' ~ j) | replace('-', '+') | length %}{% endfor %}{% endfor %}{% endif %}")
TEMPLATE = (SPIN + "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _pack_with_template(tmp_path, source: str) -> str:
    from strata.gguf.constants import ValueType
    from strata.gguf.reader import GGUFFile
    from strata.gguf.writer import write_gguf
    from tests.support.model_fixtures import synth_model

    src = synth_model(tmp_path / "synth", "llama")
    with GGUFFile(src) as f:
        md = dict(f.metadata, **{"tokenizer.chat_template": source})
        types = dict(f.metadata_types, **{"tokenizer.chat_template": ValueType.STRING})
        tensors = [(t.name, t.ggml_type, t.shape, t.data()) for t in f.tensors.values()]
        return str(write_gguf(tmp_path / "spin.gguf", md, tensors, types))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pack = _pack_with_template(tmp_path_factory.mktemp("engine-loop"), TEMPLATE)
    p = StrataProcess("engine", ["--pack", pack, "--device", "cpu", "--port", "0", "--api-key", KEY,
                                 "--parallel", "2", "--max-queued", "3", "--max-context", str(N_CTX)])
    with healthy(p):
        yield p


class Streamer:
    """Streams completions back to back on a thread until stopped: every gap between two chunks
    and every stream's last event (a stream that ends with an error event is a failure)."""

    BODY = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}

    def __init__(self, url: str):
        self.url = url
        self.gaps: list[float] = []
        self.endings: list[str] = []
        self.started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Streamer":
        self._thread.start()
        assert self.started.wait(60), "no stream started"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        while not self._stop.is_set():
            last, events = None, []
            with HTTP.stream("POST", self.url + "/v1/completions", json=self.BODY, headers=AUTH, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        self.gaps.append(now - last)
                    last = now
                    events.append(line)
                    self.started.set()
                    if self._stop.is_set():
                        break
            self.endings.append("stopped" if self._stop.is_set() else
                                "error" if any('"error"' in e for e in events) else events[-1] if events else "empty")

    def clean(self) -> bool:
        return bool(self.endings) and all(e in ("data: [DONE]", "stopped") for e in self.endings)


class Prober:
    """Asks /health over and over on a thread while a block runs: the slowest answer."""

    def __init__(self, url: str):
        self.url = url
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Prober":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                status = HTTP.get(self.url + "/health", timeout=60).status_code
                if status != 200:
                    self.failures.append(str(status))
            except Exception as e:  # noqa: BLE001 - a probe that fails is what the test looks for
                self.failures.append(repr(e))
            self.latencies.append(time.monotonic() - t0)
            self._stop.wait(0.05)

    @property
    def slowest(self) -> float:
        return max(self.latencies, default=0.0)


def _post(url: str, path: str, body: dict, timeout: float = 120):
    t0 = time.monotonic()
    r = HTTP.post(url + path, json=body, headers=AUTH, timeout=timeout)
    return r, time.monotonic() - t0


# ---------------------------------------------------------------- the spinning template

def test_a_template_that_spins_stalls_neither_health_nor_a_stream(engine):
    """Four small chats whose template spins until its limits stop it, at once: each is refused by
    the template's limit, and meanwhile /health answers in a fraction of one spin and the stream
    beside them goes on. (Small bodies were prepared on the event loop: each spin stopped
    every stream and /health for 2 s, and enough of them got the engine restarted.)"""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "chat_template_kwargs": {"spin": True}}
    answers: list = []
    with Streamer(engine.url) as stream, Prober(engine.url) as probe:
        threads = [threading.Thread(target=lambda: answers.append(_post(engine.url, "/v1/chat/completions", body)))
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert len(answers) == 4
    for r, _ in answers:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("the chat template (tokenizer.chat_template) ran past its")
    # a spin on the event loop held every answer and every stream for at least one spin's time;
    # off it, they wait only for Python's lock (handed over every 5 ms)
    one_spin = min(seconds for _, seconds in answers)  # (about the template's 2 s limit)
    assert not probe.failures, probe.failures
    assert probe.slowest < one_spin / 2, (probe.slowest, one_spin)
    assert stream.clean(), stream.endings
    assert max(stream.gaps) < one_spin / 2, (max(stream.gaps), one_spin)
    assert "Traceback" not in engine.output()


# ---------------------------------------------------------------- /tokenize

def test_a_tokenize_past_its_bound_is_refused_from_its_size(engine):
    """Content over the bound (each of its bytes could be a token) is one 400 naming `content`,
    decided from its length before it is tokenized; the stream beside it goes on. (A 12 MB one
    with pieces kept the event loop for long enough that the engine was restarted.)"""
    from strata.server.llama_routes import MAX_TOKENIZE_BYTES

    content = "hello world, these are words. " * (MAX_TOKENIZE_BYTES // 30 + 1000)
    with Streamer(engine.url) as stream:
        r, _ = _post(engine.url, "/tokenize", {"content": content, "with_pieces": True}, timeout=60)
    assert r.status_code == 400, r.text[:200]
    err = r.json()["error"]
    assert err["param"] == "content"
    assert err["message"] == (f"content: {len(content.encode())} bytes is more than /tokenize takes "
                              f"({MAX_TOKENIZE_BYTES} bytes); tokenize a long text in parts")
    assert stream.clean(), stream.endings


def test_a_big_tokenize_with_pieces_is_rendered_off_the_loop(engine):
    """A /tokenize inside the bound, with a piece per token: the answer is exact, and while it is
    tokenized and rendered /health answers in a fraction of the call's time."""
    content = "hello world, these are words. " * 8000  # 240 KB, ~64k tokens
    with Streamer(engine.url) as stream, Prober(engine.url) as probe:
        r, seconds = _post(engine.url, "/tokenize", {"content": content, "with_pieces": True})
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    plain = HTTP.post(engine.url + "/tokenize", json={"content": content}, headers=AUTH, timeout=120).json()["tokens"]
    assert [t["id"] for t in tokens] == plain and len(plain) > 20000
    assert "".join(t["piece"] for t in tokens) == content  # (ASCII: every piece is text)
    assert not probe.failures, probe.failures
    assert probe.slowest < seconds / 4, (probe.slowest, seconds)
    assert stream.clean(), stream.endings


def test_an_abandoned_tokenize_is_not_worked_on(engine):
    """Two big /tokenize calls hold both preparing threads; ten more, whose clients leave
    while they wait, are dropped: a /tokenize sent after them is answered once the first two
    are, not after ten more tokenizations that nobody reads. Each big call takes `alone`
    seconds by itself, measured first; the leavers give up after half of that (so the bounds
    below scale with the machine's speed, not with a fixed client timeout)."""
    body = {"content": "hello world, these are words. " * 16000, "with_pieces": True}  # 480 KB
    _, alone = _post(engine.url, "/tokenize", body)
    t0 = time.monotonic()
    held = [threading.Thread(target=_post, args=(engine.url, "/tokenize", body)) for _ in range(2)]
    for t in held:
        t.start()

    def abandon() -> None:
        with pytest.raises(httpx.TimeoutException):  # the client gives up and closes its connection
            HTTP.post(engine.url + "/tokenize", json=body, headers=AUTH, timeout=max(0.05, alone / 2))

    leavers = [threading.Thread(target=abandon) for _ in range(10)]
    for t in leavers:
        t.start()
    for t in leavers:
        t.join(60)
    # (over 2 KiB: it too waits for a preparing thread)
    after, _ = _post(engine.url, "/tokenize", {"content": "hello world, these are words. " * 200})
    waited = time.monotonic() - t0
    for t in held:
        t.join(60)
    assert after.status_code == 200
    # the two held calls take 1x to 2x `alone` (their pieces are rendered under Python's one lock)
    # and the leavers are gone by then; the ten dropped ones would add 5x to 10x more, less the
    # client's share of `alone` (measured: 0.9-1.8x as it is, 5.7-6.0x with nothing cancelled)
    assert waited < 3 * alone, (waited, alone)


# ---------------------------------------------------------------- embeddings

def test_an_embeddings_call_counts_as_one_request_and_starves_no_one(engine):
    """256 inputs against a queue bound of 3: the call keeps at most `parallel` inputs in the
    engine, so a chat sent while it runs is admitted (not 429 from 254 queued inputs) and is
    answered before the call ends."""
    inputs = [f"input number {i}" for i in range(256)]
    done: dict[str, float] = {}
    result: dict = {}

    def embed() -> None:
        result["r"] = HTTP.post(engine.url + "/v1/embeddings", json={"input": inputs}, headers=AUTH, timeout=120)
        done["embeddings"] = time.monotonic()

    t = threading.Thread(target=embed)
    t.start()
    # the call is in the engine once a slot computes one of its inputs
    from support.server_proc import metric, wait_until

    assert wait_until(lambda: metric(engine.url, "strata_slots_busy", AUTH) >= 1 or "r" in result, 60, 0.01)
    chat, _ = _post(engine.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 4})
    done["chat"] = time.monotonic()
    t.join(120)
    assert chat.status_code == 200, chat.text
    r = result["r"]
    assert r.status_code == 200, r.text[:300]
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(256)) and all(len(d["embedding"]) > 0 for d in data)
    assert done["chat"] < done["embeddings"]


# ---------------------------------------------------------------- tools

def test_tools_too_big_for_the_context_are_refused_before_templating(engine):
    """Tools whose JSON alone is more text than the context can hold are refused naming `tools`,
    from the request's size, before the template renders them and the tokenizer splits them."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 4000,
                                               "parameters": {"type": "object", "properties": {}}}} for i in range(100)]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 4}
    r, _ = _post(engine.url, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "tools" and err["code"] == "exceed_context_size_error", err
    assert f"more than a context of {N_CTX} tokens can take" in err["message"]


def test_an_id_prompt_longer_than_the_context_is_refused_before_its_ids_are_checked(engine):
    """Its length alone decides, before any per-id work: the id past the context that is not
    even an id is never looked at (2^21 ids took seconds to validate one by one)."""
    for prompt, param in (([5] * (N_CTX + 10) + [-1], "prompt"), ([[5] * (N_CTX + 10) + [-1]], "prompt[0]")):
        r, _ = _post(engine.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("exceed_context_size_error", param), err
        assert err["message"] == f"the prompt has {N_CTX + 11} tokens; the context holds {N_CTX}"
    fits, _ = _post(engine.url, "/v1/completions", {"prompt": [5] * 10, "max_tokens": 1})
    assert fits.status_code == 200, fits.text
