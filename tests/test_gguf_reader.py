"""Our GGUF reader against the gguf package (test oracle) on the real test model."""

import os
import time

import numpy as np
import pytest

from strata.gguf import GGUFFile, ValueType
from strata.kernels.ggml_types import BY_ID

gguf = pytest.importorskip("gguf")

MIX_Q2_0 = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "SmolLM2-135M-Instruct.mix-Q2_0.gguf")


@pytest.fixture(scope="module")
def model_path():
    from tests.support.model_fixtures import default_model_or_skip

    return str(default_model_or_skip())


@pytest.fixture(scope="module")
def ours(model_path):
    return GGUFFile(model_path)


class _NumpyWithPlainMap:
    """numpy for gguf's reader module, but np.memmap gives a plain ndarray over the same map:
    the reader cuts ~250k small arrays from it (each tokenizer string is three), and numpy.memmap's
    per-slice __array_finalize__ and __getitem__ were most of its 3-7 s parse of the test model.
    The parse is the package's own; the arrays hold the same bytes."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def memmap(*args, **kwargs):
        return np.memmap(*args, **kwargs).view(np.ndarray)


@pytest.fixture(scope="module")
def oracle(model_path):
    import gguf.gguf_reader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.gguf_reader, "np", _NumpyWithPlainMap())
        return gguf.GGUFReader(model_path)


def test_tensors_match_oracle(ours, oracle):
    assert list(ours.tensors) == [t.name for t in oracle.tensors]
    for t in oracle.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type)
        assert mine.shape == tuple(int(d) for d in t.shape)
        assert mine.offset == t.data_offset
        assert mine.nbytes == t.n_bytes
        assert mine.type is BY_ID[int(t.tensor_type)]


def test_tensor_data_matches_oracle(ours, oracle):
    for t in oracle.tensors[:12] + oracle.tensors[-3:]:
        data = ours.tensors[t.name].data()
        assert data.dtype == np.uint8 and data.size == t.n_bytes
        assert np.array_equal(data, np.asarray(t.data).view(np.uint8).reshape(-1))


def test_metadata_matches_oracle(ours, oracle):
    keys = [k for k in oracle.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        field = oracle.fields[key]
        expected = field.contents()
        got = ours.metadata[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == expected, key
        types = [ValueType(int(x)) for x in field.types]
        want_type = types[0] if len(types) == 1 else tuple(types)
        assert ours.metadata_types[key] == want_type, key
    assert ours.version == 3
    assert ours.alignment == 32


def test_tokenizer_arrays(ours):
    tokens = ours.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 49152 and all(isinstance(t, str) for t in tokens[:100])
    assert tokens[1] == "<|im_start|>"
    types = ours.metadata["tokenizer.ggml.token_type"]
    assert isinstance(types, np.ndarray) and types.dtype == np.int32 and types.shape == (49152,)


def test_open_is_fast(model_path):
    # Regression guard, not a benchmark (see bench/gguf_open.py): the gguf package's reader,
    # which reads every field eagerly, takes 80-100 times as long as a pure-Python loop of 10**6
    # additions; ours 2-4 times (both measured on the 2-core machine, its cores busy). Both are
    # timed here, the best of 3 each (a run the OS preempted says nothing), so that a busy
    # machine slows both alike.
    ours = min(_timed(lambda: GGUFFile(model_path).close()) for _ in range(3))
    loop = min(_timed(lambda: sum(range(10**6))) for _ in range(3))
    assert ours < 30 * loop, f"opening the test model took {ours:.3f} s, {ours / loop:.0f} times the loop's {loop:.3f} s"


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.skipif(not os.path.exists(MIX_Q2_0), reason="shared test model absent")
def test_reads_q2_0_model():
    # The gguf package cannot read this file (type 42); check internal consistency instead.
    f = GGUFFile(MIX_Q2_0)
    names = {BY_ID[t.ggml_type].name for t in f.tensors.values()}
    assert {"Q2_0", "IQ4_NL", "Q4_0", "F32"} <= names
    spans = sorted((t.offset, t.offset + t.nbytes) for t in f.tensors.values())
    assert spans[0][0] == f.data_offset
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= f.file_size
    down = f.tensors["blk.0.ffn_down.weight"]
    assert down.type.name == "Q2_0" and down.shape == (1536, 576)
    assert down.nbytes == 576 * (1536 // 64) * 18
