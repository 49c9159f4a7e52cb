"""Prompt reuse: KV blocks of sequences already computed, found again by their tokens.

Sequences are cut into blocks of BLOCK tokens; a block is named by a hash of its tokens and
of its parent block's name (vLLM's automatic prefix caching), so one lookup walks a new
prompt's blocks from the start and stops at the first unknown one. A block holds the KV of
its positions in every layer, copied out of a slot's cache (the main model's and, when the
slot's MTP draft had caught up that far, the draft's), so it outlives the slot and serves any
slot later: reuse across slots and over time costs one device copy per layer and block
instead of a prefill.

Bounded by bytes: least recently used blocks go first. Blocks stored together are views of one
copy (an `_Alloc`), whose memory goes back only when its last block goes, so the bound counts
every copy that a kept block still views, whole: a kept root pins its run. When evicting leaves
half or less of a copy viewed, the blocks still viewing it move into a copy of their own size
(a copy halves at least each time, so moving costs at most the bytes first stored). A lookup
touches the blocks it matched deepest first, so a chain's root is the most recent and its
leaves are evicted before it (an evicted parent would make its children unreachable).

Reuse has scopes: a request's `cache_salt` is mixed into its first block's name (vLLM's
cache_salt), so its blocks are found only by requests with the same salt, and what one scope
stored is never a hit, nor a faster answer, for another (docs/SERVER.md, "Prompt reuse and
its scope").

Caches that are not plain KV (a hybrid model's recurrent state cannot be cut at a block
boundary) are never stored nor reused: `supports` says which are.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from strata.model.kv_cache import KVCache

BLOCK = 64


@dataclass(eq=False)
class _Alloc:
    """One copy that blocks view: its arrays, their bytes, and which blocks view it where."""
    parts: list[Any]  # arrays of n_blocks blocks' positions (axis 1), or one hidden state
    n_blocks: int
    nbytes: int
    users: dict[bytes, int]  # block name -> its index within the copy


@dataclass
class _Block:
    main: list[Any]  # KVCache.export of the block's positions
    draft: list[Any] | None  # the draft's, when it had them
    last_hidden: Any = None  # the main model's hidden state at the block's last position
    # the copies the fields above view: "main", "draft", "last_hidden" -> _Alloc
    allocs: dict[str, _Alloc] = field(default_factory=dict)


def supports(cache: Any) -> bool:
    return type(cache) is KVCache


def _key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


def _root(salt: str) -> bytes:
    """The parent name of a scope's first block: b"" for the unsalted scope, else a hash of the
    salt (a different length from any token run's bytes, so no salt names an unsalted block)."""
    if not salt:
        return b""
    return hashlib.blake2b(b"cache_salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evicted = 0

    def _keys(self, tokens: Sequence[int], n_blocks: int, salt: str = "") -> list[bytes]:
        keys, parent = [], _root(salt)
        for i in range(n_blocks):
            parent = _key(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
            keys.append(parent)
        return keys

    def store(self, tokens: Sequence[int], cache: KVCache, draft: KVCache | None,
              hiddens: dict[int, Any] | None = None, salt: str = "") -> None:
        """Keep the full blocks of `tokens` that `cache` holds (its first positions) and that
        are not kept yet; a kept block without draft KV gets the draft's when it has it now.
        hiddens: {block index: the main hidden at its last position} where known (a draft
        that resumes after the block needs it). salt: the request's cache_salt (its scope)."""
        if self.budget <= 0 or not supports(cache):
            return
        n = min(len(tokens), cache.length) // BLOCK
        keys = self._keys(tokens, n, salt)
        can_draft = draft is not None and supports(draft)
        for i, k in enumerate(keys):  # known blocks learn what they lacked
            blk = self.blocks.get(k)
            if blk is None:
                continue
            if blk.last_hidden is None and hiddens and i in hiddens:
                self._view(blk, k, "last_hidden", hiddens[i], [hiddens[i]], 0)
            if blk.draft is None and can_draft and draft.length >= (i + 1) * BLOCK:
                parts = draft.export(i * BLOCK, BLOCK)
                self._view(blk, k, "draft", parts, parts, 0)
        new = [i for i, k in enumerate(keys) if k not in self.blocks]
        # new blocks are copied out in runs of consecutive ones: one copy per layer and array
        # for a run (a 4k-token prompt's 64 blocks cost 2 x layers copies, not 64 times that);
        # the blocks of a run are views of that copy
        for lo, hi in _runs(new):
            main_parts = cache.export(lo * BLOCK, (hi - lo) * BLOCK)
            main_alloc = self._alloc(main_parts, hi - lo)
            main = _cut(main_parts, hi - lo)
            d_hi = min(hi, draft.length // BLOCK) if can_draft else lo
            draft_parts = draft.export(lo * BLOCK, (d_hi - lo) * BLOCK) if d_hi > lo else []
            draft_alloc = self._alloc(draft_parts, d_hi - lo) if draft_parts else None
            dr = _cut(draft_parts, d_hi - lo) if draft_parts else []
            for j, i in enumerate(range(lo, hi)):
                blk = _Block(main[j], None)
                self.blocks[keys[i]] = blk
                self._attach(blk, keys[i], "main", main_alloc, j)
                if j < len(dr):
                    blk.draft = dr[j]
                    self._attach(blk, keys[i], "draft", draft_alloc, j)
                hid = hiddens.get(i) if hiddens else None
                if hid is not None:
                    self._view(blk, keys[i], "last_hidden", hid, [hid], 0)
        self._touch(keys)
        self._evict()

    def match(self, tokens: Sequence[int], limit: int, with_draft: bool, salt: str = "") -> int:
        """How many positions of `tokens` (at most `limit`) load() would copy, with or without
        the draft's KV; nothing is touched."""
        if self.budget <= 0:
            return 0
        n = 0
        for k in self._keys(tokens, min(len(tokens), limit) // BLOCK, salt):
            blk = self.blocks.get(k)
            if blk is None or (with_draft and (blk.draft is None or blk.last_hidden is None)):
                break
            n += BLOCK
        return n

    def load(self, tokens: Sequence[int], cache: KVCache, draft: KVCache | None, limit: int,
             salt: str = "") -> tuple[int, Any]:
        """Copy the longest kept prefix of `tokens`, at most `limit` positions, into `cache`;
        returns (its length m, None). With `draft` (an MTP draft's cache) only blocks with draft
        KV and their last hidden count, and the draft gets m - 1 entries: its entry m reads
        token m, past the prefix. Then the second value is the main hidden at position m - 1,
        which the draft's next entry reads."""
        if self.budget <= 0 or not supports(cache) or (draft is not None and not supports(draft)):
            return 0, None
        keys = self._keys(tokens, min(len(tokens), limit) // BLOCK, salt)
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

    # ---- what the kept blocks hold: copies (_Alloc) counted whole while any block views them
    def _alloc(self, parts: list[Any], n_blocks: int = 1) -> _Alloc:
        a = _Alloc(parts, n_blocks, _bytes(parts), {})
        self.nbytes += a.nbytes
        return a

    def _attach(self, blk: _Block, key: bytes, name: str, alloc: _Alloc, index: int) -> None:
        alloc.users[key] = index
        blk.allocs[name] = alloc

    def _view(self, blk: _Block, key: bytes, name: str, value: Any, parts: list[Any], index: int) -> None:
        """Set one field of a kept block to `value`, a view of a new copy made of `parts`."""
        setattr(blk, name, value)
        self._attach(blk, key, name, self._alloc(parts), index)

    def _release(self, key: bytes, blk: _Block) -> None:
        """An evicted block stops viewing its copies: a copy no block views goes back; one that
        its remaining blocks view half or less of moves them into a copy of their own."""
        for alloc in blk.allocs.values():
            del alloc.users[key]
            if not alloc.users:
                self.nbytes -= alloc.nbytes
            elif alloc.n_blocks >= 2 * len(alloc.users):
                try:
                    self._move_out(alloc)
                except MemoryError:  # (CuPy's out of memory too) the copy stays whole, and counted
                    pass
        blk.allocs.clear()

    def _move_out(self, alloc: _Alloc) -> None:
        """The blocks still viewing `alloc` (a run's copy) into copies of their own runs."""
        names = {index: key for key, index in alloc.users.items()}  # index in the copy -> block name
        # every copy first: one that fails leaves the cache as it was
        moves = [(lo, hi, [p[:, lo * BLOCK : hi * BLOCK].copy() for p in alloc.parts])
                 for lo, hi in _runs(sorted(names))]
        for lo, hi, parts in moves:
            new = self._alloc(parts, hi - lo)
            views = _cut(parts, hi - lo)
            for j, index in enumerate(range(lo, hi)):
                key = names[index]
                blk = self.blocks[key]
                name = next(n for n, a in blk.allocs.items() if a is alloc)
                setattr(blk, name, views[j])
                self._attach(blk, key, name, new, j)
        alloc.users.clear()
        self.nbytes -= alloc.nbytes

    def _touch(self, keys: list[bytes]) -> None:
        for k in reversed(keys):
            if k in self.blocks:
                self.blocks.move_to_end(k)

    def _evict(self) -> None:
        while self.nbytes > self.budget and self.blocks:
            key, blk = self.blocks.popitem(last=False)
            self._release(key, blk)
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
