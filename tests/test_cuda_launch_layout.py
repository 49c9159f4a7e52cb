"""strata.kernels.cuda.launch without a GPU: the ctypes mirrors of cuda.h's launch structures
(CUlaunchConfig, CUlaunchAttribute) have the driver's sizes and offsets, and kernel arguments
convert to the C types the kernels declare (a wrong size would shift every later argument)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from strata.kernels.cuda import launch


def test_structures_match_cuda_h():
    # cuda.h (CUDA 12 / 13): CUlaunchAttribute = {int id; char pad[4]; 64-byte union}, the
    # union pointer-aligned; CUlaunchConfig = 7 unsigned, CUstream, CUlaunchAttribute*, unsigned
    assert ctypes.sizeof(launch._Attr) == 72
    assert launch._Attr.value.offset == 8
    assert ctypes.alignment(launch._AttrValue) == ctypes.alignment(ctypes.c_void_p)
    assert launch._Config.shared_bytes.offset == 24
    assert launch._Config.stream.offset == 32
    assert launch._Config.attrs.offset == 40
    assert launch._Config.n_attrs.offset == 48
    assert ctypes.sizeof(launch._Config) == 56


@pytest.mark.parametrize("value, ctype, size", [
    (np.int32(-7), ctypes.c_int32, 4), (np.int64(1 << 40), ctypes.c_int64, 8), (np.uint64(0), ctypes.c_uint64, 8),
    (np.float32(0.5), ctypes.c_float, 4), (np.float64(1e300), ctypes.c_double, 8)])
def test_scalar_arguments_keep_their_width(value, ctype, size):
    c = launch._c_arg(value)
    assert isinstance(c, ctype) and ctypes.sizeof(c) == size and c.value == value


def test_arrays_pass_their_device_pointer_and_none_is_null():
    class FakeDeviceArray:  # what _c_arg reads of a cupy array: data.ptr
        class data:
            ptr = 0x7F00_1234_5670

    assert launch._c_arg(FakeDeviceArray()).value == 0x7F00_1234_5670
    assert launch._c_arg(None).value is None  # a NULL void*


def test_python_numbers_are_refused():
    # a Python int has no declared width (int or long long?): the caller must say
    for bad in (3, 2.5, True):
        with pytest.raises(TypeError, match="give numpy scalars"):
            launch._c_arg(bad)


def test_switch_off(monkeypatch):
    monkeypatch.setenv(launch.PDL_ENV, "0")
    assert not launch.enabled()
