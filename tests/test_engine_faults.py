"""The engine-fault suite: faults while other requests stream, against a real `strata serve`
and its engine child (the test model on the CPU). Only the requests that must end, end, each
with a clear SSE error event or error status, and the next request is served.

| fault                                                      | where                            |
|------------------------------------------------------------|----------------------------------|
| the engine killed (SIGKILL) mid-stream, a request waiting  | tests/test_server_supervision.py |
| out of memory growing one request's KV cache (kv-grow)     | tests/test_out_of_memory.py      |
| one request's window fails (window-raise), a neighbour     | here: only that request ends     |
| the engine stopped (SIGSTOP): /health no longer answers    | here: restarted                  |
| a window hangs (hang): /health says unhealthy (watchdog)   | here: restarted                  |
| a chat template that spins                                 | here, with the template limits   |

The scheduler's side of the same rules, without HTTP: tests/test_scheduler_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import pytest

from strata.server.supervisor import DIED_MESSAGE, WATCH_ANSWER_S, WATCH_MISSES
from support.early import Early, selected
from support.server_proc import HTTP, healthy, metric, spawn_serve, wait_until
from support.together import IN_FLIGHT, send_together

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")

# the neighbour: greedy, deaf to end-of-sequence. It reaches the engine together with the faulty
# request (support/together.py) and runs 64 tokens: far longer than the engine takes to read the
# other request, and than a template spins beside it (1-5 of its tokens: the render holds the GIL)
NEIGHBOUR = {"prompt": "Write a long story about a cat.", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
SHORT = {"prompt": "Hi", "max_tokens": 2}
WATCHDOG_S = 2.0


def spawn_with_faults(tmp_path_factory, name: str, faults: str, *args: str):
    with pytest.MonkeyPatch.context() as mp:  # the engine child inherits the fault points
        mp.setenv("STRATA_FAULT_INJECT", faults)
        cfg = {"parallel": 2, "args": ["--max-context", "512", *args]}
        return spawn_serve(tmp_path_factory.mktemp(name), cfg)


def spawn_hanging(tmp_path_factory):
    return spawn_with_faults(tmp_path_factory, "hanging", "hang@1", "--watchdog-s", str(WATCHDOG_S))


@pytest.fixture(scope="module", autouse=True)
def early(request, tmp_path_factory):
    """The hanging server starts with the module: it loads beside the raising one."""
    e = Early()
    try:
        if selected(request, "test_a_hung_window_trips_the_watchdog_and_the_engine_is_restarted"):
            e.start("hanging", lambda: spawn_hanging(tmp_path_factory))
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def raising(tmp_path_factory):
    """Every window slot 1 is in raises after the caches advanced. Its pack is the test model
    with a chat template that spins on the message "spin" (SPIN below): the spinning-template
    test runs here too (its requests take slot 0 or, the spinning one, no slot at all)."""
    d = tmp_path_factory.mktemp("raising")
    pack = pack_with_template(d / "spin.gguf", SPIN)
    p = spawn_with_faults(tmp_path_factory, "raising", "window-raise@1", "--pack", str(pack))
    with healthy(p):
        yield p


@pytest.fixture(scope="module")
def hanging(tmp_path_factory, early):
    """Every window slot 1 is in blocks; the engine's watchdog allows WATCHDOG_S."""
    p = early.take("hanging", lambda: spawn_hanging(tmp_path_factory))
    with healthy(p):
        yield p


def streamed_text(events: list[str]) -> tuple[str, str | None]:
    """(the text, the finish reason) of a completions stream's events."""
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    return text, reasons[-1] if reasons else None


def sse_error(events: list[str]) -> dict:
    assert events[-1] == "[DONE]", events[-3:]
    return json.loads(events[-2])["error"]


def read_stream(url: str, body: dict) -> list[str]:
    """A completions stream read to its end: its events' data."""
    with HTTP.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]


