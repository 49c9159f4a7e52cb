"""A shipped MTP draft is found by what its target is (a fingerprint of the target's vocabulary
and tensors, recorded in the draft), not by the target's path; `strata probe` and the engine
decide the MTP defaults with the one function (strata.mtp.defaults.plan_mtp)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from strata.engine.options import parse_engine_args
from strata.gguf.reader import GGUFFile
from strata.mtp.defaults import (DEFAULT_DRAFT_FILE, FINGERPRINT_KEY, default_draft_path, plan_mtp,
                                 shipped_draft_for, target_fingerprint)
from strata.pack.loader import open_pack
from support.server_proc import ROOT
from tests.support.engines import load_engine
from tests.support.model_fixtures import default_model_or_skip, synth_model


@pytest.fixture(scope="module")
def default_model():
    return default_model_or_skip()


@pytest.fixture(scope="module")
def elsewhere(default_model, tmp_path_factory):
    """The default model under another path and name, as a user gives it with --pack."""
    link = tmp_path_factory.mktemp("models") / "my-copy-of-smollm.gguf"
    link.symlink_to(default_model)
    return link


def _opened(path):
    return open_pack(pack=str(path))


def test_the_shipped_draft_records_its_targets_fingerprint(default_model):
    with GGUFFile(default_draft_path()) as draft:
        recorded = draft.metadata[FINGERPRINT_KEY]
    assert recorded == target_fingerprint(_opened(default_model))
    assert recorded.startswith("sha256:") and len(recorded) == len("sha256:") + 64


def test_the_fingerprint_is_the_model_not_its_path(default_model, elsewhere, tmp_path):
    assert shipped_draft_for(_opened(default_model)).name == DEFAULT_DRAFT_FILE
    assert shipped_draft_for(_opened(elsewhere)).name == DEFAULT_DRAFT_FILE
    other = synth_model(tmp_path, "llama")  # another model: no shipped draft
    assert shipped_draft_for(_opened(other)) is None


def test_plan_is_the_same_for_any_path_of_the_model(default_model, elsewhere):
    for args in ([], ["--pack", str(elsewhere)]):
        plan = plan_mtp(parse_engine_args(args, serving=False), _opened(elsewhere if args else default_model), "cpu")
        assert plan.auto and plan.opts.spec == 1 and plan.mtp == str(default_draft_path())
    # what the user names wins: --spec K keeps the draft, not the default; --spec 0 or --mtp turn it away
    plan = plan_mtp(parse_engine_args(["--spec", "3"], serving=False), _opened(default_model), "cpu")
    assert (plan.auto, plan.opts.spec, plan.mtp) == (False, 3, str(default_draft_path()))
    plan = plan_mtp(parse_engine_args(["--spec", "0"], serving=False), _opened(default_model), "cpu")
    assert (plan.auto, plan.opts.spec, plan.mtp) == (False, 0, None)
    plan = plan_mtp(parse_engine_args(["--mtp", "x.gguf"], serving=False), _opened(default_model), "cpu")
    assert (plan.auto, plan.opts.spec, plan.mtp) == (False, 0, "x.gguf")


def _probe(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "strata.cli.main", "probe", "--device", "cpu", "--json", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_probe_reports_the_draft_and_spec_the_engine_uses(elsewhere):
    shipped = f"shipped draft {DEFAULT_DRAFT_FILE}"
    out = _probe("--spec", "4", "--parallel", "4", "--batch-mtp")
    assert out["draft"] == shipped
    out = _probe("--pack", str(elsewhere), "--spec", "4", "--parallel", "4", "--batch-mtp")
    assert out["draft"] == shipped
    out = _probe()  # no flags: the engine's default, --spec 1 with the shipped draft
    assert out["draft"] == shipped and out["spec"] == 1
    out = _probe("--spec", "0")  # given with the default's value, still given
    assert out["draft"] is None and out["spec"] == 0


def test_engine_uses_the_shipped_draft_for_the_model_under_another_path(elsewhere):
    core, lines = load_engine(["--pack", str(elsewhere), "--device", "cpu", "--max-context", "256"])
    assert core.draft is not None and core.opts.spec == 1
    assert any("MTP on with the shipped draft" in line for line in lines)


def test_mtp_train_writes_the_targets_fingerprint(tmp_path):
    pack = synth_model(tmp_path, "qwen3")
    out = tmp_path / "drafts" / "tiny.mtp.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "strata.cli.main", "mtp", "train", "--pack", str(pack), "--out", str(out),
         "--trainer", "xp", "--steps", "2", "--prompts", "2", "--max-new", "4", "--slots", "2",
         "--batch-tokens", "64", "--held-out-per-kind", "1", "--no-measure"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    with GGUFFile(out) as draft:
        assert draft.metadata[FINGERPRINT_KEY] == target_fingerprint(_opened(pack))
    # a folder of such drafts is searched as strata/mtp/data/ is
    assert shipped_draft_for(_opened(pack), data_dir=out.parent) == out


def test_engine_flags_given_with_their_default_value_count_as_given(default_model):
    """`strata engine --spec 0` (and `strata serve` with "--spec", "0" in args) turns the default
    model's MTP off: the parser records the flag, whatever its value."""
    from strata.cli import engine
    from strata.cli.main import CommandParser

    parser = CommandParser(prog="strata engine")
    engine.add_arguments(parser)
    opts = engine.options_from_namespace(parser.parse_args(["--spec", "0", "--model-name", "m"]))
    assert opts.given_flags == ("--spec", "--alias")
    plan = plan_mtp(opts, _opened(default_model), "cpu")
    assert (plan.auto, plan.opts.spec, plan.mtp) == (False, 0, None)
