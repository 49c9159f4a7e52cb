"""The metadata key table (strata/pack/metadata_rules.py) and the load-time tensor checks, one
test per finding of the GGUF fuzzing: each bad pack is refused while the engine loads it, with
one line naming the pack and the key (or tensor), never with a traceback and never later, in the
first window. Packs are tiny synthetic ones of each architecture, rewritten with our writer."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata.errors import StrataError
from strata.gguf.constants import ALIGNMENT_KEY, ValueType as V
from strata.pack.loader import open_pack
from strata.pack.metadata_rules import KEYS, checked_values
from tests.fuzz.layout import scan
from tests.fuzz.mutate import Seed, rewrite, write_seed_packs

U32 = V.UINT32


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, Seed]:
    paths = write_seed_packs(tmp_path_factory.mktemp("packs"))
    return {arch: Seed.open(arch, path) for arch, path in paths.items()}


@pytest.fixture
def bad(seeds, tmp_path):
    """bad(arch, {key: (type, value)}) -> the path of the seed pack with that metadata."""
    def make(arch: str, changes: dict, tensors=None) -> Path:
        path = tmp_path / f"{arch}-bad.gguf"
        path.write_bytes(rewrite(seeds[arch], changes, tensors))
        return path
    return make


def load(path: Path):
    """The engine's own load on the CPU and one generated token; the finish event."""
    from strata.engine.core import EngineCore
    from strata.engine.options import EngineOptions
    from strata.protocol import FinishEvent, GenerationRequest, SamplingParams

    core = EngineCore.load(EngineOptions(pack=str(path), device="cpu"), log=lambda line: None)
    handle = core.submit(GenerationRequest(core.tokenizer.encode("hi"), SamplingParams(max_tokens=1)))
    core.scheduler.run_until_idle()
    while not isinstance(ev := handle.events.get(timeout=60), FinishEvent):
        pass
    core.pack.close()
    return ev


def refusal(path: Path) -> str:
    with pytest.raises(StrataError) as err:
        load(path)
    message = err.value.message
    assert "\n" not in message and str(path) in message, message
    return message


def key_error(path: Path, key: str, what: str) -> None:
    assert refusal(path) == f"pack {path}: metadata key {key}: {what}"


def test_seed_packs_load(seeds):
    for seed in seeds.values():
        assert load(seed.path).reason in ("length", "stop")  # a random model may stop at once


# ------------------------------------------------------------------ bad metadata that once gave tracebacks, one each
def test_alignment_as_an_array(bad):
    path = bad("llama", {ALIGNMENT_KEY: ((V.ARRAY, U32), [32, 32])})
    assert refusal(path) == f"{path}: metadata key general.alignment: must be an integer, found an array of UINT32 ([32, 32])"


def test_alignment_nan(bad):
    path = bad("qwen3", {ALIGNMENT_KEY: (V.FLOAT32, math.nan)})
    assert refusal(path) == f"{path}: metadata key general.alignment: must be an integer, found FLOAT32 (nan)"


@pytest.mark.parametrize("value", [0, 48, 1 << 20])
def test_alignment_not_a_bounded_power_of_two(bad, value):
    path = bad("qwen2", {ALIGNMENT_KEY: (U32, value)})
    assert refusal(path) == f"{path}: metadata key general.alignment: must be a power of two from 8 to 65536, found {value}"


def test_head_count_zero(bad):
    key_error(bad("qwen3", {"qwen3.attention.head_count": (U32, 0)}), "qwen3.attention.head_count",
              "must be >= 1, found 0")


def test_block_count_a_string(bad):
    key_error(bad("llama", {"llama.block_count": (V.STRING, "1")}), "llama.block_count",
              "must be an integer, found STRING (1)")


def test_context_length_nan(bad):
    key_error(bad("qwen2", {"qwen2.context_length": (V.FLOAT32, math.nan)}), "qwen2.context_length",
              "must be an integer, found FLOAT32 (nan)")


def test_token_not_utf8(bad, seeds):
    tokens = list(seeds["llama"].metadata["tokenizer.ggml.tokens"])
    tokens[300] = "ab\udcff\udcfe"  # the writer puts back the raw bytes ab FF FE
    key_error(bad("llama", {"tokenizer.ggml.tokens": ((V.ARRAY, V.STRING), tokens)}), "tokenizer.ggml.tokens",
              "token 300 is not valid UTF-8 (b'ab\\xff\\xfe')")


def test_rope_dimension_count_above_head_dim_refused_at_load(bad):
    """Loaded before, then failed in the first window (a broadcast error inside RoPE)."""
    key_error(bad("qwen3", {"qwen3.rope.dimension_count": (U32, 32)}), "qwen3.rope.dimension_count",
              "must be even and <= the head size attention.key_length (16), found 32")


