"""Per-sequence KV cache, f16 or int8 (one scale per head and token).

Storage grows by doubling up to the context limit, so a 262144-token `--max-context` costs
nothing until a sequence is that long. `truncate(n)` rolls back rejected speculative
positions: entries past n are simply forgotten and overwritten later.
"""

from __future__ import annotations

from typing import Any, Callable

from strata.errors import StrataError
from strata.model.state import Snapshot, StateLost


class KVCache:
    checkpointed = True  # a KV cache forgets positions exactly: truncate goes back anywhere (state.SequenceState)

    def __init__(self, xp: Any, n_layer: int, n_kv: int, head_dim: int, max_ctx: int, kind: str = "f16",
                 initial: int = 256):
        if kind not in ("f16", "int8"):
            raise StrataError(f"--kv {kind}: expected f16 or int8")
        self.xp = xp
        self.n_layer, self.n_kv, self.d = n_layer, n_kv, head_dim
        self.max_ctx = max_ctx
        self.kind = kind
        self._length = 0  # positions [0, length) are valid in every layer
        self._cuts = 0  # times the length went down: positions kept by a snapshot may be rewritten since
        self._cap = 0
        # bumped whenever arrays are replaced, so that whoever keeps their addresses (the CUDA
        # backend's cache table) rebuilds them: a growth, also one rolled back after running out
        # of memory half way (its capacity is the old one, but some arrays moved twice)
        self.generation = 0
        self._device_table: tuple[int, Any] | None = None  # (generation, device_table()) once asked
        self._k: list[Any] = []
        self._v: list[Any] = []
        self._ks: list[Any] = []
        self._vs: list[Any] = []
        # On the CPU, a float32 copy of what the cache holds (the f16 or int8 values, decoded once
        # when written) spares converting the whole cache at every step; the values read are the
        # same either way. The GPU keeps only the compact storage.
        self._shadow = xp.__name__ == "numpy"
        self._kd: list[Any] = []
        self._vd: list[Any] = []
        self._grow(min(initial, max_ctx))

    # --- storage -------------------------------------------------------------------------
    def _rows(self, cap: int) -> Any:
        """One layer's k (or v) storage for `cap` positions."""
        return self.xp.zeros((self.n_kv, cap, self.d), self.xp.float16 if self.kind == "f16" else self.xp.int8)

    def _storage(self) -> list[tuple[list[Any], Callable[[int], Any]]]:
        """Every per-layer list of arrays this cache keeps, each with how to make one of a
        capacity: k and v, their int8 scales, the CPU's float32 copies."""
        xp = self.xp
        out = [(self._k, self._rows), (self._v, self._rows)]
        if self.kind == "int8":
            scales = lambda cap: xp.ones((self.n_kv, cap), xp.float32)  # noqa: E731
            out += [(self._ks, scales), (self._vs, scales)]
        if self._shadow:
            decoded = lambda cap: xp.zeros((self.n_kv, cap, self.d), xp.float32)  # noqa: E731
            out += [(self._kd, decoded), (self._vd, decoded)]
        return out

    def _grow(self, need: int) -> None:
        """Room for `need` positions: every array to one new capacity, a layer at a time (so the
        old array goes as its successor comes: the peak is the old storage plus one array). Out
        of memory half way, the arrays already replaced go back to the old capacity and the
        error is raised: the cache is as it was, every array at the one capacity it reports."""
        if need <= self._cap:
            return
        old = self._cap
        cap = max(need, min(self.max_ctx, max(old * 2, 16)))
        self.generation += 1
        moved: list[tuple[list[Any], int, Callable[[int], Any]]] = []
        try:
            for arrs, make in self._storage():
                for layer in range(self.n_layer):
                    a = make(cap)
                    if layer < len(arrs):
                        a[:, :old] = arrs[layer][:, :old]
                        arrs[layer] = a
                    else:
                        arrs.append(a)
                    moved.append((arrs, layer, make))
        except BaseException:
            for arrs, layer, make in reversed(moved):
                if old == 0:
                    arrs.pop()
                else:  # the blocks the replaced arrays had are free again: these fit
                    b = make(old)
                    b[:, :old] = arrs[layer][:, :old]
                    arrs[layer] = b
            raise
        self._cap = cap

    @property
    def nbytes(self) -> int:
        total = sum(int(a.nbytes) for a in self._k + self._v + self._kd + self._vd)
        return total + sum(int(a.nbytes) for a in self._ks + self._vs)

    @staticmethod
    def position_bytes(xp: Any, n_layer: int, n_kv: int, head_dim: int, kind: str) -> int:
        """What one position costs a cache of these sizes, before one exists (the figure
        bytes_per_position measures): k and v, int8's scales, the CPU's float32 copies."""
        per = 2 * n_kv * head_dim * (2 if kind == "f16" else 1)
        if kind == "int8":
            per += 2 * n_kv * 4
        if xp.__name__ == "numpy":
            per += 2 * n_kv * head_dim * 4
        return n_layer * per

    @property
    def bytes_per_position(self) -> int:
        """What one more position costs this cache (every layer, k and v, scales, CPU copies)."""
        return self.nbytes // max(1, self._cap)

    def device_table(self) -> Any:
        """The cache's table for the GPU kernels (strata/kernels/cuda/fused.cu): its capacity, then
        per layer the addresses of k, v and the int8 scales (0, 0 for f16), int64 on the device.
        Made again when the arrays move (a new generation: a growth, also one that ran out of
        memory half way)."""
        if self._device_table is None or self._device_table[0] != self.generation:
            ptrs = [self._cap]
            for layer in range(self.n_layer):
                scales = (self._ks[layer].data.ptr, self._vs[layer].data.ptr) if self.kind == "int8" else (0, 0)
                ptrs += [self._k[layer].data.ptr, self._v[layer].data.ptr, *scales]
            self._device_table = (self.generation, self.xp.asarray(ptrs, dtype=self.xp.int64))
        return self._device_table[1]

    # --- access ---------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        if n < self._length:
            self._cuts += 1
        self._length = n

    def ensure(self, end: int) -> None:
        if end > self.max_ctx:
            raise StrataError(f"context full: {end} tokens exceed the context of {self.max_ctx}")
        self._grow(end)

    def write(self, layer: int, start: int, k: Any, v: Any) -> None:
        """k, v (t, n_kv, d) float32 for positions [start, start + t)."""
        t = k.shape[0]
        self.ensure(start + t)
        kt = k.transpose(1, 0, 2)
        vt = v.transpose(1, 0, 2)
        if self.kind == "f16":
            self._k[layer][:, start : start + t] = kt
            self._v[layer][:, start : start + t] = vt
        else:
            for arr, sc, val in ((self._k, self._ks, kt), (self._v, self._vs, vt)):
                q, s = self._quantize(val)
                arr[layer][:, start : start + t] = q
                sc[layer][:, start : start + t] = s
        if self._shadow:
            dk, dv = self._decode(layer, start, start + t)
            self._kd[layer][:, start : start + t] = dk
            self._vd[layer][:, start : start + t] = dv

    def _quantize(self, x: Any):
        xp = self.xp
        amax = xp.abs(x).max(axis=-1)
        s = xp.where(amax > 0, amax / 127.0, 1.0).astype(xp.float32)
        q = xp.clip(xp.rint(x / s[..., None]), -127, 127).astype(xp.int8)
        return q, s

    def read(self, layer: int, end: int):
        """Float32 k, v (n_kv, end, d) for positions [0, end)."""
        if self._shadow:
            return self._kd[layer][:, :end], self._vd[layer][:, :end]
        return self._decode(layer, 0, end)

    def _decode(self, layer: int, start: int, end: int):
        xp = self.xp
        k = self._k[layer][:, start:end]
        v = self._v[layer][:, start:end]
        if self.kind == "f16":
            return k.astype(xp.float32), v.astype(xp.float32)
        return (k.astype(xp.float32) * self._ks[layer][:, start:end, None],
                v.astype(xp.float32) * self._vs[layer][:, start:end, None])

    # --- prompt reuse (strata/batch/prefix_cache.py) -----------------------------------------
    def _compact(self) -> list[list[Any]]:
        """The per-layer lists that hold what the cache stores (not the CPU's decoded copies)."""
        return [self._k, self._v] + ([self._ks, self._vs] if self.kind == "int8" else [])

    def export(self, start: int, n: int) -> list[Any]:
        """Copies of positions [start, start + n) of every layer (k, v and the int8 scales)."""
        return [arrs[layer][:, start : start + n].copy() for arrs in self._compact() for layer in range(self.n_layer)]

    def load(self, start: int, parts: list[list[Any]]) -> None:
        """Write consecutive exported pieces from `start` on (one copy per array: the pieces
        are joined first); the length becomes the end of what was written."""
        xp = self.xp
        n = sum(int(p[0].shape[1]) for p in parts)
        if start < self.length:  # positions a snapshot kept are rewritten
            self._cuts += 1
        self.ensure(start + n)
        i = 0
        for arrs in self._compact():
            for layer in range(self.n_layer):
                piece = parts[0][i] if len(parts) == 1 else xp.concatenate([p[i] for p in parts], axis=1)
                arrs[layer][:, start : start + n] = piece
                i += 1
        if self._shadow:
            for layer in range(self.n_layer):
                dk, dv = self._decode(layer, start, start + n)
                self._kd[layer][:, start : start + n] = dk
                self._vd[layer][:, start : start + n] = dv
        self.length = start + n

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)

    def reset(self) -> None:
        """An empty sequence (the storage stays for the next one)."""
        self.length = 0

    def snapshot(self) -> Snapshot:
        """The sequence as it is (state.Snapshot): a KV cache needs no copy, its positions stay
        as long as nothing cuts below them."""
        return Snapshot(self.length, self._cuts)

    def restore(self, snap: Snapshot) -> None:
        """Back to `snap`: forget the positions added since; StateLost if the cache was cut
        since (a position the snapshot kept may have been rewritten)."""
        if self._cuts != snap.cuts or snap.length > self.length:
            raise StateLost(f"KV cache: cannot restore position {snap.length} (the cache was cut back since)")
        self._length = snap.length
