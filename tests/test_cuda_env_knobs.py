"""The CUDA backend's environment knobs (benchmark and test settings) and the training time
budgets: a bad value is one clear line naming it. Runs without a GPU (no backend is made)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strata.backend.cuda import env_int, env_switch
from strata.errors import StrataError


def test_env_int(monkeypatch):
    monkeypatch.delenv("STRATA_CUDA_PROMPT_TILE", raising=False)
    assert env_int("STRATA_CUDA_PROMPT_TILE", 256, 1) == 256
    monkeypatch.setenv("STRATA_CUDA_PROMPT_TILE", "128")
    assert env_int("STRATA_CUDA_PROMPT_TILE", 256, 1) == 128
    for bad in ("0", "-3", "many", "1.5"):
        monkeypatch.setenv("STRATA_CUDA_PROMPT_TILE", bad)
        with pytest.raises(StrataError, match=r"^STRATA_CUDA_PROMPT_TILE='.*': expected a whole number >= 1$"):
            env_int("STRATA_CUDA_PROMPT_TILE", 256, 1)


def test_env_switch_is_on_unless_zero(monkeypatch):
    monkeypatch.delenv("STRATA_CUDA_GROUPED", raising=False)
    assert env_switch("STRATA_CUDA_GROUPED")
    for value, on in (("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("STRATA_CUDA_GROUPED", value)
        assert env_switch("STRATA_CUDA_GROUPED") is on


@pytest.mark.parametrize("flag", ["--train-minutes", "--data-minutes"])
@pytest.mark.parametrize("value", ["0", "-2", "soon"])
def test_bad_minutes_are_one_line(flag, value):
    proc = subprocess.run([sys.executable, "-m", "strata.cli.main", "mtp", "train", "--out", "x.gguf", flag, value],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert flag in lines[-1] and "Traceback" not in proc.stderr
