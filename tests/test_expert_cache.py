"""The expert cache's logic without a model: the policies (strata/experts/policy.py), the slot
pool's bookkeeping (cache.py) and `--expert-cache` as slots (budget.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strata.experts.budget import (
    CacheRequest, ExpertTensor, auto_budget, expert_tensors, parse_cache_request, plan_cache, split_expert_name,
)
from strata.experts.cache import HOST, ExpertCache, GroupSpec, PoolSpec
from strata.experts.policy import LRU, FrequencyLRU


# ---- policies ---------------------------------------------------------------------------------
def test_lru_keys_are_the_window_of_the_last_use():
    count, last, key = LRU().use(np.array([2.0, 0.0]), np.array([3.0, 0.0]), np.array([1, 4]), 7)
    assert list(count) == [3, 4] and list(last) == [7, 7] and list(key) == [7, 7]
    _, _, seeded = LRU().seed(np.array([0.5, 0.0, 2.0]))
    assert seeded[2] > seeded[0] > seeded[1] and seeded.max() < 1  # the hottest most recent, all before window 1


def test_frequency_keys_rank_by_the_decayed_count_now():
    f = FrequencyLRU(half_life=2)
    # "old": 8 tokens at window 0; "new": 1 token at window 20: C(20) = 8 * 2^-10 against 1
    _, _, k_old = f.use(np.zeros(1), np.zeros(1), np.array([8]), 0)
    _, _, k_new = f.use(np.zeros(1), np.zeros(1), np.array([1]), 20)
    assert k_old[0] == pytest.approx(3.0) and k_new[0] == pytest.approx(10.0)
    # a unit used 10 windows running outranks one used once, later (LRU would rank them the other way)
    c, last = np.zeros(1), np.zeros(1)
    for t in range(1, 11):
        c, last, k_hot = f.use(c, last, np.array([1]), t)
    _, _, k_once = f.use(np.zeros(1), np.zeros(1), np.array([1]), 11)
    assert k_hot[0] > k_once[0]


def test_frequency_seed_is_the_steady_count_of_a_rate():
    f = FrequencyLRU(half_life=8)
    c_seed, _, _ = f.seed(np.array([0.5, 0.0]))
    c, last = np.zeros(1), np.zeros(1)
    for t in range(400):
        c, last, _ = f.use(c, last, np.array([0.5]), t)
    assert c_seed[0] == pytest.approx(c[0], rel=1e-6) and c_seed[1] == 0
    with pytest.raises(ValueError):
        FrequencyLRU(half_life=0)


# ---- the pool's bookkeeping -----------------------------------------------------------------
def _cache(slots: int, layers: int = 2, experts: int = 8, policy: str = "lru") -> ExpertCache:
    return ExpertCache([PoolSpec(slots, 100)], [GroupSpec(f"blk.{i}.", experts, 0) for i in range(layers)], policy)


def test_resolve_counts_hits_misses_uploads_and_evictions():
    c = _cache(3)
    c.begin_window()
    r = c.resolve(0, np.array([[1, 2], [2, 1]]))  # 2 tokens, both to experts 1 and 2: one upload each
    assert list(r.experts) == [1, 2] and sorted(r.slots) == [0, 1]
    assert r.uploads == [(1, 0), (2, 1)]
    s = c.stats
    assert (s.lookups, s.hits, s.misses, s.uploads, s.bytes_uploaded, s.window_bytes) == (2, 0, 2, 2, 200, 200)
    c.begin_window()
    assert s.window_bytes == 0
    r = c.resolve(0, np.array([[2, 3]]))  # 2 hits, 3 takes the last free slot
    assert (s.hits, s.misses, s.evictions) == (1, 3, 0) and r.uploads == [(3, 2)]
    c.begin_window()
    r = c.resolve(1, np.array([[5, 2]]))  # layer 1: full pool, evicts layer 0's least recent (expert 1)
    assert s.evictions == 2
    assert c.resident(0) == {3: 2} and c.resident(1) == {2: 0, 5: 1}
    assert s.hit_rate() == pytest.approx(1 / 6)


def test_a_layers_next_tensor_in_the_same_window_reuses_the_resolution():
    c = _cache(4)
    c.begin_window()
    ids = np.array([[0, 1]])
    first = c.resolve(0, ids)
    again = c.resolve(0, ids.copy())
    assert again is first and c.stats.lookups == 2
    c.begin_window()
    assert c.resolve(0, ids) is not first and c.stats.hits == 2


def test_a_window_needing_more_experts_than_slots_serves_the_rest_from_host():
    c = _cache(2)
    c.begin_window()
    r = c.resolve(0, np.array([[0, 1], [2, 3]]))  # a prompt chunk touching 4 experts, 2 slots
    assert list(r.slots).count(HOST) == 2 and len(r.uploads) == 2
    assert c.stats.host_served == 2 and c.stats.evictions == 0
    assert r.slot_of(0) != HOST  # the first needed take the slots; none evicts another of the window


def test_preload_fills_the_hottest_and_seeds_the_order():
    c = _cache(3, layers=2, experts=4)
    rates = {0: np.array([0.1, 0.9, 0.0, 0.3]), 1: np.array([0.5, 0.0, 0.0, 0.05])}
    placed = c.preload(lambda g: rates.get(g))
    assert sorted((g, e) for g, e, _ in placed) == [(0, 1), (0, 3), (1, 0)]
    c.begin_window()
    c.resolve(0, np.array([[2]]))  # a miss: LRU evicts the coldest preloaded unit (layer 0's expert 3)
    assert c.resident(0) == {1: c.resident(0)[1], 2: c.resident(0)[2]} and 3 not in c.resident(0)


@pytest.mark.parametrize("policy", ["lru", "frequency"])
def test_random_traces_keep_the_residency_consistent(policy):
    rng = np.random.default_rng(1)
    c = _cache(5, layers=3, experts=8, policy=policy)
    for _ in range(300):
        c.begin_window()
        for g in range(3):
            ids = rng.integers(0, 8, (int(rng.integers(1, 4)), 2))
            r = c.resolve(g, ids)
            held = [s for s in r.slots if s != HOST]
            assert len(set(held)) == len(held)  # no two of the window's experts share a slot
            for e, s in zip(r.experts, r.slots):
                if s != HOST:
                    assert c.resident(g)[int(e)] == s
        pool = c._pools[0]
        held = [(g, e, s) for g in range(3) for e, s in c.resident(g).items()]
        assert len(held) + len(pool.free) == 5
        assert all(pool.group[s] == g and pool.expert[s] == e for g, e, s in held)
    st = c.stats
    assert st.hits + st.misses == st.lookups and st.uploads + st.host_served == st.misses


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown expert cache policy"):
        _cache(2, policy="mru")


# ---- --expert-cache as slots -------------------------------------------------------------
@pytest.mark.parametrize("text,want", [
    ("auto", CacheRequest("auto")), ("OFF", CacheRequest("off")), ("50%", CacheRequest("share", 0.5)),
    ("12.5%", CacheRequest("share", 0.125)), ("512MiB", CacheRequest("bytes", 512 << 20)),
    ("20GiB", CacheRequest("bytes", 20 << 30)), ("1.5gb", CacheRequest("bytes", 1.5e9)),
])
def test_cache_requests_parse(text, want):
    assert parse_cache_request(text) == want


@pytest.mark.parametrize("text", ["12", "0%", "101%", "-5%", "abc", "5XB", "0GiB", "%", "2PiB"])
def test_bad_cache_requests_say_what_is_expected(text):
    with pytest.raises(ValueError):
        parse_cache_request(text)


def test_a_bad_flag_value_is_one_line_naming_the_flag():
    from strata.engine.options import parse_engine_args
    from strata.errors import StrataError

    with pytest.raises(StrataError, match="--expert-cache.*512MiB"):
        parse_engine_args(["--expert-cache", "12"])
    with pytest.raises(StrataError, match="--expert-policy"):
        parse_engine_args(["--expert-policy", "mru"])
    assert parse_engine_args(["--expert-cache", "25%"]).expert_cache_request() == CacheRequest("share", 0.25)


def test_expert_tensor_names():
    assert split_expert_name("blk.3.ffn_down_exps.weight") == ("blk.3.", "ffn_down_exps")
    assert split_expert_name("blk.12.ffn_gate_up_exps.weight") == ("blk.12.", "ffn_gate_up_exps")
    assert split_expert_name("blk.3.ffn_down_shexp.weight") is None
    infos = [SimpleNamespace(name="blk.0.ffn_up_exps.weight", ggml_type=0, shape=(4, 6, 8)),
             SimpleNamespace(name="blk.0.ffn_gate_inp.weight", ggml_type=0, shape=(4, 8))]
    (t,) = expert_tensors(infos, lambda ty, shape: shape[0] * shape[1] * 4)
    assert (t.group, t.role, t.n_expert, t.expert_bytes) == ("blk.0.", "ffn_up_exps", 8, 96)


def _layers(downs: list[int]) -> list[ExpertTensor]:
    """Layers of 16 experts: gate and up of 100 bytes an expert, downs of the given sizes."""
    out = []
    for i, d in enumerate(downs):
        p = f"blk.{i}."
        out += [ExpertTensor(p + "ffn_gate_exps.weight", p, "ffn_gate_exps", 16, 100),
                ExpertTensor(p + "ffn_up_exps.weight", p, "ffn_up_exps", 16, 100),
                ExpertTensor(p + "ffn_down_exps.weight", p, "ffn_down_exps", 16, d)]
    return out


def test_layers_of_one_size_share_a_global_pool():
    plan = plan_cache(_layers([100] * 4), CacheRequest("share", 0.25))
    assert len(plan.pools) == 1 and plan.pools[0] == PoolSpec(16, 300)
    assert [g.pool for g in plan.groups] == [0] * 4 and [g.name for g in plan.groups] == [f"blk.{i}." for i in range(4)]
    assert (plan.n_slots, plan.n_units, plan.expert_bytes, plan.pool_bytes) == (16, 64, 64 * 300, 16 * 300)
    line = plan.line("on the cuda", "in host RAM")
    assert "16 slots of 64" in line and "on the cuda" in line and "in host RAM" in line


def test_a_type_mix_by_layer_gets_a_pool_per_size_at_the_same_share():
    plan = plan_cache(_layers([50, 200, 50, 200]), CacheRequest("bytes", 0.5 * (32 * 250 + 32 * 400)))
    assert sorted(plan.pools, key=lambda p: p.slot_bytes) == [PoolSpec(16, 250), PoolSpec(16, 400)]
    assert plan.groups[0].pool == plan.groups[2].pool != plan.groups[1].pool == plan.groups[3].pool


def test_plans_that_keep_everything_resident_are_none():
    t = _layers([100] * 2)
    assert plan_cache(t, CacheRequest("off")) is None
    assert plan_cache(t, CacheRequest("share", 1.0)) is None
    assert plan_cache(t, CacheRequest("bytes", 10 ** 9)) is None
    assert plan_cache(t, CacheRequest("auto"), auto_bytes=None) is None
    assert plan_cache([], CacheRequest("share", 0.5)) is None
    tiny = plan_cache(t, CacheRequest("bytes", 1))  # at least one slot
    assert tiny.n_slots == 1
    assert plan_cache(t, CacheRequest("auto"), auto_bytes=8 * 300).n_slots == 8


def test_auto_budget_leaves_the_rest_and_a_margin():
    assert auto_budget(None, 0) is None
    assert auto_budget(10 << 30, 3 << 30, margin=1 << 30) == 6 << 30
    assert auto_budget(1 << 30, 3 << 30) == 0


@pytest.mark.parametrize("policy,evicted", [("lru", 0), ("frequency", 1)])
def test_frequency_keeps_a_hot_expert_that_lru_evicts(policy, evicted):
    c = ExpertCache([PoolSpec(2, 1)], [GroupSpec("blk.0.", 8, 0)], policy)
    for ids in [[0]] * 5 + [[1], [2]]:  # expert 0 five windows running, then 1 once, then 2 needs a slot
        c.begin_window()
        c.resolve(0, np.array([ids]))
    assert evicted not in c.resident(0) and 2 in c.resident(0)
