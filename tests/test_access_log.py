"""The access log (one line per request, exact token counts, streams logged when they end) and
the served model id (the pack's file stem), against real `strata serve` / `strata engine`
processes on 127.0.0.1."""

from __future__ import annotations

import json
import re
import shutil
from urllib.parse import quote

import httpx
import pytest

from strata.pack.loader import open_pack
from strata.server.model_id import model_id_of, slug
from strata.server.config import config_from_dict, load_config, with_overrides
from support.early import Early, selected
from support.server_proc import HTTP, StrataProcess, healthy, spawn_serve
from tests.support.model_fixtures import default_model_or_skip, synth_model

default_model_or_skip()

ID = "SmolLM2-135M-Instruct.Q4_1"
GENERAL_NAME = "Smollm2 135M 8k Lc100K Mix1 Ep2"
LINE = r"^{who}: {method} {path} {status} in=(\S+) out=(\S+) (\d+) ms$"


def spawn_without_log(tmp_path):
    return spawn_serve(tmp_path, {"args": ["--max-context", "256"]}, "--no-access-log")


def spawn_by_hand(off: bool) -> StrataProcess:
    return StrataProcess("engine", ["--port", "0", "--max-context", "256", "--spec", "0"]
                         + (["--no-access-log"] if off else []))


@pytest.fixture(scope="module", autouse=True)
def early(request, tmp_path_factory):
    """The other tests' servers and engines start with the module and load while the shared
    server's tests run (each test still takes its own, fresh child)."""
    e = Early()
    try:
        if selected(request, "test_no_access_log_flag"):
            e.start("no-log", lambda: spawn_without_log(tmp_path_factory.mktemp("no-log")))
        for off in (False, True):
            if selected(request, f"test_an_engine_run_by_hand[{off}]"):
                e.start(f"by-hand-{off}", lambda off=off: spawn_by_hand(off))
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    p = spawn_serve(tmp_path_factory.mktemp("access"), {"parallel": 1, "args": ["--max-context", "512"]})
    with healthy(p):
        yield p


def logged(p: StrataProcess, start: int, method: str, path: str, status: int, who: str = "strata serve"):
    """(in, out) of the access line for this request, once it is written."""
    m = p.wait_line(LINE.format(who=who, method=method, path=re.escape(path), status=status), 60, start)  # (a hang guard)
    return m.group(1), m.group(2)


def plain(p, path: str, body: dict) -> httpx.Response:
    return HTTP.post(p.url + path, json=body, timeout=120)


def test_a_plain_request_logs_its_usage(server):
    n = len(server.lines)
    r = plain(server, "/v1/completions", {"prompt": "Say hi", "max_tokens": 5, "temperature": 0})
    u = r.json()["usage"]
    assert logged(server, n, "POST", "/v1/completions", 200) == (str(u["prompt_tokens"]), str(u["completion_tokens"]))


def _stream(p, path: str, body: dict) -> bytes:
    with HTTP.stream("POST", p.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return r.read()


def test_a_stream_without_usage_logs_the_engines_counts_and_the_client_sees_none(server):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "temperature": 0}
    want = plain(server, "/v1/chat/completions", body).json()["usage"]
    n = len(server.lines)
    raw = _stream(server, "/v1/chat/completions", body)
    assert raw.endswith(b"data: [DONE]\n\n") and b"strata-usage" not in raw and b'"usage"' not in raw
    assert logged(server, n, "POST", "/v1/chat/completions", 200) == (str(want["prompt_tokens"]),
                                                                      str(want["completion_tokens"]))


