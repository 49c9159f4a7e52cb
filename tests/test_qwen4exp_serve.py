"""The report's config on the report's model, through `strata serve` over real HTTP on the CPU.

A tiny synthetic qwen4exp main stack is split into two shards as the report's pack is, the n-gram
table (`per_layer_token_embd.weight`) alone in the second one (strata/pack/split_writer.py), and
its MTP layer comes as an MTP-only GGUF (`synth_pack(..., mtp_dir=...)`, what
`strata pack synth --arch qwen4exp --mtp DIR` writes). `strata serve` runs it with the report's
flags (--native / --ple-gguf naming the shards, --mtp, --spec 4 --spec-min-p 0.5 --batch-mtp,
--kv int8, --max-context 4096, parallel 4). At 1, 2 and 4 concurrent chat completions, streamed
and not, at temperature 0, every request completes with the token ids of plain decoding: the same
shards without a draft, on the engine API in this process. The chat prompts (45-52 tokens) pass
the tiny indexer's budget of 32 tokens, so sparse attention selects blocks. A token's id is read
back from its bytes in the answer's logprobs (the tiny vocabulary's byte strings are distinct); a
last round without logprobs checks the argmax-only path by its text and token count. A second
server at --spec-min-p 0 makes the random draft propose on every slot, so every window verifies
and cuts back drafts.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from strata.gguf.reader import GGUFFile
from strata.pack.presets import TINY
from strata.pack.split_writer import split_gguf
from strata.pack.synth import synth_pack
from tests.support.engines import chat_prompts, greedy, load_engine, run_all
from tests.support.server_proc import HTTP, serving

STEM = "Qwen3.8-Flash-Next-IQ3_S"
NGRAM_TABLE = "per_layer_token_embd.weight"
TEXTS = ["Hello there", "Write a haiku about rain.", "List three colors.", "What is 2+2?"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """The two shards and the MTP-only GGUF; returns (root, shard args)."""
    root = tmp_path_factory.mktemp("qwen4exp-serve")
    synth_pack(replace(TINY["qwen4exp"], vocab=4096), root / "one", mtp_dir=root / "mtp",
               progress=lambda *a: None)
    with GGUFFile(root / "one" / "model.gguf") as f:
        trunk = [name for name in f.tensors if name != NGRAM_TABLE]
    (root / "pack").mkdir()
    split_gguf(root / "one" / "model.gguf", root / "pack", [trunk, [NGRAM_TABLE]], STEM)
    with GGUFFile(root / "pack" / f"{STEM}-00002-of-00002.gguf") as f:
        assert list(f.tensors) == [NGRAM_TABLE]
    shards = ["--pack", str(root / "pack"), "--native", f"{STEM}-00001-of-00002.gguf",
              "--ple-gguf", f"{STEM}-00002-of-00002.gguf"]
    return root, shards


def _ask(url: str, text: str, *, stream: bool, logprobs: bool) -> tuple[list[bytes], str, str, dict]:
    """One chat completion at temperature 0 -> (each token's bytes, text, finish reason, usage)."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "logprobs": logprobs, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    toks: list[bytes] = []
    parts: list[str] = []
    finish, usage = "", {}
    if not stream:
        r = HTTP.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        lp = choice["logprobs"]["content"] if logprobs else []
        return [bytes(t["bytes"]) for t in lp], choice["message"]["content"], choice["finish_reason"], out["usage"]
    with HTTP.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                parts.append(choice["delta"].get("content") or "")
                if choice.get("logprobs"):
                    toks += [bytes(t["bytes"]) for t in choice["logprobs"]["content"]]
                finish = choice.get("finish_reason") or finish
    return toks, "".join(parts), finish, usage


@pytest.fixture(scope="module")
def plain(pack):
    """Plain decoding of the chat prompts on the same shards (no draft, in this process): the
    prompt ids, each completion's ids and text, and the tokenizer's id of each token's bytes."""
    _, shards = pack
    core, _ = load_engine([*shards, "--device", "cpu", "--kv", "int8", "--max-context", "4096"])
    prompts = chat_prompts(core, TEXTS)
    ids = [out[0] for out in run_all(core, prompts, greedy(MAX_TOKENS), threaded=False)]
    by_bytes = {bytes(core.tokenizer.token_bytes(i)): i for i in range(core.tokenizer.vocab_size)}
    assert len(by_bytes) == core.tokenizer.vocab_size  # a token's bytes name its id
    return prompts, ids, [core.tokenizer.decode(x) for x in ids], by_bytes


def _config(pack, min_p: str) -> dict:
    root, shards = pack
    return {"parallel": 4,
            "args": [*shards, "--mtp", str(root / "mtp"), "--spec", "4", "--spec-min-p", min_p, "--batch-mtp",
                     "--kv", "int8", "--max-context", "4096", "--device", "cpu"]}


def _check_rounds(url: str, plain) -> None:
    """1, 1 streamed, 2 and 4 concurrent requests (the odd ones streamed), then 4 without
    logprobs: every one completes with plain decoding's ids (or text and count)."""
    prompts, want, want_text, by_bytes = plain
    for n, stream in [(1, False), (1, True), (2, None), (4, None)]:  # None: the odd ones stream
        modes = [stream if stream is not None else i % 2 == 1 for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            outs = list(pool.map(lambda i: _ask(url, TEXTS[i], stream=modes[i], logprobs=True), range(n)))
        for i, (toks, text, finish, usage) in enumerate(outs):
            assert [by_bytes[t] for t in toks] == want[i], (n, i, modes[i])
            assert text == want_text[i] and finish in ("length", "stop")
            assert usage["prompt_tokens"] == len(prompts[i]) and usage["completion_tokens"] == len(want[i])
    # without logprobs a window takes each row's argmax instead of whole rows
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: _ask(url, TEXTS[i], stream=i % 2 == 1, logprobs=False), range(4)))
    assert [(o[1], o[3]["completion_tokens"]) for o in outs] == [(t, len(w)) for t, w in zip(want_text, want)]
    assert all(o[2] in ("length", "stop") for o in outs)


