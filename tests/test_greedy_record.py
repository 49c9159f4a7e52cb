"""The greedy tokens of every architecture, in every decoding mode, equal their record.

tests/data/greedy_record_cpu.json (and greedy_record_cuda.json, written on a GPU machine) hold,
per case of tests/support/greedy_record.py, the tokens that the code produced when the record was
written (bench/record_greedy.py). Here the same packs and prompts run again through the engine
API and every mode must give the recorded tokens, and the plain run's tokens (batching and
speculation are lossless), over each prompt's steps before the first near-tie of the recorded
plain run: a margin between the two best logits under the arithmetic's noise
(greedy_record.margin_threshold) may flip on another BLAS kernel or thread count, and the
sequence after it may then diverge legitimately.

Rewrite the record (bench/record_greedy.py) only for a change meant to change the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata.pack.presets import SUPPORTED_ARCHS
from tests.support import greedy_record as gr
from tests.support.engines import shared_seed_moe, shared_tiny

DATA = Path(__file__).resolve().parent / "data"
MIN_COMPARED = 0.75  # of the recorded steps, over all cases: the comparison cannot become vacuous
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _record(device: str) -> dict:
    path = DATA / f"greedy_record_{device}.json"
    if device == "cuda":
        from tests.support.gpu import require_cuda, require_synth_tokenizer

        require_cuda()
        require_synth_tokenizer()
        if not path.is_file():
            pytest.skip(f"{path} is absent: write it on a GPU machine with "
                        f"python3 bench/record_greedy.py --device cuda --out {path.relative_to(DATA.parents[1])}")
    data = json.loads(path.read_text())
    assert data["format"] == gr.FORMAT and data["max_tokens"] == gr.MAX_TOKENS and data["spec"] == gr.SPEC
    return data


def _pack_dir(case: gr.Case, tmp_path_factory) -> Path | None:
    if case.pack == "model":
        from tests.support.model_fixtures import default_model_or_skip

        default_model_or_skip()
        return None
    if case.pack == "seed-moe":
        return shared_seed_moe(tmp_path_factory, vocab=gr.VOCAB)
    return shared_tiny(tmp_path_factory, case.pack.split(":", 1)[1], vocab=gr.VOCAB)


def _threshold(rec: dict) -> float:
    return gr.margin_threshold(rec["n_layer"], rec["n_embd"], rec["logit_absmax"])


@pytest.mark.parametrize("device", DEVICES)
def test_the_record_covers_every_architecture_and_most_steps(device):
    data = _record(device)
    assert set(SUPPORTED_ARCHS) <= {gr.case_arch(c) for c in gr.CASES}, "an architecture without a record case"
    # every case is recorded (on a GPU machine without the test model, every synthetic one)
    needed = {c.name for c in gr.CASES if device in c.devices and (device == "cpu" or c.pack != "model")}
    assert needed <= set(data["cases"]) <= {c.name for c in gr.CASES}, "the record's cases are not the runner's"
    compared = recorded = 0
    for case in gr.CASES:
        rec = data["cases"].get(case.name)
        if rec is None:
            continue
        assert set(rec["tokens"]) == set(gr.mode_names(case)), f"{case.name}: the record lacks modes"
        for margins, tokens in zip(rec["margins"], rec["tokens"]["plain"]):
            assert len(margins) == len(tokens)
            compared += gr.trusted_steps(margins, _threshold(rec))
            recorded += len(tokens)
    assert compared >= MIN_COMPARED * recorded, f"only {compared} of {recorded} recorded steps are compared"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", gr.CASES, ids=[c.name for c in gr.CASES])
def test_greedy_tokens_equal_the_record(device, case, tmp_path_factory):
    cases = _record(device)["cases"]
    if device not in case.devices:
        pytest.skip(f"{case.name} has no {device} record: {case.pack} does not run there yet")
    if case.name not in cases:
        pytest.skip(f"{case.name} is not in the {device} record (written without the test model)")
    rec = cases[case.name]
    pack_dir = _pack_dir(case, tmp_path_factory)
    # the same bytes as when recorded: synthetic packs are deterministic (fixed seeds), and a
    # change to a preset or to the writer would otherwise show up as a token mismatch
    assert gr.pack_digest(pack_dir) == rec["pack_sha256"], f"{case.name}: the pack is not the recorded one"
    now = gr.run_case(case, rec["prompts"], pack_dir, device, modes=list(rec["tokens"]))
    result = gr.compare(rec, now, _threshold(rec))
    assert not result.mismatches, f"{case.name}: " + "; ".join(result.mismatches)
    assert result.compared > 0


def test_a_changed_token_is_reported_within_the_trusted_steps():
    """The comparison itself: a token changed before the first near-tie fails it, one after does not."""
    rec = _record("cpu")["cases"]["tiny-llama"]
    margins = [[1.0] * 8 + [0.0] + [1.0] * 7, [1.0] * 16]
    rec = {**rec, "margins": margins}
    now = json.loads(json.dumps(rec))
    now["tokens"]["parallel2"][0][9] += 1  # after prompt 0's near-tie (step 8): not compared
    result = gr.compare(rec, now, threshold=0.5)
    assert result.mismatches == [] and result.compared == 8 + 16
    now["tokens"]["parallel2"][1][15] += 1  # prompt 1 has no near-tie: compared to its end
    result = gr.compare(rec, now, threshold=0.5)
    assert len(result.mismatches) == 2  # against the record and against plain
