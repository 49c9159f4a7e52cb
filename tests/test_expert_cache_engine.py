"""The expert cache in the engine, on the CPU backend: `--expert-cache N%` builds a pool smaller
than the experts (float32 slots over the pack's quantized blocks, strata/backend/cpu_experts.py), and
greedy tokens equal the all-resident engine's in every mode of the greedy record (plain, two slots
batched, --spec 2 with and without --batch-mtp) for qwen3moe (tiny, and seed-moe with its draft),
qwen35moe and qwen4exp, while the pool hits, misses, evicts and serves what does not fit from host."""

from __future__ import annotations

import pytest

from strata.engine.core import EngineCore
from strata.engine.options import parse_engine_args
from tests.support import greedy_record as gr
from tests.support.engines import shared_seed_moe, shared_tiny

CACHES = (["--expert-cache", "25%"], ["--expert-cache", "50%", "--expert-policy", "lru"])
CASES = [c for c in gr.CASES if c.name in ("tiny-qwen3moe", "tiny-qwen35moe", "tiny-qwen4exp", "seed-moe")]
MODES = ("plain", "parallel2", "spec2", "spec2_batch_mtp")


def _pack(case: gr.Case, tmp_path_factory):
    if case.pack == "seed-moe":
        return shared_seed_moe(tmp_path_factory, vocab=gr.VOCAB)
    return shared_tiny(tmp_path_factory, case.pack.split(":", 1)[1], vocab=gr.VOCAB)


def _load(case, pack_dir, flags, lines=None) -> EngineCore:
    opts = parse_engine_args(gr.pack_args(case, pack_dir) + list(flags) + ["--device", "cpu", "--prefix-cache", "0"],
                             serving=False)
    return EngineCore.load(opts, log=(lines.append if lines is not None else lambda line: None))


def _tokens(case, pack_dir, extra) -> tuple[dict, list]:
    """Tokens per mode, and the cache's counters after each mode's engine."""
    out, stats = {}, []
    for mode in [m for m in MODES if m in gr.mode_names(case)]:
        core = _load(case, pack_dir, gr.MODE_FLAGS[mode][0] + extra)
        try:
            out[mode] = gr.run_mode(core, mode, gr.SYNTH_PROMPTS)[0]
            stats.append(core.expert_cache())
        finally:
            core.stop()
    return out, stats


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_tokens_with_a_small_pool_equal_all_resident(case, tmp_path_factory):
    pack_dir = _pack(case, tmp_path_factory)
    resident, none = _tokens(case, pack_dir, [])
    assert all(s is None for s in none)
    hits = 0
    for extra in CACHES:
        cached, stats = _tokens(case, pack_dir, extra)
        assert cached == resident, f"{extra}: tokens differ from all-resident"
        assert all(s is not None and s["misses"] > 0 and s["evictions"] > 0 for s in stats), stats
        hits += sum(s["hits"] for s in stats)
        for s in stats:
            assert s["hits"] + s["misses"] == s["lookups"] and s["uploads"] + s["host_served"] == s["misses"]
            assert s["bytes_uploaded"] == s["uploads"] * s["pool_bytes"] // s["slots"]
    assert hits > 0


def test_a_pool_holding_every_expert_is_the_resident_path(tmp_path_factory):
    case = next(c for c in CASES if c.name == "tiny-qwen3moe")
    pack_dir = _pack(case, tmp_path_factory)
    for flags in (["--expert-cache", "100%"], ["--expert-cache", "off"], ["--expert-cache", "64GiB"]):
        lines: list[str] = []
        core = _load(case, pack_dir, flags, lines)
        try:
            assert core.expert_cache() is None and not any("experts:" in ln for ln in lines)
        finally:
            core.stop()


def test_start_up_line_metrics_and_slots_show_the_cache(tmp_path_factory):
    from strata.server.metrics import EngineMetrics

    case = next(c for c in CASES if c.name == "tiny-qwen35moe")
    pack_dir = _pack(case, tmp_path_factory)
    lines: list[str] = []
    core = _load(case, pack_dir, ["--parallel", "2", "--expert-cache", "25%"], lines)
    try:
        (line,) = [ln for ln in lines if ln.startswith("strata: experts:")]
        assert "8 slots of 32" in line and "as float32 in host RAM" in line and "in the pack file" in line
        gr.run_mode(core, "parallel2", gr.SYNTH_PROMPTS)
        stats = core.metrics()["expert_cache"]
        assert stats["windows"] > 0 and stats["window_bytes"] >= 0 and 0 <= stats["hit_rate"] <= 1
        assert stats["policy"] == "frequency" and stats["slots"] == 8 and stats["experts"] == 32
        assert all(s["expert_cache"] == stats for s in core.slots_info())
        text = EngineMetrics(lambda: core).render().decode()
        for name in ("strata_expert_cache_hits_total", "strata_expert_cache_misses_total",
                     "strata_expert_cache_uploaded_bytes_total", "strata_expert_cache_hit_rate",
                     "strata_expert_cache_window_uploaded_bytes", "strata_expert_cache_evictions_total"):
            assert name in text, name
        (value,) = [ln.split()[1] for ln in text.splitlines() if ln.startswith("strata_expert_cache_uploaded_bytes_total ")]
        assert float(value) == stats["bytes_uploaded"] > 0
    finally:
        core.stop()


def test_a_verification_window_shares_its_uploads(tmp_path_factory):
    """--spec 2 --batch-mtp: a window's tokens (both slots' last tokens and drafts) resolve each
    layer once; an expert several of them route to is uploaded once."""
    case = next(c for c in CASES if c.name == "tiny-qwen35moe")
    pack_dir = _pack(case, tmp_path_factory)
    core = _load(case, pack_dir, gr.MODE_FLAGS["spec2_batch_mtp"][0] + ["--expert-cache", "50%"])
    try:
        cache = core.backend.experts.cache
        seen = []
        resolve = cache.resolve

        def spy(group, ids):
            r = resolve(group, ids)
            seen.append((ids.shape[0], r))
            return r

        cache.resolve = spy
        gr.run_mode(core, "spec2_batch_mtp", gr.SYNTH_PROMPTS)
        assert any(n > 2 for n, _ in seen), "no window of several tokens per slot"
        distinct = {id(r): r for _, r in seen}.values()
        # a layer's tensors (gate, up, down) share one resolution per window, counted once
        assert len(distinct) < len(seen)
        assert cache.stats.lookups == sum(len(r.experts) for r in distinct)
        for r in distinct:  # each missing expert uploaded once, however many tokens route to it
            ups = [e for e, _ in r.uploads]
            assert len(ups) == len(set(ups)) <= len(r.experts)
    finally:
        core.stop()