def answer(url: str, body: dict) -> tuple[int, list[str] | dict]:
    """A completions request's status and its stream's events (200) or its JSON body."""
    with HTTP.stream("POST", url, json=body, timeout=120) as r:
        if r.status_code == 200 and body.get("stream"):
            return 200, [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        r.read()
        return r.status_code, r.json()


def test_one_requests_window_failure_ends_only_that_request(raising):
    """Two requests reach the engine together (support/together.py): the one in slot 1 ends
    (its window raises), the other goes on with the tokens it has alone; plain, then streamed."""
    url = raising.url + "/v1/completions"
    alone = HTTP.post(url, json=NEIGHBOUR, timeout=120)  # slot 0, nobody beside it
    assert alone.status_code == 200
    want = alone.json()["choices"][0]["text"]
    answers = send_together(raising, [lambda: HTTP.post(url, json=NEIGHBOUR, timeout=120)] * 2)
    failed, served = sorted(answers, key=lambda r: r.status_code == 200)
    assert (failed.status_code, served.status_code) == (500, 200), (failed.text, served.text)
    err = failed.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert "injected fault at window-raise for slot 1" in err["message"]
    assert served.json()["choices"][0]["finish_reason"] == "length"
    assert served.json()["choices"][0]["text"] == want  # the tokens it has alone
    streams = send_together(raising, [lambda: read_stream(url, NEIGHBOUR)] * 2)
    failed, served = sorted(streams, key=lambda events: "error" not in json.loads(events[-2]))
    err = sse_error(failed)
    assert err["code"] == "internal_error" and "window-raise for slot 1" in err["message"]
    assert served[-1] == "[DONE]" and streamed_text(served) == (want, "length")
    again = HTTP.post(url, json=SHORT, timeout=60)  # slot 0: served
    assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
    assert HTTP.get(raising.url + "/health", timeout=10).status_code == 200
    assert raising.engine_pids()[-1] == raising.engine_pids()[0], "the engine was restarted"


@pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP is POSIX")
def test_a_stopped_engine_is_restarted(raising):
    """The engine stopped (SIGSTOP) with a request in its hands: /health no longer answers, the
    engine is restarted, the request ends with engine_stopped and the new engine serves."""
    url = raising.url + "/v1/completions"
    pid = raising.engine_pids()[-1]
    mark = len(raising.lines)
    in_flight = metric(raising.url, IN_FLIGHT)
    got: list = []
    os.kill(pid, signal.SIGSTOP)  # first: the request below cannot end before the engine stops
    try:
        waiting = threading.Thread(target=lambda: got.append(answer(url, {**NEIGHBOUR, "stream": True})), daemon=True)
        waiting.start()
        assert wait_until(lambda: metric(raising.url, IN_FLIGHT) == in_flight + 1, 60, 0.1)
        raising.wait_line(r"strata serve: the engine is unhealthy \(its /health did not answer within "
                          rf"{WATCH_ANSWER_S:g} s, {WATCH_MISSES} times in a row\); restarting it",
                          timeout=60, start=mark)
    finally:
        os.kill(pid, signal.SIGCONT)  # (a no-op on the killed process; lets it go if the test failed)
    waiting.join(60)
    status, body = got[0]
    assert status == 503 and body["error"]["code"] == "engine_stopped", body
    assert body["error"]["message"] == DIED_MESSAGE.format(code=-signal.SIGKILL)
    r = HTTP.post(url, json=SHORT, timeout=120)  # a new engine serves it
    assert r.status_code == 200, r.text
    assert raising.engine_pids()[-1] != pid


def test_a_hung_window_trips_the_watchdog_and_the_engine_is_restarted(hanging):
    """Two requests reach the engine together (support/together.py), one streamed: the window of
    the one in slot 1 hangs, the other's with it; the watchdog ends the engine and both end."""
    url = hanging.url + "/v1/completions"
    pid = hanging.engine_pids()[-1]
    mark = len(hanging.lines)
    answers = send_together(hanging, [lambda: answer(url, {**NEIGHBOUR, "stream": True}),
                                      lambda: answer(url, NEIGHBOUR)])
    line = hanging.wait_line(r"strata serve: the engine is unhealthy \((.*)\); restarting it", timeout=60, start=mark)
    assert f"the watchdog allows {WATCHDOG_S:g} s" in line.group(1)
    for status, body in answers:
        if status == 200:  # a stream that had begun: its error event
            err = sse_error(body)
            assert err["code"] == "engine_stopped" and err["message"] == DIED_MESSAGE.format(code=-signal.SIGKILL)
        else:
            assert status == 503 and body["error"]["code"] == "engine_stopped", body
    # (not /health: it says 503 only until the new engine is ready, which a delayed poll may miss)
    assert 'strata_server_engine_exits_total{kind="unhealthy"} 1.0' in HTTP.get(hanging.url + "/metrics", timeout=30).text
    r = HTTP.post(url, json=SHORT, timeout=120)  # slot 0 of a new engine
    assert r.status_code == 200, r.text
    assert hanging.engine_pids()[-1] != pid


# --------------------------------------------------------------- a chat template that spins

# The test model's own template, plus a branch that spins (nested loops of 10**10 steps) when a
# message says "spin": the load-time sample render never takes it, so the pack loads.
SPIN = ("{% if messages[-1]['content'] == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif %}")


def pack_with_template(path, prefix: str):
    """A copy of the test model whose chat template starts with `prefix`."""
    from strata.gguf.reader import GGUFFile
    from strata.gguf.writer import GGUFWriter
    from support.model_fixtures import default_model_or_skip

    src = GGUFFile(default_model_or_skip())
    w = GGUFWriter(path, src.alignment)
    w.add_all_metadata(src.metadata, src.metadata_types)
    w.add_metadata("tokenizer.chat_template", prefix + src.metadata["tokenizer.chat_template"])
    for t in src.tensors.values():
        w.add_tensor(t.name, t.ggml_type, t.shape, t.data())
    w.write()
    src.close()
    return path


def test_a_spinning_template_ends_only_its_request(raising):
    """The neighbour and the spinning request reach the engine together (support/together.py):
    the template spins while the neighbour streams (1-5 of its 64 tokens while it spins)."""
    spinning = raising  # (the template spins on "spin"; the others' slot 0 never fails)
    pid = spinning.engine_pids()[-1]
    events, spin = send_together(spinning, [
        lambda: read_stream(spinning.url + "/v1/completions", NEIGHBOUR),
        lambda: HTTP.post(spinning.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "spin"}], "max_tokens": 2})])
    assert spin.status_code == 400, spin.text
    err = spin.json()["error"]
    assert err["param"] == "messages" and "chat template" in err["message"], err
    assert "\n" not in err["message"]
    assert HTTP.get(spinning.url + "/health", timeout=30).status_code == 200  # never unhealthy
    text, reason = streamed_text(events)
    assert events[-1] == "[DONE]" and reason == "length" and text, events[-3:]
    ok = HTTP.post(spinning.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert spinning.engine_pids()[-1] == pid, "the engine was not restarted"
