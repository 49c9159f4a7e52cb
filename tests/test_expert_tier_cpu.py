"""The CPU backend's expert tier (strata/backend/cpu_experts.py): pooled expert tensors keep only
their quantized blocks (a view of the pack's map), the slots hold float32 experts dequantized on
a miss, and `--expert-cache auto` picks a pool when the float32 experts do not fit the memory
(made small here with the test-only STRATA_CPU_MEMORY), where `off` refuses the pack in one line."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strata.backend import cpu_experts
from strata.backend.cpu import ENV_MEMORY, CpuBackend
from strata.backend.cpu_layout import dequantize_source, expert_blocks, expert_matrices, expert_matrix, transposed
from strata.engine.core import EngineCore
from strata.engine.expert_room import auto_room
from strata.engine.options import parse_engine_args
from strata.errors import OutOfMemory
from strata.experts.budget import expert_tensors
from strata.kernels.ggml_types import BY_NAME
from strata.kernels.random_blocks import random_blocks
from strata.model.kv_cache import KVCache
from strata.pack.loader import open_pack
from tests.support import greedy_record as gr
from tests.support.engines import shared_tiny

# every expert type the synthetic packs use (presets.TYPE_PLANS), and the K / 8-bit / float ones
EXPERT_TYPES = ("IQ3_S", "IQ3_XXS", "IQ4_NL", "IQ4_XS", "Q2_0", "Q4_0", "Q4_K", "Q6_K", "Q8_0", "F16", "F32")


def _source(type_name: str, n_in: int, n_out: int, n_exp: int, seed: int) -> SimpleNamespace:
    t = BY_NAME[type_name]
    raw = random_blocks(t.id, n_exp * n_out, n_in, np.random.default_rng(seed)).reshape(-1)
    return SimpleNamespace(name="blk.0.ffn_up_exps.weight", ggml_type=t.id, shape=(n_in, n_out, n_exp),
                           data=lambda: raw)


@pytest.mark.parametrize("type_name", EXPERT_TYPES)
def test_one_expert_from_its_blocks_is_bit_equal_to_the_whole_tensor(type_name):
    n_in, n_out, n_exp = 512, 48, 5
    src = _source(type_name, n_in, n_out, n_exp, seed=len(type_name))
    whole = dequantize_source(src)  # (n_expert, out, in), the tensor at once
    blocks = expert_blocks(src)
    assert blocks.shape[0] == n_exp and np.shares_memory(blocks, src.data())  # a view: no copy
    made = expert_matrices(src)
    for e in range(n_exp):
        expect = transposed([whole[e]])
        one = expert_matrix(src.ggml_type, blocks[e], n_in, n_out, np.empty(n_in * n_out, np.float32))
        assert one.shape == (n_in, n_out)
        assert np.array_equal(one.view(np.uint32), expect.view(np.uint32)), e
        assert np.array_equal(made[e].view(np.uint32), expect.view(np.uint32)), e


def test_kv_position_bytes_before_a_cache_match_a_cache():
    for kind in ("f16", "int8"):
        c = KVCache(np, 3, 2, 64, 1024, kind)
        assert KVCache.position_bytes(np, 3, 2, 64, kind) == c.bytes_per_position


def test_a_memory_cap_is_what_free_bytes_reports_less_what_the_weights_hold(monkeypatch):
    monkeypatch.setenv(ENV_MEMORY, str(1 << 30))
    b = CpuBackend(threads=1)
    assert b.free_bytes() <= 1 << 30
    v = b.vector(SimpleNamespace(name="x", ggml_type=BY_NAME["F32"].id, shape=(1024,),
                                 data=lambda: np.zeros(4096, np.uint8)))
    assert b.free_bytes() <= (1 << 30) - v.nbytes
    monkeypatch.setenv(ENV_MEMORY, "lots")
    with pytest.raises(Exception, match=ENV_MEMORY):
        CpuBackend(threads=1)


# ---- the engine ------------------------------------------------------------------------------
CASE = next(c for c in gr.CASES if c.name == "tiny-qwen3moe")


def _args(pack_dir, flags) -> list[str]:
    return gr.pack_args(CASE, pack_dir) + list(flags) + ["--device", "cpu", "--prefix-cache", "0"]


def _load(pack_dir, flags, lines=None) -> EngineCore:
    opts = parse_engine_args(_args(pack_dir, flags), serving=False)
    return EngineCore.load(opts, log=(lines.append if lines is not None else lambda line: None))


def _plain_tokens(pack_dir, flags, lines=None):
    core = _load(pack_dir, flags, lines)
    try:
        return gr.run_mode(core, "plain", gr.SYNTH_PROMPTS)[0], core.expert_cache(), core.backend
    finally:
        core.stop()


def _figures(pack_dir):
    """(auto's room without a cap, every expert's float32 bytes) for the tiny pack."""
    opts = parse_engine_args(_args(pack_dir, []), serving=False)
    pack = open_pack(pack=str(pack_dir))
    try:
        backend = CpuBackend(threads=1)
        cfg = pack.model_config()
        tensors = expert_tensors(pack.tensors.values(), backend.expert_bytes)
        room = auto_room(backend, cfg, opts, cfg.n_ctx_train, list(pack.tensors.values()), False,
                         {t.name for t in tensors})
        return room, sum(t.expert_bytes * t.n_expert for t in tensors)
    finally:
        pack.close()


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return shared_tiny(tmp_path_factory, "qwen3moe", vocab=gr.VOCAB)


@pytest.fixture(scope="module")
def resident(pack_dir):
    return _plain_tokens(pack_dir, [])[0]


def test_pooled_tensors_are_not_dequantized_at_load(pack_dir, resident, monkeypatch):
    made = []
    whole = cpu_experts.expert_matrices
    monkeypatch.setattr(cpu_experts, "expert_matrices", lambda src: made.append(src.name) or whole(src))
    tokens, stats, backend = _plain_tokens(pack_dir, ["--expert-cache", "25%"])
    store = backend.experts
    pooled = [w for members in store._members.values() for w in members]
    assert pooled and set(store.plan.tensors) == {w.name for w in pooled}
    assert not set(made) & set(store.plan.tensors), "a pooled tensor was dequantized whole"
    for w in pooled:  # the host copy is the pack's blocks, not a float32 array
        assert w.wt is None and w.blocks.dtype == np.uint8 and not w.blocks.flags.owndata
    # the experts' float32: the slots and one scratch expert, a quarter of the whole
    f32 = sum(t.expert_bytes * t.n_expert for t in expert_tensors(
        (SimpleNamespace(name=w.name, ggml_type=w.type_id, shape=(w.n_in, w.n_out, w.n_expert)) for w in pooled),
        backend.expert_bytes))
    assert store.nbytes() == store.plan.pool_bytes + max(w.n_in * w.n_out for w in pooled) * 4
    assert store.plan.pool_bytes <= f32 // 4
    assert tokens == resident
    assert stats["uploads"] > 0 and stats["bytes_uploaded"] == stats["uploads"] * stats["pool_bytes"] // stats["slots"]
    assert (stats["host_seconds"] > 0) == (stats["host_served"] > 0)


def test_auto_picks_a_pool_when_the_budget_is_small(pack_dir, resident, monkeypatch):
    room, f32 = _figures(pack_dir)
    lines: list[str] = []
    core = _load(pack_dir, [], lines)  # uncapped: every expert fits, no pool and no line
    try:
        assert core.expert_cache() is None and not any(ln.startswith("strata: experts:") for ln in lines)
    finally:
        core.stop()
    monkeypatch.setenv(ENV_MEMORY, str(room.weights + room.state + room.margin + f32 // 2))
    lines = []
    tokens, stats, _ = _plain_tokens(pack_dir, [], lines)
    (line,) = [ln for ln in lines if ln.startswith("strata: experts:")]
    slots = stats["slots"]
    assert 0 < slots < stats["experts"] and abs(slots - stats["experts"] // 2) <= 1, line
    assert f"{slots} slots of {stats['experts']}" in line and "as float32 in host RAM" in line
    assert "(--expert-cache auto" in line and "auto:" in line and "margin" in line and "in the pack file" in line
    assert tokens == resident


def test_experts_larger_than_memory_load_with_auto_and_are_refused_with_off(pack_dir, resident, monkeypatch):
    room, f32 = _figures(pack_dir)
    cap = room.weights + f32 // 2  # the float32 experts do not fit beside the rest
    monkeypatch.setenv(ENV_MEMORY, str(cap))
    with pytest.raises(OutOfMemory) as refused:
        _load(pack_dir, ["--expert-cache", "off"])
    msg = refused.value.message
    assert "\n" not in msg and "does not fit on cpu" in msg and "--expert-cache auto" in msg, msg
    lines: list[str] = []
    tokens, stats, backend = _plain_tokens(pack_dir, ["--expert-cache", "auto"], lines)
    assert stats is not None and stats["slots"] < stats["experts"] and stats["host_served"] > 0
    assert backend.held_bytes() < cap
    assert tokens == resident


@pytest.mark.parametrize("spec", [None, 0, 2])
def test_the_room_check_counts_a_pack_s_nextn_layer_only_when_mtp_loads_it(tmp_path_factory, monkeypatch, spec):
    """A pack's own MTP layer (its experts too) stays in the file when MTP is off (the CPU's
    default for a pack's nextn layer, or --spec 0): auto's budget leaves room for the draft only
    when it loads, and the refusal (the last check) never counts it, since a draft that does not
    fit only turns MTP off."""
    pack_dir = shared_tiny(tmp_path_factory, "qwen35moe", vocab=gr.VOCAB)
    seen: list[set[str]] = []
    weight_bytes = CpuBackend.weight_bytes
    monkeypatch.setattr(CpuBackend, "weight_bytes",
                        lambda self, tensors, *a, **k: seen.append({t.name for t in tensors}) or
                        weight_bytes(self, tensors, *a, **k))
    flags = [] if spec is None else ["--spec", str(spec)]
    opts = parse_engine_args(["--pack", str(pack_dir), "--device", "cpu", *flags], serving=False)
    core = EngineCore.load(opts, log=lambda line: None)
    try:
        n_layer, drafting = core.cfg.n_layer, core.draft is not None
    finally:
        core.stop()
    assert drafting == (spec == 2) and seen
    has_nextn = [any(n.startswith(f"blk.{n_layer}.") for n in names) for names in seen]
    assert all(any(n.startswith("blk.0.") for n in names) for names in seen)
    assert any(has_nextn) == drafting and not has_nextn[-1]


def test_a_window_s_misses_dequantized_on_threads_give_the_resident_tokens(pack_dir, resident):
    """--threads 2: a window's misses are dequantized side by side (each into its own slot), and
    the tokens are the resident engine's."""
    tokens, stats, backend = _plain_tokens(pack_dir, ["--expert-cache", "25%", "--threads", "2"])
    assert backend.experts.threads == 2 and backend.experts._workers is not None
    assert stats["uploads"] > 1 and tokens == resident
