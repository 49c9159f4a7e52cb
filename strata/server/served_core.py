"""What the engine's HTTP layer reads from the core it serves (strata.engine.core.EngineCore, or
a test's scripted core): one declared shape instead of probing attributes.

A core without a pack (a scripted one) has `pack`, `opts`, `cfg` and `draft` None: the routes then
serve it under `model_name`, check no token ids against a vocabulary and report no speculation.
"""

from __future__ import annotations

from typing import Any, Protocol

from strata.protocol import GenerationRequest, RequestHandle


class ServedTokenizer(Protocol):
    vocab_size: int
    eog_ids: Any

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class ServedCore(Protocol):
    model_name: str
    n_ctx: int
    parallel: int
    tokenizer: ServedTokenizer
    chat: Any
    cfg: Any  # strata.model.config.ModelConfig (n_embd, vocab_size), or None
    pack: Any  # strata.pack.loader.Pack, or None
    opts: Any  # strata.engine.options.EngineOptions, or None
    draft: Any  # the MTP draft model, or None

    def submit(self, req: GenerationRequest) -> RequestHandle: ...

    def queue_depth(self) -> int: ...

    def slots_busy(self) -> int: ...

    def metrics(self) -> dict: ...

    def liveness(self) -> tuple[bool, str | None]: ...

    def stop(self) -> None: ...
