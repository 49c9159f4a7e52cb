"""Shared helpers for engine-level tests: synthetic packs, in-process engines, collecting events."""

from __future__ import annotations

import queue
from pathlib import Path

from strata.engine.core import EngineCore
from strata.engine.options import parse_engine_args
from strata.engine.protocol import FinishEvent, GenerationRequest, SamplingParams


def make_seed_moe(out: Path) -> Path:
    """The seed-moe preset (qwen3moe, IQ3_S/IQ3_XXS gate-up, Q2_0/IQ4_NL downs) with an MTP draft."""
    from strata.pack.presets import PRESETS
    from strata.pack.synth import synth_pack

    synth_pack(PRESETS["seed-moe"], out, mtp_dir=out / "mtp", progress=lambda *a, **k: None)
    return out


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


__all__ = ["make_seed_moe", "load_engine", "collect", "greedy", "request", "run_all", "chat_prompts", "queue"]
