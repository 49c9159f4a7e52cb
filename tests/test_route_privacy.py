"""What GET /slots and GET /props show: by default a slot's state and counters only (no other
client's stop strings, seed, logit_bias, grammar kind or ids) and the model's file name, not
its path; with the engine flag `--slots`, each running request's sampling and id. Over real HTTP
against real `strata serve` processes (the shared one, and one started with `--slots`)."""

from __future__ import annotations

import json

import pytest

from strata.server.route_privacy import PUBLIC_SLOT_KEYS
from support import shared_server
from support.server_proc import HTTP, serving, wait_until
from support.shared_server import AUTH, KEY

server = shared_server.module_fixture(__name__)

SECRET_STOP = "zq-private-stop"
BODY = {"prompt": "Tell a very long story.", "max_tokens": 200, "ignore_eos": True, "stream": True,
        "temperature": 0.5, "seed": 424242, "stop": [SECRET_STOP], "logit_bias": {"1234": 1.5}}


def _get(server, path: str):
    r = HTTP.get(server.url + path, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _busy_slot_while_streaming(server) -> tuple[dict, str]:
    """(the /slots entry of the slot running BODY, the answer's id), read while it streams."""
    with HTTP.stream("POST", server.url + "/v1/completions", json=BODY, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # (kept: a dropped iterator closes the stream, ending the request)
        answer_id = next(json.loads(x[6:])["id"] for x in lines if x.startswith("data: {") and '"text":"' in x)
        busy = [s for s in _get(server, "/slots") if s["is_processing"]]
    assert len(busy) == 1, busy
    assert wait_until(lambda: not any(x["is_processing"] for x in _get(server, "/slots")), 10)
    return busy[0], answer_id


def test_slots_show_states_and_counters_only(server):
    slot, answer_id = _busy_slot_while_streaming(server)
    assert set(slot) <= set(PUBLIC_SLOT_KEYS) and {"id", "is_processing", "next_token"} <= set(slot)
    assert slot["next_token"]["n_decoded"] >= 1 and slot["n_prompt_tokens"] > 0
    shown = json.dumps(slot)
    for secret in (SECRET_STOP, str(BODY["seed"]), "1234", answer_id, "logit_bias", "grammar"):
        assert secret not in shown, secret


def test_props_name_the_model_file_not_its_path(server):
    path = _get(server, "/props")["model_path"]
    assert path.endswith(".gguf") and "/" not in path and "\\" not in path


@pytest.fixture(scope="module")
def exposing(tmp_path_factory):
    config = {"parallel": 1, "api_key": KEY, "args": ["--max-context", "256", "--slots"]}
    with serving(tmp_path_factory.mktemp("slots-on"), config) as p:
        yield p


def test_the_slots_flag_shows_each_request(exposing):
    slot, answer_id = _busy_slot_while_streaming(exposing)
    assert slot["request_id"] == answer_id and slot["id_task"] >= 0  # the id its client got
    params = slot["params"]
    assert params["temperature"] == 0.5 and params["seed"] == BODY["seed"] and params["n_predict"] == 200
    assert params["stop"] == [SECRET_STOP] and params["logit_bias"] == [[1234, 1.5]]
    assert set(slot["mtp"]) == {"windows", "drafted", "accepted"} and all(isinstance(v, int) for v in slot["mtp"].values())
