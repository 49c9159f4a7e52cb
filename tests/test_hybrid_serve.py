"""The report's config on the report's model class, through `strata serve` over real HTTP: a
qwen35moe main stack, its nextn layer as an MTP-only GGUF, --spec 4 --spec-min-p 0.5 --batch-mtp,
parallel 4. At 1, 2 and 4 concurrent clients every request completes with the tokens of plain
decoding (computed in this process from the same pack)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from strata.pack.presets import TINY
from strata.pack.synth import synth_pack
from tests.support.engines import chat_prompts, greedy, load_engine, run_all
from tests.support.server_proc import start_serve

TEXTS = ["Hello there", "Write a haiku about rain.", "List three colors.", "What is 2+2?"]


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-serve")
    synth_pack(TINY["qwen35moe"], root / "pack", mtp_dir=root / "mtp", progress=lambda *a: None)
    return root


def test_reports_config_serves_1_2_4_clients_exactly(pack, tmp_path):
    plain, _ = load_engine(["--pack", str(pack / "pack"), "--device", "cpu", "--kv", "int8"])
    prompts = chat_prompts(plain, TEXTS)
    want = [plain.tokenizer.decode(ids) for ids, _, _ in run_all(plain, prompts, greedy(12), threaded=False)]
    config = {"parallel": 4,
              "args": ["--pack", str(pack / "pack"), "--mtp", str(pack / "mtp"), "--spec", "4", "--spec-min-p", "0.5",
                       "--batch-mtp", "--device", "cpu", "--max-context", "262144", "--kv", "int8"]}
    server = start_serve(tmp_path, config)
    try:
        server.wait_healthy()
        server.wait_line(r"strata probe: batch-MTP on for slots 0-3")
        server.wait_line(r"strata: recurrent state: 3 Gated DeltaNet layers")

        def ask(i: int) -> dict:
            r = httpx.post(server.url + "/v1/completions", timeout=120,
                           json={"prompt": prompts[i], "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()

        for n in (1, 2, 4):
            with ThreadPoolExecutor(n) as pool:
                outs = list(pool.map(ask, range(n)))
            assert [o["choices"][0]["text"] for o in outs] == want[:n]
            assert all(o["choices"][0]["finish_reason"] in ("length", "stop") for o in outs)
    finally:
        server.kill_tree()
