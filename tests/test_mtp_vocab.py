"""A draft's vocabulary (`mtp.vocab`): how it is chosen and stored, that a bad one is one clear
line, and that drafting over it on the CPU (a narrowed head) stays lossless.

The engine parts run the real test model with the shipped draft, copied with a vocabulary.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from strata.errors import StrataError
from strata.gguf.reader import GGUFFile
from strata.mtp.defaults import default_draft_path
from strata.mtp.draft import VOCAB_TENSOR
from strata.mtp.train.collect import Sequence
from strata.mtp.train.measure import chat_ids, load_core, run_prompts
from strata.mtp.train.prompts import HELD_OUT
from strata.mtp.train.vocab import answer_token_counts, choose_vocab, coverage, with_vocab

TEXTS = [HELD_OUT["chat"][1], HELD_OUT["code"][1], HELD_OUT["prose"][0]]


def test_counts_take_the_written_tokens_only():
    # 3 prompt tokens (rows 0-1 fed, no logits) then 3 written: rows 2-4 had logits
    top = np.full((5, 2), -1, np.int32)
    top[2:, 0] = 1
    seq = Sequence(np.asarray([7, 7, 7, 4, 5, 4], np.int32), np.zeros((5, 2), np.float16), top,
                   np.zeros((5, 2), np.float32))
    counts = answer_token_counts([seq, seq], 10)
    assert counts.tolist() == [0, 0, 0, 0, 4, 2, 0, 0, 0, 0]


def test_choice_is_most_written_then_lowest_id_plus_the_end():
    counts = np.asarray([0, 5, 0, 9, 5, 0, 0, 1])
    assert choose_vocab(counts, 3).tolist() == [1, 3, 4]  # 9, then the two 5s
    assert choose_vocab(counts, 5).tolist() == [0, 1, 3, 4, 7]  # then 1, then the lowest unseen id
    assert choose_vocab(counts, 2, always=[6]).tolist() == [1, 3, 6]
    assert coverage(counts, np.asarray([3, 4])) == pytest.approx(14 / 20)


@pytest.fixture(scope="module")
def vocab_draft(tmp_path_factory):
    """The shipped draft with another vocabulary: the 8192 lowest ids (the end of a turn, 2, among them)."""
    d = tmp_path_factory.mktemp("vocab")
    return with_vocab(default_draft_path(), np.arange(8192), d / "draft.gguf")


def test_the_copy_keeps_every_tensor_and_adds_the_vocabulary(vocab_draft):
    src, out = GGUFFile(default_draft_path()), GGUFFile(vocab_draft)
    try:
        assert set(out.tensors) == set(src.tensors) | {VOCAB_TENSOR}
        for name, t in src.tensors.items():
            if name != VOCAB_TENSOR:  # the shipped draft's own vocabulary is replaced
                assert np.array_equal(np.asarray(out.tensors[name].data()), np.asarray(t.data()))
        assert out.metadata == src.metadata
        ids = np.frombuffer(np.asarray(out.tensors[VOCAB_TENSOR].data()).tobytes(), "<i4")
        assert ids.tolist() == list(range(8192))
    finally:
        src.close()
        out.close()


@pytest.mark.parametrize("ids, why", [
    (np.asarray([5, 3]), "ascending"),
    (np.asarray([3, 3]), "distinct"),
    (np.asarray([1, 49152]), "below the target's vocabulary of 49152"),
])
def test_a_bad_vocabulary_is_one_clear_line(tmp_path, ids, why):
    """Each bad vocabulary is refused by the draft's loader (the DraftModel the engine builds,
    here on the shared test model's weights) with one line naming the file and what is wrong."""
    from strata.mtp.draft import DraftModel, find_draft
    from tests.support.model_fixtures import engine

    core = engine(None, 4)
    bad = with_vocab(default_draft_path(), ids, tmp_path / "bad.gguf")
    with pytest.raises(StrataError) as e:
        DraftModel(core.backend, core.cfg, find_draft(str(bad), core.pack), core.model)
    assert f"{bad}: {VOCAB_TENSOR}: expected" in str(e.value) and why in str(e.value)
    assert "\n" not in str(e.value)


def test_the_engine_refuses_a_bad_vocabulary_at_start_up(tmp_path):
    """The engine's start-up says the loader's line (one case: every bad vocabulary above is
    refused at the same call)."""
    bad = with_vocab(default_draft_path(), np.asarray([1, 49152]), tmp_path / "bad.gguf")
    with pytest.raises(StrataError) as e:
        load_core(None, str(bad), 1)
    assert f"{bad}: {VOCAB_TENSOR}: expected" in str(e.value)
    assert "below the target's vocabulary of 49152" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # 13 s on 2 cores; the shipped narrowed draft is checked lossless in test_mtp_defaults
