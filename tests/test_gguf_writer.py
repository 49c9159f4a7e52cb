"""GGUF writer round trips: through our reader and through the gguf package's reader."""

import numpy as np
import pytest

from strata.gguf import GGUFFile, GGUFWriter, ValueType as V
from strata.kernels.ggml_types import type_by_name

gguf = pytest.importorskip("gguf")

SCALARS = {
    "t.u8": (200, V.UINT8),
    "t.i8": (-100, V.INT8),
    "t.u16": (60000, V.UINT16),
    "t.i16": (-30000, V.INT16),
    "t.u32": (4_000_000_000, V.UINT32),
    "t.i32": (-2_000_000_000, V.INT32),
    "t.f32": (0.25, V.FLOAT32),
    "t.bool": (True, V.BOOL),
    "t.str": ("héllo\nwörld {{ x }}", V.STRING),
    "t.u64": (2**63 + 5, V.UINT64),
    "t.i64": (-(2**62), V.INT64),
    "t.f64": (1 / 3, V.FLOAT64),
}
ARRAYS = {
    "a.str": (["", "a", "Ġthe", "<|im_end|>", "日本"], (V.ARRAY, V.STRING)),
    "a.i32": ([1, -2, 3], (V.ARRAY, V.INT32)),
    "a.u8": ([0, 255], (V.ARRAY, V.UINT8)),
    "a.bool": ([True, False, True], (V.ARRAY, V.BOOL)),
    "a.f32big": (np.linspace(-1, 1, 1000, dtype=np.float32), (V.ARRAY, V.FLOAT32)),
    "a.f64": ([0.5, 1e300], (V.ARRAY, V.FLOAT64)),
    "a.i64": ([-(2**40), 2**40], (V.ARRAY, V.INT64)),
    "a.empty": ([], (V.ARRAY, V.INT32)),
}
TENSOR_TYPES = ["F32", "F16", "Q8_0", "Q4_1", "Q4_K", "Q6_K", "IQ3_S", "IQ4_NL", "BF16"]


def _build(path, rng, type_names, alignment=32):
    w = GGUFWriter(path, alignment=alignment)
    for key, (value, vtype) in {**SCALARS, **ARRAYS}.items():
        w.add_metadata(key, value, vtype)
    w.add_metadata("t.inferred_int", 7)
    w.add_metadata("t.inferred_list", ["x", "y"])
    tensors = {}
    for i, name in enumerate(type_names):
        gtype = type_by_name(name)
        ne = (gtype.block_size * (i % 3 + 1) * (8 if gtype.block_size == 1 else 1), i + 1)
        raw = rng.integers(0, 256, gtype.nbytes(ne[0] * ne[1]), dtype=np.uint8)
        w.add_tensor(f"blk.{i}.w_{name.lower()}", gtype.id, ne, raw)
        tensors[f"blk.{i}.w_{name.lower()}"] = (gtype.id, ne, raw)
    w.add_tensor("streamed", 0, (16, 4), lambda: (np.ones(32, np.float32), np.zeros(32, np.float32)))
    tensors["streamed"] = (0, (16, 4), np.concatenate([np.ones(32, np.float32), np.zeros(32, np.float32)]).view(np.uint8))
    w.write()
    return tensors


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


@pytest.mark.parametrize("alignment", [32, 64])
def test_round_trip_ours(tmp_path, alignment):
    path = tmp_path / "rt.gguf"
    tensors = _build(path, np.random.default_rng(1), TENSOR_TYPES + ["Q2_0", "Q1_0"], alignment)
    f = GGUFFile(path)
    assert f.version == 3 and f.alignment == alignment
    for key, (value, vtype) in {**SCALARS, **ARRAYS}.items():
        got = _plain(f.metadata[key])
        want = _plain(value)
        if vtype == V.FLOAT32:
            assert got == pytest.approx(want)
        else:
            assert got == want, key
        assert f.metadata_types[key] == vtype, key
    assert f.metadata_types["t.inferred_int"] == V.INT32
    assert f.metadata["t.inferred_list"] == ["x", "y"]
    assert list(f.tensors) == list(tensors)
    for name, (type_id, ne, raw) in tensors.items():
        info = f.tensors[name]
        assert (info.ggml_type, info.shape) == (type_id, ne)
        assert (info.offset - f.data_offset) % alignment == 0
        assert np.array_equal(info.data(), raw)


@pytest.mark.parametrize("alignment", [32, 64])
def test_readable_by_gguf_package(tmp_path, alignment):
    path = tmp_path / "oracle.gguf"
    tensors = _build(path, np.random.default_rng(2), TENSOR_TYPES, alignment)  # no Q2_0: oracle lacks it
    r = gguf.GGUFReader(path)
    for key, (value, vtype) in {**SCALARS, **ARRAYS}.items():
        field = r.fields[key]
        want_types = [vtype] if not isinstance(vtype, tuple) else list(vtype)
        if key == "a.empty":
            want_types = want_types[:1]  # the package reports no element type for an empty array
        assert [V(int(t)) for t in field.types] == want_types, key
        got, want = _plain(field.contents()), _plain(value)
        assert got == (pytest.approx(want) if vtype == V.FLOAT32 or key == "a.f32big" else want), key
    assert [t.name for t in r.tensors] == list(tensors)
    for t in r.tensors:
        type_id, ne, raw = tensors[t.name]
        assert int(t.tensor_type) == type_id and tuple(int(d) for d in t.shape) == ne
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), raw)


def test_copy_metadata_preserves_types(tmp_path):
    src = tmp_path / "src.gguf"
    _build(src, np.random.default_rng(3), ["F32"])
    a = GGUFFile(src)
    w = GGUFWriter(tmp_path / "copy.gguf")
    w.add_all_metadata(a.metadata, a.metadata_types)
    w.write()
    b = GGUFFile(tmp_path / "copy.gguf")
    assert b.metadata_types == a.metadata_types
    assert {k: _plain(v) for k, v in b.metadata.items()} == {k: _plain(v) for k, v in a.metadata.items()}


def test_writer_rejects_wrong_sizes(tmp_path):
    w = GGUFWriter(tmp_path / "x.gguf")
    with pytest.raises(ValueError):
        w.add_tensor("a", type_by_name("Q8_0").id, (48, 1), b"\0" * 34)
    with pytest.raises(ValueError):
        w.add_tensor("a", type_by_name("Q8_0").id, (32, 1), b"\0" * 33)
