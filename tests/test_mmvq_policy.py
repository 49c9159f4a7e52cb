"""The MMVQ launch policy (strata.kernels.cuda.mmvq_policy) on made-up devices: no GPU needed.

The rules choose an instance and a shape from device facts and knobs alone; the GPU tests
(tests/test_cuda_mmvq.py) check that every instance gives the same bits, these that each rule
picks what its docstring says.
"""

from __future__ import annotations

from strata.kernels.cuda import mmvq_policy as p
from strata.kernels.ggml_types import BY_NAME

Q4K, IQ3S, Q2_0, F16 = (BY_NAME[n].id for n in ("Q4_K", "IQ3_S", "Q2_0", "F16"))


def h200(pdl: bool = True, resident: int = 2640, lean_resident: int = 5280) -> p.DeviceFacts:
    """An H200-like device: 132 SMs, 227 KB of shared memory a block; `resident` warps of any
    default instance, `lean_resident` of a lean one."""
    return p.DeviceFacts(132, 227 * 1024, pdl, lambda t, name: lean_resident if name.endswith("true>") and
                         name.count(",") == 4 else resident)


def test_knobs_from_an_environment():
    assert p.read_knobs({}) == p.Knobs()
    k = p.read_knobs({"STRATA_MMVQ_WIDE_WARPS": "12", "STRATA_MMVQ_LEAN": "0", "STRATA_MMVQ_ALIGNED": "0",
                      "STRATA_MMVQ_ROWS_PER_WARP": "8", "STRATA_MMVQ_IN_FLIGHT": "3"})
    assert set(k.wide_warps.values()) == {12} and k.lean is False and not k.aligned and k.rows_per_warp == 8
    assert k.defines == ("-DIN_FLIGHT=3",)


def test_column_groups_and_launch_grids():
    assert p.column_groups(19) == [(0, 8, 2), (16, 3, 1)]
    assert p.column_groups(8) == [(0, 8, 1)]
    lns = p.column_launches(h200(), p.Knobs(), Q4K, 4096, 19, split=False)
    assert [(ln.c0, ln.name, ln.grid[1]) for ln in lns] == [(0, f"mmvq<{Q4K}, 8>", 2), (16, f"mmvq<{Q4K}, 3>", 1)]


def test_split_columns_only_for_small_matrices():
    facts = h200()
    name, rpw, bx = p.split_columns(facts, p.Knobs(), Q4K, 576, 8)
    assert name == f"mmvq<{Q4K}, 1>" and bx * rpw * p.WARPS >= 576
    assert p.split_columns(facts, p.Knobs(), Q4K, 576, 1) is None  # one column: nothing to split
    assert p.split_columns(facts, p.Knobs(), Q4K, 14336, 2) is None  # a full wave already
    assert p.split_columns(facts, p.Knobs(), F16, 576, 4) is None  # float weights: another kernel


def test_group_rows_for_few_long_rows():
    big = p.GROUP2_BYTES
    assert p.group_rows(14336, 2640, 8 * big) == p.RPW
    assert p.group_rows(4096, 2640, 3 * big) == 2
    assert p.group_rows(4096, 2640, big - 1) == p.RPW
    (ln,) = p.column_launches(h200(), p.Knobs(), Q4K, 4096, 1, split=False, aligned=True, k=14336)
    assert ln.name == f"mmvq<{Q4K}, 1, true, 2>" and ln.rpw == 2


def test_lean_only_under_pdl_past_one_wave():
    facts, knobs = h200(resident=1000, lean_resident=2000), p.Knobs()
    assert p.takes_lean(facts, knobs, Q4K, p.RPW * 1000 + 1, 1000)
    assert not p.takes_lean(facts, knobs, Q4K, p.RPW * 1000, 1000)  # one wave of the default
    assert not p.takes_lean(facts, knobs, Q4K, p.RPW * 2000 + 1, 1000)  # past one wave of the lean one
    assert not p.takes_lean(h200(pdl=False, resident=1000, lean_resident=2000), knobs, Q4K, p.RPW * 1000 + 1, 1000)
    assert not p.takes_lean(facts, knobs, Q2_0, p.RPW * 1000 + 1, 1000)  # not a lean type
    assert p.takes_lean(facts, p.Knobs(lean=True), Q2_0, 1, 1000)  # forced


def test_wide_needs_the_shared_memory_and_a_large_matrix():
    facts, knobs = h200(), p.Knobs()
    assert p.takes_wide(facts, knobs, IQ3S, p.WIDE_MIN_BYTES, 2)
    assert not p.takes_wide(facts, knobs, IQ3S, p.WIDE_MIN_BYTES - 1, 2)
    assert not p.takes_wide(facts, knobs, IQ3S, p.WIDE_ANY_BYTES - 1, p.RPW)
    assert p.takes_wide(facts, knobs, IQ3S, p.WIDE_ANY_BYTES, p.RPW)
    assert not p.takes_wide(facts, knobs, Q4K, p.WIDE_ANY_BYTES, p.RPW)  # no codebook
    ada = p.DeviceFacts(128, 99 * 1024, False, facts.resident)  # an sm_89 card: 99 KB a block
    assert not p.takes_wide(ada, knobs, IQ3S, p.WIDE_ANY_BYTES, p.RPW)
    rpw, warps, blocks = p.wide_shape(132, 28672, 4, 16)
    assert warps == 14 and blocks <= 132 and rpw * warps * blocks >= 28672


def test_rows_per_warp_rules():
    facts, knobs = h200(pdl=False, resident=1000), p.Knobs()
    assert p.rows_per_warp(facts, knobs, Q2_0, "", 14336, one_column=True) == p.RPW  # decode-heavy
    assert p.rows_per_warp(facts, knobs, Q4K, "", 14336, one_column=True) == 16  # one wave: 14336 / 1000
    assert p.rows_per_warp(h200(pdl=True, resident=1000), knobs, Q4K, "", 14336, one_column=True) == p.RPW
    assert p.rows_per_warp(facts, p.Knobs(rows_per_warp=6), Q4K, "", 14336) == 8  # forced, whole groups