def test_a_stream_with_usage_logs_what_the_client_got(server):
    n = len(server.lines)
    raw = _stream(server, "/v1/completions", {"prompt": "Once", "max_tokens": 4, "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    u = events[-1]["usage"]
    assert raw.endswith(b"data: [DONE]\n\n")
    assert logged(server, n, "POST", "/v1/completions", 200) == (str(u["prompt_tokens"]), str(u["completion_tokens"]))


def test_refusals_and_other_routes_are_logged_without_counts(server):
    n = len(server.lines)
    assert plain(server, "/v1/completions", {"prompt": "x", "model": "nope"}).status_code == 404
    assert logged(server, n, "POST", "/v1/completions", 404) == ("-", "-")
    assert plain(server, "/v1/completions", {"prompt": "x", "top_p": 5}).status_code == 400
    assert logged(server, n, "POST", "/v1/completions", 400) == ("-", "-")
    # a path with a control character is one line, the character quoted
    assert HTTP.get(server.url + "/v1/x%0aevil", timeout=30).status_code == 404
    assert logged(server, n, "GET", "/v1/x%0Aevil", 404) == ("-", "-")


def test_health_polls_are_logged_only_when_their_status_changes(server):
    """The supervisor polls the engine every 2 s and the test polled the server until it was
    ready: neither buries the log, yet each status reached is there once."""
    lines = lambda: [ln for ln in server.lines if re.match(r"strata (serve|engine): GET /health ", ln)]  # noqa: E731
    ready = [ln for ln in lines() if " GET /health 200 " in ln]
    assert len(ready) == 1, server.output()
    before = len(lines())
    for _ in range(5):
        assert HTTP.get(server.url + "/health", timeout=10).status_code == 200
    plain(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})  # a request after them is logged
    logged(server, 0, "POST", "/v1/completions", 200)
    assert len(lines()) == before, server.output()


def test_the_served_id_is_the_file_stem_and_the_general_name_is_accepted(server):
    models = HTTP.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [ID]
    for name in (ID, GENERAL_NAME):
        r = plain(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "model": name})
        assert r.status_code == 200 and r.json()["model"] == ID
        assert HTTP.get(server.url + "/v1/models/" + quote(name, safe=""), timeout=30).json()["id"] == ID
    r = plain(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "model": slug(GENERAL_NAME)})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_no_access_log_flag(tmp_path, early):
    p = early.take("no-log", lambda: spawn_without_log(tmp_path))
    try:
        p.wait_listening()
        p.wait_healthy()
        assert plain(p, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200
        assert not any(re.match(r"strata (serve|engine): (GET|POST) ", line) for line in p.lines), p.output()
    finally:
        p.kill_tree()


def test_access_log_key():
    assert load_config(None).access_log is True
    assert config_from_dict({"access_log": False}).access_log is False
    assert with_overrides(load_config(None), access_log=False).access_log is False


@pytest.mark.parametrize("off", [False, True])
def test_an_engine_run_by_hand(off, early):
    p = early.take(f"by-hand-{off}", lambda: spawn_by_hand(off))
    try:
        p.wait_listening()
        p.wait_healthy()
        n = len(p.lines)
        r = plain(p, "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
        u = r.json()["usage"]
        if off:
            assert plain(p, "/v1/models", {}).status_code == 405  # one more request, still no line
            assert not any(re.match(r"strata engine: (GET|POST) ", line) for line in p.lines), p.output()
        else:
            assert logged(p, n, "POST", "/v1/completions", 200, who="strata engine") == (
                str(u["prompt_tokens"]), str(u["completion_tokens"]))
        assert r.json()["model"] == ID
    finally:
        p.kill_tree()


def test_model_id_of_directory_and_split_packs(tmp_path):
    gguf = synth_model(tmp_path / "synth", "llama")
    general = open_pack(pack=str(gguf)).metadata["general.name"]
    cases = {  # file name in a folder of its own -> the id served when --pack names the file
        "Tiny-Llama.Q8_0.gguf": "Tiny-Llama.Q8_0",
        "Tiny-Llama-Q4-00001-of-00001.gguf": "Tiny-Llama-Q4",  # a split set: its stem
        "model-00001-of-00001.gguf": slug(general),  # a stem that names no model
    }
    for name, want in cases.items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        shutil.copy(gguf, folder / name)
        assert model_id_of(open_pack(pack=str(folder / name)), named_dir=False) == want
        assert model_id_of(open_pack(pack=str(folder)), named_dir=True) == slug(general)
    assert slug("  Qwen3 (30B) A3B!  ") == "qwen3-30b-a3b"
