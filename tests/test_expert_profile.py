"""The `--expert-profile` file (strata/experts/profile.py): written and read back, refused in one
line when it is not one or belongs to another model, recorded by `strata experts profile`, and
seeding the pool so the first windows hit."""

from __future__ import annotations

import re

import json

import numpy as np
import pytest

from strata.cli.main import main as strata_main
from strata.errors import StrataError
from strata.experts.profile import read_profile, write_profile
from strata.protocol import GenerationRequest, SamplingParams
from tests.support import greedy_record as gr
from tests.support.engines import load_engine, shared_tiny


def test_a_profile_reads_back_as_written(tmp_path):
    path = tmp_path / "p.json"
    write_profile(path, 40, {"blk.0.": np.array([3, 0, 5]), "blk.1.": np.array([1, 1, 1])})
    p = read_profile(path)
    assert p.tokens == 40 and list(p.layers) == ["blk.0.", "blk.1."]
    assert np.array_equal(p.layers["blk.0."], [3, 0, 5])
    assert np.allclose(p.rates("blk.0."), [3 / 40, 0, 5 / 40]) and p.rates("blk.9.") is None
    p.check_model(path, {"blk.0.": 3, "blk.1.": 3, "blk.2.": 3})  # a model may have layers the profile lacks


@pytest.mark.parametrize("body,match", [
    ("not json", "not JSON"),
    ('{"layers": {}}', "not an expert profile"),
    ('{"format": "strata-expert-profile", "version": 9, "tokens": 1, "layers": {"a": [1]}}', "version 9"),
    ('{"format": "strata-expert-profile", "version": 1, "tokens": -1, "layers": {"a": [1]}}', "tokens"),
    ('{"format": "strata-expert-profile", "version": 1, "tokens": 3, "layers": {}}', "layers"),
    ('{"format": "strata-expert-profile", "version": 1, "tokens": 3, "layers": {"blk.0.": [1, -2]}}',
     r"layers\['blk.0.'\]"),
    ('{"format": "strata-expert-profile", "version": 1, "tokens": 3, "layers": {"blk.0.": [1.5]}}', "whole numbers"),
])
def test_a_bad_profile_is_one_line_naming_the_file(tmp_path, body, match):
    path = tmp_path / "bad.json"
    path.write_text(body)
    with pytest.raises(StrataError, match=match) as e:
        read_profile(path)
    assert str(path) in e.value.message and "\n" not in e.value.message


def test_a_missing_profile_and_another_models_profile_are_refused(tmp_path):
    with pytest.raises(StrataError, match="cannot read the expert profile"):
        read_profile(tmp_path / "absent.json")
    path = tmp_path / "other.json"
    write_profile(path, 4, {"blk.0.": np.array([1, 2])})
    p = read_profile(path)
    with pytest.raises(StrataError, match="has 2 expert counts.*8 experts"):
        p.check_model(path, {"blk.0.": 8})
    with pytest.raises(StrataError, match="'blk.0.' .* not an expert layer"):
        p.check_model(path, {"blk.5.": 2})


@pytest.fixture(scope="module")
def qwen35moe(tmp_path_factory):
    return shared_tiny(tmp_path_factory, "qwen35moe", vocab=gr.VOCAB)


def _first_window_hits(pack, extra) -> tuple[dict, list[str]]:
    core, lines = load_engine(["--pack", str(pack), "--device", "cpu", "--prefix-cache", "0", *extra])
    try:
        # one token: the prompt's window alone (the pool starts empty, or with the profile's hottest)
        h = core.submit(GenerationRequest(list(gr.SYNTH_PROMPTS[0]), SamplingParams(max_tokens=1, temperature=0.0)))
        core.scheduler.run_until_idle()
        h.collect(timeout=60)
        return core.expert_cache(), lines
    finally:
        core.stop()


