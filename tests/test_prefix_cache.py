"""Prompt reuse: a prompt that starts with tokens already computed takes their KV from the
prefix cache, across slots and over time; greedy tokens equal those without reuse."""

from __future__ import annotations

import pytest

from strata.protocol import GenerationRequest, SamplingParams
from tests.support.engines import collect, load_engine, shared_seed_moe, shared_tiny
from tests.support.model_fixtures import default_model_or_skip, plain_scheduler

SHARED = ("You are a careful assistant. Answer briefly and exactly. " * 12
          + "Here is the document: the river flows north through three towns, Alder, Birch and Cedar. ")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _prompts(core):
    chat = core.chat
    return [core.tokenizer.encode(chat.render([{"role": "system", "content": SHARED}, {"role": "user", "content": q}]),
                                  add_special=True)
            for q in ("Which town is first?", "How many towns are there?", "Name the last town.")]


def _run(core, prompt, params=GREEDY):
    h = core.submit(GenerationRequest(prompt, params))
    core.scheduler.run_until_idle()
    return collect(h)


def _plain(prompt, kv: str):
    """The prompt's tokens without reuse: plain decoding on the shared test model's weights (a
    scheduler without a prompt cache or a draft; the engines' drafts are lossless, so these are
    their greedy tokens too)."""
    sch = plain_scheduler(kv)
    h = sch.submit(GenerationRequest(prompt, GREEDY))
    sch.run_until_idle()
    return collect(h)


# f16 (10 s on 2 cores) runs with -m slow; int8, the quantized cache, always
@pytest.mark.parametrize("kv", [pytest.param("f16", marks=pytest.mark.slow), "int8"])
def test_reuse_over_time_equals_no_reuse(kv):
    model = str(default_model_or_skip())
    on, _ = load_engine(["--pack", model, "--device", "cpu", "--kv", kv, "--parallel", "2"])
    prompts = _prompts(on)
    assert len(prompts[0]) > 150
    for i, p in enumerate(prompts):
        want = _plain(p, kv)
        got = _run(on, p)
        assert got[0] == want[0]
        assert want[2].cached_tokens == 0
        if i == 0:
            assert got[2].cached_tokens == 0
            first = want[0]
        else:  # the shared system prompt's whole blocks came from the cache
            assert got[2].cached_tokens >= 128 and got[2].cached_tokens % 64 == 0
    m = on.metrics()
    assert m["prompt_tokens_cached"] > 0 and m["prefix_cache"]["hits"] == 2
    # a repeated prompt reuses all its whole blocks but its last token (`first`: its tokens
    # without reuse, above; plain decoding computes the same prompt the same way every time)
    again = _run(on, prompts[0])
    assert again[0] == first and again[2].cached_tokens == (len(prompts[0]) - 1) // 64 * 64


def test_reuse_across_slots_while_the_first_decodes():
    model = str(default_model_or_skip())
    core2, _ = load_engine(["--pack", model, "--device", "cpu", "--parallel", "2"])
    a, b, _ = _prompts(core2)
    want_b, _, fin = _plain(b, "f16")
    assert fin.cached_tokens == 0
    # a: 12 tokens, still decoding (11 to go) when b is admitted beside it, and through b's prefill
    ha = core2.submit(GenerationRequest(a, SamplingParams(max_tokens=12, temperature=0.0)))
    sch = core2.scheduler
    while not sch.slots[0].busy or sch.slots[0].prefilling:  # until a's prompt is in the cache
        sch._admit()
        sch._guarded_step()
    assert sch.slots[0].busy  # a is decoding in slot 0: b goes to slot 1
    hb = core2.submit(GenerationRequest(b, GREEDY))
    sch.run_until_idle()
    got_b = collect(hb)
    assert collect(ha)[2].cached_tokens == 0
    assert got_b[0] == want_b and got_b[2].cached_tokens >= 128  # slot 1 reused what slot 0 computed