def test_rope_dimension_count_odd(bad):
    key_error(bad("llama", {"llama.rope.dimension_count": (U32, 15)}), "llama.rope.dimension_count",
              "must be even and <= the head size attention.key_length (16), found 15")


def test_expert_used_count_zero_refused_at_load(bad):
    """Loaded before, then failed in the first window (routing to no expert)."""
    key_error(bad("qwen3moe", {"qwen3moe.expert_used_count": (U32, 0)}), "qwen3moe.expert_used_count",
              "must be >= 1, found 0")


def test_block_count_minus_one(bad):
    """Accepted silently before (a model of -1 layers, no block run at all)."""
    key_error(bad("qwen2", {"qwen2.block_count": (V.INT32, -1)}), "qwen2.block_count", "must be >= 1, found -1")


def test_expert_used_count_above_expert_count(bad):
    """Accepted silently before."""
    key_error(bad("qwen3moe", {"qwen3moe.expert_used_count": (U32, 5)}), "qwen3moe.expert_used_count",
              "must be in [1, expert_count (4)], found 5")


def _grow_f32(seed: Seed, name: str, elements: int) -> bytes:
    """The seed with one F32 tensor's ne0 raised in its info record, its data left as it was."""
    t = next(t for t in scan(seed.data).tensors if t.name == name)
    out = bytearray(seed.data)
    struct.pack_into("<Q", out, t.dims_at[0], t.dims[0] + elements)
    return bytes(out)


def test_f32_tensor_over_the_next_tensors_data(seeds, tmp_path):
    """Accepted silently before: a grown F32 norm read its neighbour's bytes as its own."""
    path = tmp_path / "grown.gguf"
    path.write_bytes(_grow_f32(seeds["llama"], "blk.0.attn_norm.weight", 64))
    message = refusal(path)
    assert "blk.0.attn_norm.weight" in message and "overlaps" in message


def test_f32_tensor_past_the_end_of_the_file(seeds, tmp_path):
    path = tmp_path / "past-end.gguf"
    path.write_bytes(_grow_f32(seeds["qwen3"], "output_norm.weight", 1 << 20))
    message = refusal(path)
    assert "output_norm.weight" in message and "truncated file" in message


def test_tensor_dimension_zero(seeds, tmp_path):
    """A zero dimension made a zero-byte tensor that no check looked at (a bias of length 0)."""
    t = next(t for t in scan(seeds["qwen2"].data).tensors if t.name == "blk.0.attn_q.bias")
    out = bytearray(seeds["qwen2"].data)
    struct.pack_into("<Q", out, t.dims_at[0], 0)
    path = tmp_path / "zero.gguf"
    path.write_bytes(bytes(out))
    assert refusal(path) == f"{path}: tensor blk.0.attn_q.bias: dimension ne0 is 0 (each must be >= 1)"


# ------------------------------------------------------------------ relations of the table
def test_head_count_kv_must_divide_head_count(bad):
    key_error(bad("llama", {"llama.attention.head_count_kv": (U32, 3)}), "llama.attention.head_count_kv",
              "must divide attention.head_count (4), found 3")


def test_value_length_must_equal_key_length(bad):
    key_error(bad("qwen3", {"qwen3.attention.value_length": (U32, 32)}), "qwen3.attention.value_length",
              "must equal attention.key_length (16), found 32")


def test_vocab_size_must_equal_the_token_count(bad):
    key_error(bad("qwen2", {"qwen2.vocab_size": (U32, 600)}), "qwen2.vocab_size",
              "must equal the number of tokens in tokenizer.ggml.tokens (512), found 600")


def test_token_count_must_equal_the_embedding_rows(bad, seeds):
    tokens = list(seeds["llama"].metadata["tokenizer.ggml.tokens"])[:-1]
    path = bad("llama", {"tokenizer.ggml.tokens": ((V.ARRAY, V.STRING), tokens), "llama.vocab_size": (U32, 511),
                         "tokenizer.ggml.token_type": ((V.ARRAY, V.INT32), [1] * 511),
                         "tokenizer.ggml.merges": ((V.ARRAY, V.STRING), [])})
    assert refusal(path) == (f"pack {path}: tensor token_embd.weight has shape [64, 512] "
                             f"but the metadata implies [64, 511]")


@pytest.mark.parametrize("key,value,what", [
    ("attention.layer_norm_rms_epsilon", 0.0, "must be > 0, found 0"),
    ("attention.layer_norm_rms_epsilon", math.inf, "must be finite, found inf"),
    ("rope.freq_base", -1.0, "must be > 0, found -1"),
    ("rope.freq_base", math.nan, "must be finite, found nan"),
])
def test_real_values_finite_and_positive(bad, key, value, what):
    key_error(bad("qwen3moe", {f"qwen3moe.{key}": (V.FLOAT32, value)}), f"qwen3moe.{key}", what)


