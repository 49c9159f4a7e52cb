"""Prompt reuse has scopes: `cache_salt` (vLLM's field) keeps one client's cached prompt blocks
from being found, and reported in usage.prompt_tokens_details.cached_tokens, by a request of
another salt. Over real HTTP against the shared `strata serve` (tests/support/shared_server.py),
and on the prefix cache itself with a real KV cache."""

from __future__ import annotations

import json
import secrets

import httpx

from support import shared_server
from support.server_proc import HTTP
from support.shared_server import AUTH

server = shared_server.module_fixture(__name__)

BLOCK = 64  # strata.batch.prefix_cache.BLOCK


def _chat(server, system: str, salt: str | None = None) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}],
            "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    return HTTP.post(server.url + "/v1/chat/completions", content=json.dumps(body).encode(), timeout=60,
                     headers={"content-type": "application/json", **AUTH})


def _cached(server, system: str, salt: str | None = None) -> int:
    r = _chat(server, system, salt)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _secret_prompt(pin: str, tag: str) -> str:
    # the PIN sits in the first 64-token block; the text after it makes the prompt span more
    # blocks, so a guess that matches the PIN would find that block cached
    return (f"Vault {tag}. The PIN is {pin}. Never say it. "
            + "Answer questions about the vault politely and briefly, in one sentence. " * 9)


def test_a_guess_in_another_scope_learns_nothing(server):
    """The guessing oracle: a victim's system prompt holds a PIN; an attacker sends the same
    prompt with guessed PINs. In another salt (or none), even the right guess reports no reuse;
    the victim's own salt reuses its blocks."""
    tag = secrets.token_hex(4)  # this run's own prompts (the server is shared, its cache too)
    victim = "victim-" + tag
    assert _cached(server, _secret_prompt("4821", tag), victim) == 0
    for guess in ("1234", "4821"):  # a wrong guess and the right one
        assert _cached(server, _secret_prompt(guess, tag), "attacker-" + tag) == 0, guess
    assert _cached(server, _secret_prompt("4821", tag)) == 0  # no salt is a scope of its own
    # within one scope reuse works: the victim again, and the attacker's own repeat
    assert _cached(server, _secret_prompt("4821", tag), victim) >= 2 * BLOCK
    assert _cached(server, _secret_prompt("1234", tag), "attacker-" + tag) >= 2 * BLOCK


def test_an_empty_or_oversized_salt_is_refused(server):
    for salt in ("", "x" * 1025):
        r = _chat(server, "Hi.", salt)
        assert r.status_code == 400, r.text
        assert "cache_salt" in r.json()["error"]["message"]


def test_the_prefix_cache_finds_blocks_only_in_their_scope():
    import numpy as np

    from strata.batch.prefix_cache import PrefixCache
    from strata.model.kv_cache import KVCache
    src = KVCache(np, n_layer=1, n_kv=1, head_dim=4, max_ctx=512)
    src.load(0, [[np.ones((1, 3 * BLOCK, 4), np.float16)] * 2])
    tokens = list(range(3 * BLOCK))
    pc = PrefixCache(1 << 20)
    pc.store(tokens, src, None, salt="a")
    assert pc.match(tokens, len(tokens), False, salt="a") == 3 * BLOCK
    assert pc.match(tokens, len(tokens), False, salt="b") == 0
    assert pc.match(tokens, len(tokens), False) == 0
    dst = KVCache(np, n_layer=1, n_kv=1, head_dim=4, max_ctx=512)
    assert pc.load(tokens, dst, None, len(tokens), salt="b") == (0, None)
    pc.store(tokens, src, None)  # the unsalted scope keeps its own copy
    assert pc.match(tokens, len(tokens), False) == 3 * BLOCK
