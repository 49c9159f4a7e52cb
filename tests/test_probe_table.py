"""The native kernel table: cpu rows from the numpy mirrors, lookups, removal, registration."""

from __future__ import annotations

import numpy as np
import pytest

from strata.errors import StrataError
from strata.kernels.ggml_types import ALL_TYPES, BY_NAME
from strata.kernels.mmvq_numpy import MIRRORED_TYPES, mmvq
from strata.backend.kernel_table import add_cuda_rows
from strata.kernels.native_table import DEFAULT_MAX_COLS, NativeTable, cpu_table
from strata.kernels.random_blocks import random_blocks

GENERIC_ONLY = {"Q8_1", "Q8_K", "I8", "I16", "I32", "I64", "F64"}
BUG_TYPES = {"Q2_0", "IQ4_NL", "IQ3_S"}


def test_cpu_rows_cover_every_quantized_weight_type():
    table = cpu_table()
    for t in ALL_TYPES:
        k = table.lookup("cpu", t.id)
        if t.name in GENERIC_ONLY:
            assert k is None and table.status("cpu", t.id) == "generic"
        else:
            assert k is not None, t.name
            assert k.max_cols == DEFAULT_MAX_COLS
            assert table.status("cpu", t.id) == f"native 1..{DEFAULT_MAX_COLS}"
    assert BUG_TYPES <= {BY_NAME[n].name for n in BY_NAME if table.lookup("cpu", BY_NAME[n].id)}


def test_supports_and_launch_split():
    table = cpu_table()
    q2 = BY_NAME["Q2_0"].id
    assert table.supports("cpu", q2, 1) and table.supports("cpu", q2, 8)
    assert not table.supports("cpu", q2, 9)
    assert table.lookup("cpu", q2).launches(16) == 2
    assert not table.supports("cuda", q2, 1)


def test_impl_is_the_mirror():
    table = cpu_table()
    tid = BY_NAME["IQ4_NL"].id
    rng = np.random.default_rng(3)
    w = random_blocks(tid, 8, 64, rng)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(table.lookup("cpu", tid).impl(w, x), mmvq(tid, w, x))


def test_without_copies_and_validates():
    table = cpu_table()
    smaller = table.without({"q2_0", "IQ4_NL"})
    assert smaller.lookup("cpu", BY_NAME["Q2_0"].id) is None
    assert smaller.lookup("cpu", BY_NAME["IQ4_NL"].id) is None
    assert table.lookup("cpu", BY_NAME["Q2_0"].id) is not None  # original untouched
    assert len(smaller.kernels()) == len(MIRRORED_TYPES) - 2
    with pytest.raises(StrataError, match="Q9_9"):
        table.without({"Q9_9"})


def test_register_another_backend():
    table = NativeTable()
    calls = []
    table.register("cuda", BY_NAME["Q4_K"].id, 4, lambda w, x: calls.append(1), "test kernel")
    assert table.supports("cuda", BY_NAME["Q4_K"].id, 4)
    assert not table.supports("cuda", BY_NAME["Q4_K"].id, 5)
    assert table.status("cuda", BY_NAME["Q2_0"].id) == "generic"
    rows = {r["type"]: r for r in table.rows(["cuda"])}
    assert rows["Q4_K"]["cuda"] == "native 1..4" and rows["Q4_K"]["block"] == 256
    with pytest.raises(ValueError):
        table.register("cuda", 77, 8, print)


def test_cuda_rows_never_fail():
    table = cpu_table()
    ok = add_cuda_rows(table)
    if not ok:
        assert table.unavailable["cuda"].startswith("not built")
        assert table.status("cuda", BY_NAME["Q4_K"].id) == "not built"
    assert table.lookup("cpu", BY_NAME["Q4_K"].id) is not None
