"""The seed story end to end: `strata serve` with the report's config (relative paths, MTP,
batch-MTP, int8 KV, 4 slots) on the synthetic seed-moe pack; 1, 2 and 4 clients at once."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest

from support.server_proc import HTTP, ROOT, metric, start_serve

# the report's config, comments and all; paths are relative to the config file
CONFIG = """{
  // seed config from the bug report
  "parallel": 4,
  "args": ["--pack", "packs/seed", "--mtp", "packs/seed/mtp", "--spec", "4", "--spec-min-p", "0.5",
           "--batch-mtp", "--expert-cache", "auto", "--prefill", "auto:32768",
           "--max-context", "262144", "--kv", "int8"]
}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("seed")
    pack = d / "packs" / "seed"
    subprocess.run([sys.executable, "-m", "strata.cli.main", "pack", "synth", "--out", str(pack),
                    "--preset", "seed-moe", "--mtp", str(pack / "mtp")], check=True, cwd=ROOT,
                   capture_output=True)
    p = start_serve(d, CONFIG)
    try:
        p.wait_healthy()
        yield p
    finally:
        p.kill_tree()


@pytest.mark.parametrize("clients", [1, 2, 4])
def test_clients_at_once_all_served_without_restart(server, clients):
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Question number {i}?"}], "max_tokens": 6,
                "stream": i % 2 == 1, "stream_options": {"include_usage": True}}
        r = HTTP.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [r.status_code for r in results] == [200] * clients
    for r in results:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
        else:
            assert r.json()["usage"]["completion_tokens"] > 0
    assert len(server.engine_pids()) == 1
    assert metric(server.url, "strata_server_engine_restarts_total") == 0
    assert "stopped unexpectedly" not in server.output()


def test_seed_flags_accepted_and_reported(server):
    out = server.output()
    assert "batch windows of up to 4 sequences" in out  # the engine's start-up lines reach the server log
    assert HTTP.get(server.url + "/v1/models").json()["data"][0]["meta"]["n_ctx"] == 262144
