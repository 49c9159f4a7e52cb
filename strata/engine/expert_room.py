"""The memory `--expert-cache auto` gives an expert pool: what the backend has free, less the
weights that stay outside the pool, the slots' state and a margin (strata.experts.budget
.auto_budget); the start-up line says each figure.

It is decided before any weight loads (the pool is sized before the experts are made), so the
rest is estimated from the pack and the config:
- the other weights: Backend.weight_bytes of the main model's tensors and the draft's (when
  --spec runs one), the pooled experts left out (their slots are the budget);
- each slot's state: its KV cache (every attention layer, the draft's one too) at --max-context
  when given, else at the first AUTO_POSITIONS positions, and one copy of a recurrent state
  (hybrid models). Caches grow as requests need them, so a longer context grows into what the
  margin and the pool leave, as without a pool (the engine's sizing note says how far);
- the margin: AUTO_MARGIN (1 GiB: the interpreter and its libraries, a few hundred MiB; a prompt
  chunk's activations and attention scores, up to hundreds of MiB at long contexts; and, on the
  CPU, page cache for the quantized experts a miss reads from the pack's map) plus the backend's
  load peak (Backend.load_peak_bytes: on the CPU the float32 of the largest matrix, made whole
  before its transposed copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Sequence

from strata.experts.budget import AUTO_MARGIN, GiB, auto_budget
from strata.model.kv_cache import KVCache
from strata.model.recurrent_state import REPLAY_TOKENS, HybridCache, recurrent_shape

# positions of KV reserved per slot when --max-context does not say (a conversation's worth)
AUTO_POSITIONS = 8192


@dataclass(frozen=True)
class AutoRoom:
    free: int  # what the backend has free before loading
    weights: int  # the weights outside the pool, once loaded
    state: int  # every slot's KV and recurrent state (estimated)
    margin: int
    parallel: int
    positions: int  # KV positions reserved per slot

    @property
    def budget(self) -> int:
        return auto_budget(self.free, self.weights + self.state, self.margin)

    def words(self) -> str:
        """auto's arithmetic, for the start-up line."""
        return (f"auto: {_gib(self.free)} free, less {_gib(self.weights)} of other weights, {_gib(self.state)} of "
                f"KV and state ({self.parallel} slot{'s' if self.parallel != 1 else ''} at {self.positions} "
                f"positions) and a {_gib(self.margin)} margin")


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def slot_state_bytes(xp: Any, cfg: Any, positions: int, kv: str, spec: int, draft: bool) -> int:
    """One slot's state before a model exists: the KV of its attention layers (and the draft's
    one) at `positions`, one copy of a hybrid model's recurrent state, and what its architecture
    keeps beside them (qwen4exp's indexer keys per position and n-gram history)."""
    n_attention = cfg.n_layer - (cfg.hybrid.n_recurrent if cfg.hybrid is not None else 0) + int(draft)
    total = positions * KVCache.position_bytes(xp, n_attention, cfg.n_head_kv, cfg.head_dim, kv)
    if cfg.hybrid is not None:
        replay = max(REPLAY_TOKENS, spec + 1)
        total += HybridCache.state_bytes(recurrent_shape(cfg), replay, checkpoint=False)
        total += positions * cfg.hybrid.extra_position_bytes(n_attention)
        total += cfg.hybrid.extra_state_bytes(cfg.n_embd, replay, False)
    return total


def auto_room(backend: Any, cfg: Any, opts: Any, n_ctx: int, tensors: Sequence[Any], draft: bool,
              pooled: Collection[str]) -> AutoRoom | None:
    """auto's figures for the pack's `tensors` to load (the main model's, and the draft's when
    `draft`), the `pooled` ones outside the weights; None where the backend's free memory or
    its weights' size is unknown (every expert then stays resident)."""
    free = backend.free_bytes()
    weights = backend.weight_bytes(tensors, mapped=pooled)
    if free is None or weights is None:
        return None
    positions = min(n_ctx, opts.max_context or AUTO_POSITIONS)
    state = opts.parallel * slot_state_bytes(backend.xp, cfg, positions, opts.kv, opts.spec, draft)
    margin = AUTO_MARGIN + backend.load_peak_bytes(tensors, mapped=pooled)
    return AutoRoom(free, weights, state, margin, opts.parallel, positions)