def test_narrowed_head_drafts_only_its_tokens_and_is_lossless(vocab_draft):
    plain = load_core(None, None, 0)
    prompts = [chat_ids(plain, t) for t in TEXTS]
    want = run_prompts(plain, prompts, 32).outputs
    core = load_core(None, str(vocab_draft), 3)
    d = core.draft
    assert d.head_subset is not None and d.head_subset.wt.shape == (576, 8192)
    # the narrowed head gives the full head's logits on its tokens and -inf elsewhere
    g = np.random.default_rng(0).standard_normal((2, 576)).astype(np.float32)
    full, narrow = d.target.logits(g), d.head(g)
    assert np.all(np.isneginf(narrow[:, 8192:]))
    np.testing.assert_allclose(narrow[:, :8192], full[:, :8192], rtol=1e-5, atol=1e-4)
    acc = run_prompts(core, prompts, 32)
    assert acc.outputs == want  # greedy with the narrowed draft equals plain decoding
    assert acc.accepted > 0
    # sampling keeps the target's law with a narrowed head: the shipped draft's own test
    # (test_mtp_train_shipped.test_sampling_with_shipped_draft_keeps_target_distribution) runs
    # the CPU's narrowed head, the shipped draft having a vocabulary


def _start(args: list[str]) -> subprocess.Popen:
    """A child `strata mtp ...` with one BLAS thread: this tiny model's matrices gain nothing from
    more, and children running side by side (or beside other work) do not fight over the cores."""
    import os

    env = dict(os.environ, STRATA_CPU_THREADS="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "strata.cli.main", "mtp", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _done(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_cli_writes_a_vocabulary_and_refuses_a_bad_draft(tmp_path):
    from strata.pack.presets import TINY
    from strata.pack.synth import synth_pack

    synth_pack(TINY["qwen3"], tmp_path, progress=lambda *a: None)
    pack = tmp_path / "model.gguf"
    draft = tmp_path / "draft.gguf"
    out = tmp_path / "v.gguf"
    # (the commands that do not need each other's files run side by side)
    missing = _start(["vocab", "--draft", str(tmp_path / "nope.gguf"), "--out", str(out)])
    train = _done(_start(["train", "--pack", str(pack), "--out", str(draft), "--steps", "2", "--prompts", "4",
                          "--max-new", "8", "--slots", "4", "--batch-tokens", "256", "--held-out-per-kind", "1",
                          "--no-measure", "--trainer", "xp", "--draft-vocab", "64"]))
    assert train.returncode == 0, train.stderr + train.stdout
    assert "strata mtp train: draft vocabulary: " in train.stdout
    f = GGUFFile(draft)
    assert 64 <= f.tensors[VOCAB_TENSOR].shape[0] <= 66  # 64 + the end-of-generation ids
    assert "training text" in f.metadata["strata-mtp.vocabulary"]
    f.close()
    # continuing from a draft with a vocabulary: the vocabulary is no weight to train
    again = tmp_path / "again.gguf"
    cont = _start(["train", "--pack", str(pack), "--out", str(again), "--steps", "1", "--prompts", "4",
                   "--max-new", "8", "--slots", "4", "--batch-tokens", "256", "--held-out-per-kind", "1",
                   "--no-measure", "--trainer", "xp", "--init", str(draft)])
    # --slots 10: the 10 tries at 2 self-written requests (this random target never ends one) in one batch
    vocab = _start(["vocab", "--draft", str(draft), "--out", str(out), "--pack", str(pack), "--size", "32",
                    "--prompts", "4", "--self-prompts", "2", "--max-new", "8", "--slots", "10"])
    cont, proc, missing = _done(cont), _done(vocab), _done(missing, 120)
    assert cont.returncode == 0, cont.stderr + cont.stdout
    f = GGUFFile(again)
    assert VOCAB_TENSOR not in f.tensors and not any("vocab" in n for n in f.tensors)
    f.close()
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert f"strata mtp vocab: wrote {out}: " in proc.stdout
    f = GGUFFile(out)
    assert 32 <= f.tensors[VOCAB_TENSOR].shape[0] <= 34
    assert f.metadata["strata-mtp.vocabulary"].startswith("the ") and "answers" in f.metadata["strata-mtp.vocabulary"]
    f.close()
    assert missing.returncode == 2 and missing.stderr.strip() == f"strata: {tmp_path / 'nope.gguf'}: no such file"
