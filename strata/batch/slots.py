"""Per-slot state: the request being served, its caches, its MTP state (strata/mtp/state.py) and counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata.batch.output import TextOutput
from strata.protocol import RequestHandle
from strata.model.kv_cache import KVCache
from strata.mtp.state import DraftState


@dataclass
class MtpCounters:
    windows: int = 0  # windows in which this slot verified a proposal
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.windows += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.drafted_per_pos) < drafted:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for j in range(drafted):
            self.drafted_per_pos[j] += 1
            if j < accepted:
                self.accepted_per_pos[j] += 1


@dataclass
class Slot:
    index: int
    cache: KVCache
    # MTP capability of this slot from the probe (batch-MTP)
    batch_mtp: bool = False
    batch_mtp_reason: str | None = None  # short code, for metrics
    mtp: DraftState | None = None  # None when nothing proposes (no --spec, no draft)
    counters: MtpCounters = field(default_factory=MtpCounters)
    # the request in service
    handle: RequestHandle | None = None
    prompt: list[int] = field(default_factory=list)
    n_prefilled: int = 0
    pending: int | None = None  # last sampled token, not yet in the cache
    n_generated: int = 0
    rng: np.random.Generator | None = None
    output: TextOutput | None = None
    history: list[int] = field(default_factory=list)  # prompt and output: the penalties' window
    matcher: Any = None  # the request's grammar state (strata.grammar.Matcher), when it has one
    adjusted: bool = False  # the request changes its logits (strata.sampling.logit_adjust)
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    embed_sum: Any = None  # an embedding request's running sum of final-normed hiddens
    block_hidden: dict[int, Any] = field(default_factory=dict)  # prefix-cache block -> main hidden at its end

    @property
    def busy(self) -> bool:
        return self.handle is not None

    @property
    def mtp_failed(self) -> str | None:
        """Why the slot's MTP path failed (MTP is off for it from then on); None: it did not."""
        return None if self.mtp is None else self.mtp.failed

    @property
    def rolls_back(self) -> bool:
        """Whether its cache can go back to a window's start: not a hybrid model's recurrent
        state without a rollback copy (strata/model/recurrent_state.py); such a slot never drafts."""
        return self.cache.checkpointed

    @property
    def prefilling(self) -> bool:
        return self.handle is not None and self.n_prefilled < len(self.prompt)

    def reset(self) -> None:
        self.handle = None
        self.prompt = []
        self.n_prefilled = 0
        self.pending = None
        self.n_generated = 0
        self.rng = None
        self.output = None
        self.history = []
        self.matcher = None
        self.adjusted = False
        self.cached = 0
        self.embed_sum = None
        self.block_hidden = {}
        self.cache.reset()
        if self.mtp is not None:
            self.mtp.reset()