def test_nextn_layers_below_block_count(bad):
    key_error(bad("qwen3", {"qwen3.nextn_predict_layers": (U32, 1)}), "qwen3.nextn_predict_layers",
              "must be below block_count (1), found 1")


def test_required_key_missing(bad):
    from tests.fuzz.mutate import DROP

    key_error(bad("qwen3moe", {"qwen3moe.expert_count": DROP}), "qwen3moe.expert_count",
              "missing (an integer is required)")


def test_defaults_come_from_the_table(bad):
    """Keys a pack may leave out get the table's defaults: the model still loads and generates."""
    from tests.fuzz.mutate import DROP

    path = bad("qwen3", {f"qwen3.{k}": DROP for k in ("attention.key_length",
                                                      "attention.value_length", "rope.dimension_count",
                                                      "context_length", "rope.freq_base")})
    with _opened(path) as pack:
        cfg = pack.model_config()
    assert (cfg.n_head_kv, cfg.head_dim, cfg.rope_dim, cfg.n_ctx_train, cfg.rope_base) == (2, 16, 16, 4096, 10000.0)


# ------------------------------------------------------------------ tensors checked at load
@pytest.mark.parametrize("arch,name,shape", [
    ("qwen2", "blk.0.attn_v.bias", (33,)),
    ("qwen2", "blk.0.attn_q.bias", (65,)),
    ("llama", "output.weight", (96, 512)),
    ("qwen3moe", "output.weight", (64, 513)),
])
def test_tensors_only_the_first_window_read_are_checked_at_load(bad, seeds, arch, name, shape):
    """These loaded before and failed in the first window (broadcast or matmul errors)."""
    from strata.kernels.ggml_types import BY_ID

    tensors = [(n, t, shape if n == name else s, bytes(BY_ID[t].nbytes(int(np.prod(shape)))) if n == name else d)
               for n, t, s, d in seeds[arch].tensors]
    path = bad(arch, {}, tensors)
    assert refusal(path).startswith(f"pack {path}: tensor {name} has shape {list(shape)} but the metadata implies")


# ------------------------------------------------------------------ the table itself
def test_every_arch_key_the_config_reads_is_in_the_table(seeds):
    names = {k.name for k in KEYS}
    for seed in seeds.values():
        values = checked_values("p", seed.metadata, seed.types)
        assert set(values) <= names


def _real_model(which: str) -> Path:
    from tests.support.model_fixtures import default_model_or_skip
    from tests.support.model_fixtures import MIX_Q2_0_NAME, shared_file

    if which == "mix-Q2_0":
        return shared_file("models", MIX_Q2_0_NAME)
    return default_model_or_skip()


@pytest.mark.parametrize("which", ["Q4_1", "mix-Q2_0"])
def test_real_models_pass_the_table(which):
    """No false refusal: the test model (and its mixed Q2_0 requantization) passes every check."""
    with _opened(_real_model(which)) as pack:
        cfg = pack.model_config()
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.vocab_size) == \
        ("llama", 30, 576, 9, 3, 64, 49152)
    assert (cfg.n_ctx_train, cfg.rope_base, cfg.rms_eps) == (8192, 100000.0, pytest.approx(1e-5))


def test_tokenizer_alone_refuses_a_token_not_utf8(seeds):
    """`strata tokenize` builds a tokenizer without the model's checks: bad token data is one line there too."""
    from strata.text.tokenizer import Tokenizer

    md = dict(seeds["qwen2"].metadata)
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"][:9], "\udcc3(", *md["tokenizer.ggml.tokens"][10:]]
    with pytest.raises(StrataError, match=r"^tokenizer.ggml.tokens: token 9 is not valid UTF-8 \(b'\\xc3\('\)$"):
        Tokenizer.from_metadata(md)


def test_one_line_and_exit_2_through_the_cli(bad):
    path = bad("qwen3", {"qwen3.attention.head_count": (U32, 0)})
    proc = subprocess.run([sys.executable, "-m", "strata.cli.main", "generate", "--pack", str(path), "--device", "cpu",
                           "--max-tokens", "1", "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"strata: pack {path}: metadata key qwen3.attention.head_count: must be >= 1, found 0"]


class _opened:
    """open_pack as a context manager (closes its maps)."""

    def __init__(self, path):
        self.pack = open_pack(pack=str(path))

    def __enter__(self):
        return self.pack

    def __exit__(self, *exc):
        self.pack.close()