def test_strata_experts_profile_records_and_seeds_the_pool(qwen35moe, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n\nWrite a haiku about rain.\nList three colors.\n")
    out = tmp_path / "profile.json"
    rc = strata_main(["experts", "profile", "--pack", str(qwen35moe), "--device", "cpu", "--prompts", str(prompts),
                      "--out", str(out), "--max-tokens", "6"])
    assert rc == 0 and "3 prompts" in capsys.readouterr().out
    prof = read_profile(out)
    assert sorted(prof.layers) == [f"blk.{i}." for i in range(4)]  # the main stack (the nextn layer is the draft's)
    assert prof.tokens > 0 and all(int(c.sum()) == 2 * prof.tokens for c in prof.layers.values())  # 2 routed per token
    cold, _ = _first_window_hits(qwen35moe, ["--expert-cache", "50%"])
    warm, lines = _first_window_hits(qwen35moe, ["--expert-cache", "50%", "--expert-profile", str(out)])
    assert cold["windows"] == warm["windows"] == 1 and cold["hits"] == 0
    assert warm["hits"] > 0 and warm["uploads"] < cold["uploads"]
    assert any("strata: experts: 16 slots of 32" in ln for ln in lines)


def _warnings(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith("strata: warning:") and "--expert-profile" in ln]


def test_profile_flags_at_load(qwen35moe, tmp_path):
    """A profile only steers where a pool starts: another model's, or a missing file, is one
    warning line and the pool starts empty; it is read (and so warned about) whether or not a
    pool is built, so a config behaves alike on machines with more or less memory."""
    other = tmp_path / "other.json"
    write_profile(other, 4, {"blk.0.": np.array([1, 2, 3])})
    absent = tmp_path / "absent.json"
    for profile, says in ((other, r"other.json: layer 'blk.0.' has 3 expert counts"),
                          (absent, "absent.json: cannot read the expert profile")):
        for cache in (["--expert-cache", "25%"], []):  # a pool, and every expert resident
            core, lines = load_engine(["--pack", str(qwen35moe), "--device", "cpu", *cache,
                                       "--expert-profile", str(profile)])
            try:
                stats = core.expert_cache()
            finally:
                core.stop()
            (warning,) = _warnings(lines)
            assert re.search(says, warning) and warning.endswith("; --expert-profile is not used"), warning
            assert (stats is not None) == bool(cache)
            if stats is not None:
                assert stats["lookups"] == 0  # nothing preloaded: the pool starts empty
    good = tmp_path / "good.json"
    core, lines = load_engine(["--pack", str(qwen35moe), "--device", "cpu"])
    try:
        assert not core.write_expert_profile(str(good)) and not good.exists()  # nothing routed yet: no file
        h = core.submit(GenerationRequest(list(gr.SYNTH_PROMPTS[1]), gr._params(False)))
        core.scheduler.run_until_idle()
        h.collect(timeout=60)
        assert core.write_expert_profile(str(good))
    finally:
        core.stop()
    core, lines = load_engine(["--pack", str(qwen35moe), "--device", "cpu", "--expert-profile", str(good)])
    core.stop()
    assert not _warnings(lines)
    assert any("every expert is resident" in ln and "steers nothing" in ln for ln in lines)


def test_the_engine_writes_the_counts_it_saw(qwen35moe, tmp_path):
    core, _ = load_engine(["--pack", str(qwen35moe), "--device", "cpu", "--expert-cache", "25%"])
    try:
        h = core.submit(GenerationRequest(list(gr.SYNTH_PROMPTS[1]), gr._params(False)))
        core.scheduler.run_until_idle()
        h.collect(timeout=60)
        path = tmp_path / "seen.json"
        assert core.write_expert_profile(str(path))
        body = json.loads(path.read_text())
        assert body["tokens"] == len(gr.SYNTH_PROMPTS[1]) + gr.MAX_TOKENS - 1  # the last token is never run
        assert len(body["layers"]) == 4
    finally:
        core.stop()


def test_the_profile_command_refuses_a_bad_prompts_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    assert strata_main(["experts", "profile", "--prompts", str(empty), "--out", str(tmp_path / "p.json")]) == 2
    assert strata_main(["experts", "profile", "--prompts", str(tmp_path / "none.txt"), "--out", str(tmp_path / "p.json")]) == 2


def test_an_engine_given_expert_profile_out_writes_its_counts_at_exit(qwen35moe, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "seen.json"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--pack", str(qwen35moe), "--device", "cpu",
                        "--prompt", "hi", "--max-tokens", "3", "--expert-profile-out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    prof = read_profile(out)
    assert sorted(prof.layers) == [f"blk.{i}." for i in range(4)] and prof.tokens > 0