def _per_slot(url: str, name: str) -> list[float]:
    lines = [ln for ln in HTTP.get(url + "/metrics", timeout=10).text.splitlines() if ln.startswith(name + "{")]
    return [float(ln.rsplit(" ", 1)[1]) for ln in lines]


def test_the_reports_config_serves_1_2_4_clients_with_plain_decodings_ids(pack, plain):
    """The report's flags as they are. The probe's line says batch-MTP is on for every slot and
    why; at --spec-min-p 0.5 this random draft's top probability stays below the bar, so it
    proposes nothing (the next test makes it draft)."""
    root, _ = pack
    with serving(root / "pack", _config(pack, "0.5")) as server:  # the config beside the shards
        server.wait_line(r"strata mtp: slot 3: .*--mtp .*mtp \(nextn layer 4\)")
        probe = server.wait_line(r"strata probe: (.*)").group(1)
        assert probe.startswith("batch-MTP on for slots 0-3 (cpu: every verify and draft tensor has a native "
                                "kernel"), probe
        server.wait_line(r"strata batch: prompt reuse is off for this model")
        _check_rounds(server.url, plain)


def test_drafting_on_every_slot_rolls_back_to_plain_decodings_ids(pack, plain):
    """The same at --spec-min-p 0: every decode window of every busy slot verifies 4 drafts
    (batched across slots), the random draft's are rejected, and each rejection cuts back every
    state piece of the sequence and of its draft; the ids stay plain decoding's."""
    root, _ = pack
    with serving(root / "pack", _config(pack, "0")) as server:
        _check_rounds(server.url, plain)
        drafted = _per_slot(server.url, "strata_mtp_drafted_tokens_total")
        assert len(drafted) == 4 and sum(d > 0 for d in drafted) >= 2, drafted
        assert sum(_per_slot(server.url, "strata_mtp_windows_total")) > 0


def test_bare_shard_names_resolve_against_the_pack_from_a_config_elsewhere(pack, tmp_path):
    """The report's bare shard names for --native and --ple-gguf are found in the --pack folder
    even when the config file lives elsewhere (its folder is where other relative paths go)."""
    with serving(tmp_path, _config(pack, "0.5")) as server:
        assert HTTP.get(server.url + "/health", timeout=10).status_code == 200