def test_bounded_with_eviction():
    model = str(default_model_or_skip())
    core, _ = load_engine(["--pack", model, "--device", "cpu", "--prefix-cache", "2"])
    for p in _prompts(core):  # (one token each: the prompts' blocks are what the cache keeps)
        _run(core, p + [p[-1]] * 3, SamplingParams(max_tokens=1, temperature=0.0))
    st = core.metrics()["prefix_cache"]
    assert 0 < st["bytes"] <= st["budget_bytes"] == 2 << 20 and st["evicted_blocks"] > 0


def test_reuse_with_mtp_drafts_is_lossless(tmp_path_factory):
    pack = shared_seed_moe(tmp_path_factory)
    base = ["--pack", str(pack), "--device", "cpu"]
    plain, _ = load_engine(base + ["--prefix-cache", "0"])
    spec, _ = load_engine(base + ["--mtp", str(pack / "mtp"), "--spec", "3"])
    shared = plain.tokenizer.encode("the river flows north through three towns " * 20)
    prompts = [shared + plain.tokenizer.encode(q) for q in (" first", " second town", " third")]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    for i, p in enumerate(prompts):
        got = _run(spec, p, params)
        assert got[0] == _run(plain, p, params)[0]
        assert (got[2].cached_tokens > 0) == (i > 0)
    assert spec.scheduler.slots[0].counters.drafted > 0


def test_hybrid_models_say_reuse_is_off(tmp_path_factory):
    core, lines = load_engine(["--pack", str(shared_tiny(tmp_path_factory, "qwen35moe")), "--device", "cpu"])
    assert any("prompt reuse is off for this model" in ln for ln in lines)
    p = core.tokenizer.encode("hello world " * 80)
    assert [_run(core, p)[2].cached_tokens for _ in range(2)] == [0, 0]


# ---------------------------------------------------------------- what the bound counts

def _filled_cache(tokens: int, seed: int):
    """A real KV cache (2 layers, f16) holding `tokens` positions of distinct values."""
    import numpy as np

    from strata.model.kv_cache import KVCache
    cache = KVCache(np, n_layer=2, n_kv=1, head_dim=8, max_ctx=1024)
    rng = np.random.default_rng(seed)
    cache.load(0, [[rng.standard_normal((1, tokens, 8)).astype(np.float16) for _ in range(4)]])
    return cache


def _held_bytes(pc) -> int:
    """The bytes that the kept blocks really hold: every array they view, counted once."""
    held = {}
    for blk in pc.blocks.values():
        for a in list(blk.main) + list(blk.draft or []) + ([blk.last_hidden] if blk.last_hidden is not None else []):
            owner = a if a.base is None else a.base
            held[id(owner)] = owner.nbytes
    return sum(held.values())


def test_kept_roots_do_not_pin_their_runs_past_the_budget():
    """Long prompts stored whole (one copy per run), each one's first block then kept alive by
    cheap requests that share only it: eviction takes the leaves, and the bytes still held
    (each run's copy, while any of its blocks is viewed) stay within the budget."""
    import numpy as np

    from strata.batch.prefix_cache import BLOCK, PrefixCache
    n_blocks = 10
    block_bytes = 4 * BLOCK * 8 * 2  # k and v of 2 layers, 1 head of 8, f16
    pc = PrefixCache(budget_bytes=12 * block_bytes)
    prompts = []
    for r in range(8):
        prompt = [1000 * (r + 1) + i for i in range(n_blocks * BLOCK + 1)]
        src = _filled_cache(len(prompt), seed=r)
        prompts.append((prompt, src))
        pc.store(prompt, src, None)
        for earlier, _ in prompts:  # the cheap requests: one block each, the roots stay the most recent
            pc.load(earlier[: BLOCK + 1], _filled_cache(1, seed=99), None, BLOCK)
        held = _held_bytes(pc)
        assert held <= pc.budget, (r, held, pc.budget)
        assert pc.stats()["bytes"] == held  # what the bound counts is what is held
    # the blocks that survived (moved into copies of their own or not) give back their positions
    kept = 0
    for prompt, src in prompts:
        dst = _filled_cache(1, seed=99)
        m = pc.load(prompt, dst, None, len(prompt) - 1)[0]
        kept += m > 0
        for got, want in zip(dst.export(0, m), src.export(0, m)):
            np.testing.assert_array_equal(got, want)
    assert kept >= 2  # roots of earlier prompts, beside the last one
