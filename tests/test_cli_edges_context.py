"""--max-context past what the model was trained for is said once (a warning, as llama.cpp's
"n_ctx_seq > n_ctx_train"); one the memory cannot hold even for one slot is refused in one line
naming the flag, with how many tokens fit."""

from __future__ import annotations

import pytest

from strata.engine.context_room import check_one_slot_fits, past_training_warning
from strata.errors import OutOfMemory, StrataError
from tests.support.engines import load_engine
from tests.support.model_fixtures import default_model_or_skip

BASE = ["--device", "cpu", "--spec", "0", "--threads", "1"]
WARNING = "strata: warning: --max-context"


def test_the_warning_names_the_key_and_only_when_past_it():
    md = {"llama.context_length": 4096}
    line = past_training_warning(262144, 4096, "llama", md)
    assert line == ("strata: warning: --max-context 262144 is past the 4096 positions the model was trained for "
                    "(llama.context_length): past them its output may degrade")
    assert past_training_warning(4096, 4096, "llama", md) is None
    assert past_training_warning(None, 4096, "llama", md) is None
    assert past_training_warning(262144, 4096, "llama", {}) is None  # not said by the pack: an assumed 4096


def test_one_slot_that_cannot_fit_is_refused_with_what_fits():
    with pytest.raises(OutOfMemory, match=r"^--max-context 1000: one slot's KV cache at full context would take "
                                          r".* about 500 tokens fit \(a smaller --max-context, or --kv int8\)$"):
        check_one_slot_fits(1000, 1000, 100, 50_000, "cpu", "f16")
    check_one_slot_fits(1000, 1000, 100, 100_000, "cpu", "f16")  # exactly fits
    check_one_slot_fits(None, 10**9, 100, 1, "cpu", "f16")  # the model's default: the sizing note says it
    check_one_slot_fits(1000, 1000, 100, None, "cpu", "f16")  # free memory unknown: not refused


@pytest.fixture(scope="module")
def model():
    return default_model_or_skip()


def test_the_engine_warns_once_past_the_training_context(model):
    core, lines = load_engine([*BASE, "--max-context", "16384"])  # SmolLM2: llama.context_length 8192
    said = [ln for ln in lines if ln.startswith(WARNING)]
    assert said == ["strata: warning: --max-context 16384 is past the 8192 positions the model was trained for "
                    "(llama.context_length): past them its output may degrade"]
    assert core.n_ctx == 16384


def test_the_engine_refuses_a_context_no_memory_holds(model):
    # 2**30 positions of even an int8 cache of 30 layers is terabytes: more than any machine has free
    with pytest.raises(StrataError, match=r"^--max-context 1073741824: one slot's KV cache at full context would "
                                          r"take [\d.]+ GiB on cpu \(--kv int8\), [\d.]+ GiB is free: about \d+ tokens "
                                          r"fit \(a smaller --max-context\)$"):
        load_engine([*BASE, "--max-context", str(1 << 30), "--kv", "int8"])
