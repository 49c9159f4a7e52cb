"""STRATA_CPU_THREADS: the default BLAS thread count of every CPU engine a process starts."""

from __future__ import annotations

import pytest

from strata.backend.cpu import ENV_THREADS, CpuBackend
from strata.errors import StrataError


def test_the_variable_sets_the_default_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv(ENV_THREADS, "1")
    assert CpuBackend()._threads == 1
    assert CpuBackend(threads=3)._threads == 3
    monkeypatch.delenv(ENV_THREADS)
    assert CpuBackend().start_line().endswith("--threads N sets it)")  # the free cores (default_threads)


@pytest.mark.parametrize("bad", ["0", "two", "-1", "1.5", "100000"])
def test_a_bad_value_is_one_line_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv(ENV_THREADS, bad)
    with pytest.raises(StrataError, match=rf"^{ENV_THREADS}='{bad}': expected a whole number in \[1, \d+\] "
                                          r"\(this machine's cores\)$"):
        CpuBackend()
