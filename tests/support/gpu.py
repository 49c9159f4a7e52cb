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
