"""MTP out of the box for the default model: on the GPU (where it measured faster), not on the
CPU backend (where it measured slower); whatever the user names (--spec, --mtp, --spec-min-p) wins."""

from __future__ import annotations

from strata.mtp.defaults import DEFAULT_SPEC, default_spec
from tests.support.engines import load_engine


def test_default_spec_policy():
    assert default_spec("cuda", ()) == DEFAULT_SPEC["cuda"]
    assert default_spec("cuda", ("--parallel",)) == DEFAULT_SPEC["cuda"]
    assert default_spec("cuda", ("--spec-min-p",)) == (DEFAULT_SPEC["cuda"][0], None)  # the user's min-p stays
    assert default_spec("cuda", ("--spec",)) is None  # --spec 0 turns it off, --spec K sets K
    assert default_spec("cuda", ("--mtp",)) is None
    assert default_spec("cpu", ()) is None


def test_default_model_on_the_cpu_runs_without_mtp():
    core, lines = load_engine(["--device", "cpu", "--max-context", "256"])
    assert core.draft is None and core.opts.spec == 0
    assert not any("MTP on with the shipped draft" in line for line in lines)


def test_default_model_with_spec_given_uses_the_shipped_draft():
    core, lines = load_engine(["--device", "cpu", "--max-context", "256", "--spec", "2"])
    assert core.draft is not None and core.opts.spec == 2
