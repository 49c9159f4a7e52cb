"""Shared helpers for engine-level tests: synthetic packs, in-process engines, collecting events."""

from __future__ import annotations

import queue
from pathlib import Path

from strata.engine.core import EngineCore
from strata.engine.options import parse_engine_args
from strata.protocol import FinishEvent, GenerationRequest, SamplingParams


def make_seed_moe(out: Path) -> Path:
    """The seed-moe preset (qwen3moe, IQ3_S/IQ3_XXS gate-up, Q2_0/IQ4_NL downs) with an MTP draft."""
    from strata.pack.presets import PRESETS
    from strata.pack.synth import synth_pack

    synth_pack(PRESETS["seed-moe"], out, mtp_dir=out / "mtp", progress=lambda *a, **k: None)
    return out


SHARED_VOCAB = 4096
SHARED_SEED_MOE_VOCAB = SHARED_VOCAB
_shared_packs: dict[tuple[str, str, int], Path] = {}


def _shared_pack(tmp_path_factory, name: str, spec, vocab: int, mtp: bool) -> Path:
    """A synthetic pack written once per pytest session (under its base temporary folder)."""
    from dataclasses import replace

    from strata.pack.synth import synth_pack

    key = (str(tmp_path_factory.getbasetemp()), name, vocab)
    out = _shared_packs.get(key)
    if out is None or not (out / "mtp" if mtp else out).is_dir():
        out = tmp_path_factory.mktemp(f"{name}-v{vocab}")
        synth_pack(replace(spec, vocab=vocab), out, mtp_dir=out / "mtp" if mtp else None,
                   progress=lambda *a, **k: None)
        _shared_packs[key] = out
    return out


def shared_seed_moe(tmp_path_factory, vocab: int = SHARED_VOCAB) -> Path:
    """The seed-moe preset with its MTP draft (as make_seed_moe), written once per pytest session
    for every module that asks, at a vocabulary of 4096 instead of 49152 by default: the output
    head and the embedding, about half of a load and of a wide window's cost on this tiny model,
    are 12x smaller, while the layers, the experts and their types (what the seed story is about)
    stay. The tokenizer is the test model's first `vocab` tokens with the merges among them."""
    from strata.pack.presets import PRESETS

    return _shared_pack(tmp_path_factory, "seed-moe", PRESETS["seed-moe"], vocab, mtp=True)


def shared_tiny(tmp_path_factory, arch: str, vocab: int = SHARED_VOCAB) -> Path:
    """The TINY preset of `arch` (strata.pack.presets.TINY; a hybrid one has its nextn layer),
    written once per pytest session, at a vocabulary of 4096 by default (see shared_seed_moe:
    on the tiny hybrid the head is most of a window)."""
    from strata.pack.presets import TINY

    return _shared_pack(tmp_path_factory, f"tiny-{arch}", TINY[arch], vocab, mtp=False)


def load_engine(args: list[str]) -> tuple[EngineCore, list[str]]:
    lines: list[str] = []
    core = EngineCore.load(parse_engine_args(args, serving=False), log=lines.append)
    return core, lines


def collect(handle, timeout: float = 120.0) -> tuple[list[int], str, FinishEvent]:
    return handle.collect(timeout=timeout)


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def request(prompt_ids, params) -> GenerationRequest:
    return GenerationRequest(list(prompt_ids), params)


def run_all(core: EngineCore, prompts, params, *, threaded: bool) -> list[tuple[list[int], str, FinishEvent]]:
    """Submit every prompt at once; drive windows on a thread (like the server) or inline."""
    handles = [core.submit(request(p, params)) for p in prompts]
    if not threaded:
        core.scheduler.run_until_idle()
    return [collect(h) for h in handles]


def chat_prompts(core: EngineCore, texts) -> list[list[int]]:
    return [core.tokenizer.encode(core.chat.render([{"role": "user", "content": t}]), add_special=True)
            for t in texts]


__all__ = ["make_seed_moe", "shared_seed_moe", "shared_tiny", "load_engine", "collect", "greedy", "request", "run_all", "chat_prompts", "queue"]
