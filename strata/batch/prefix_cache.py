"""Prompt reuse: KV blocks of sequences already computed, found again by their tokens.

Sequences are cut into blocks of BLOCK tokens; a block is named by a hash of its tokens and
of its parent block's name (vLLM's automatic prefix caching), so one lookup walks a new
prompt's blocks from the start and stops at the first unknown one. A block holds the KV of
its positions in every layer, copied out of a slot's cache (the main model's and, when the
slot's MTP draft had caught up that far, the draft's), so it outlives the slot and serves any
slot later: reuse across slots and over time costs one device copy per layer and block
instead of a prefill.

Bounded by bytes: least recently used blocks go first. (Blocks stored together are views of
one copy, whose memory goes back when its last block goes: the bound counts blocks kept.) A lookup touches the blocks it
matched deepest first, so a chain's root is the most recent and its leaves are evicted
before it (an evicted parent would make its children unreachable).

Caches that are not plain KV (a hybrid model's recurrent state cannot be cut at a block
boundary) are never stored nor reused: `supports` says which are.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from strata.model.kv_cache import KVCache

BLOCK = 64


@dataclass
class _Block:
    main: list[Any]  # KVCache.export of the block's positions
    draft: list[Any] | None  # the draft's, when it had them
    nbytes: int
    last_hidden: Any = None  # the main model's hidden state at the block's last position


def supports(cache: Any) -> bool:
    return type(cache) is KVCache


def _key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evicted = 0

    def _keys(self, tokens: Sequence[int], n_blocks: int) -> list[bytes]:
        keys, parent = [], b""
        for i in range(n_blocks):
            parent = _key(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
            keys.append(parent)
        return keys

    def store(self, tokens: Sequence[int], cache: KVCache, draft: KVCache | None,
              hiddens: dict[int, Any] | None = None) -> None:
        """Keep the full blocks of `tokens` that `cache` holds (its first positions) and that
        are not kept yet; a kept block without draft KV gets the draft's when it has it now.
        hiddens: {block index: the main hidden at its last position} where known (a draft
        that resumes after the block needs it)."""
        if self.budget <= 0 or not supports(cache):
            return
        n = min(len(tokens), cache.length) // BLOCK
        keys = self._keys(tokens, n)
        can_draft = draft is not None and supports(draft)
        for i, k in enumerate(keys):  # known blocks learn what they lacked
            blk = self.blocks.get(k)
            if blk is None:
                continue
            if blk.last_hidden is None and hiddens and i in hiddens:
                blk.last_hidden = hiddens[i]
                self._grew(blk, int(blk.last_hidden.nbytes))
            if blk.draft is None and can_draft and draft.length >= (i + 1) * BLOCK:
                blk.draft = _cut(draft.export(i * BLOCK, BLOCK), 1)[0]
                self._grew(blk, _bytes(blk.draft))
        new = [i for i, k in enumerate(keys) if k not in self.blocks]
        # new blocks are copied out in runs of consecutive ones: one copy per layer and array
        # for a run (a 4k-token prompt's 64 blocks cost 2 x layers copies, not 64 times that);
        # the blocks of a run are views of that copy
        for lo, hi in _runs(new):
            main = _cut(cache.export(lo * BLOCK, (hi - lo) * BLOCK), hi - lo)
            d_hi = min(hi, draft.length // BLOCK) if can_draft else lo
            dr = _cut(draft.export(lo * BLOCK, (d_hi - lo) * BLOCK), d_hi - lo) if d_hi > lo else []
            for j, i in enumerate(range(lo, hi)):
                hid = hiddens.get(i) if hiddens else None
                d = dr[j] if j < len(dr) else None
                blk = _Block(main[j], d, 0, hid)
                self.blocks[keys[i]] = blk
                self._grew(blk, _bytes(main[j]) + (_bytes(d) if d is not None else 0)
                           + (int(hid.nbytes) if hid is not None else 0))
        self._touch(keys)
        self._evict()

    def match(self, tokens: Sequence[int], limit: int, with_draft: bool) -> int:
        """How many positions of `tokens` (at most `limit`) load() would copy, with or without
        the draft's KV; nothing is touched."""
        if self.budget <= 0:
            return 0
        n = 0
        for k in self._keys(tokens, min(len(tokens), limit) // BLOCK):
            blk = self.blocks.get(k)
            if blk is None or (with_draft and (blk.draft is None or blk.last_hidden is None)):
                break
            n += BLOCK
        return n

    def load(self, tokens: Sequence[int], cache: KVCache, draft: KVCache | None, limit: int) -> tuple[int, Any]:
        """Copy the longest kept prefix of `tokens`, at most `limit` positions, into `cache`;
        returns (its length m, None). With `draft` (an MTP draft's cache) only blocks with draft
        KV and their last hidden count, and the draft gets m - 1 entries: its entry m reads
        token m, past the prefix. Then the second value is the main hidden at position m - 1,
        which the draft's next entry reads."""
        if self.budget <= 0 or not supports(cache) or (draft is not None and not supports(draft)):
            return 0, None
        keys = self._keys(tokens, min(len(tokens), limit) // BLOCK)
        found = []
        for k in keys:
            blk = self.blocks.get(k)
            if blk is None or (draft is not None and (blk.draft is None or blk.last_hidden is None)):
                break
            found.append(blk)
        if not found:
            self.misses += 1
            return 0, None
        n = len(found) * BLOCK
        cache.reset()
        cache.load(0, [b.main for b in found])
        hidden = None
        if draft is not None:
            draft.reset()
            draft.load(0, [b.draft for b in found])
            draft.truncate(n - 1)
            hidden = found[-1].last_hidden
        self.hits += 1
        self._touch(keys[: len(found)])
        return n, hidden

    def _grew(self, blk: _Block, nbytes: int) -> None:
        blk.nbytes += nbytes
        self.nbytes += nbytes

    def _touch(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            if k in self.blocks:
                self.blocks.move_to_end(k)

    def _evict(self) -> None:
        while self.nbytes > self.budget and self.blocks:
            _, blk = self.blocks.popitem(last=False)
            self.nbytes -= blk.nbytes
            self.evicted += 1

    def stats(self) -> dict:
        return {"blocks": len(self.blocks), "bytes": self.nbytes, "budget_bytes": self.budget,
                "hits": self.hits, "misses": self.misses, "evicted_blocks": self.evicted, "block_tokens": BLOCK}


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive block indices."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _cut(parts: list[Any], n_blocks: int) -> list[list[Any]]:
    """An export of n_blocks consecutive blocks as n_blocks exports of one block (views)."""
    return [[p[:, j * BLOCK : (j + 1) * BLOCK] for p in parts] for j in range(n_blocks)]


def _bytes(arrays: list[Any]) -> int:
    return sum(int(a.nbytes) for a in arrays)
