"""Per-sequence KV cache, f16 or int8 (one scale per head and token).

Storage grows by doubling up to the context limit, so a 262144-token `--max-context` costs
nothing until a sequence is that long. `truncate(n)` rolls back rejected speculative
positions: entries past n are simply forgotten and overwritten later.
"""

from __future__ import annotations

from typing import Any

from strata.errors import StrataError


class KVCache:
    def __init__(self, xp: Any, n_layer: int, n_kv: int, head_dim: int, max_ctx: int, kind: str = "f16",
                 initial: int = 256):
        if kind not in ("f16", "int8"):
            raise StrataError(f"--kv {kind}: expected f16 or int8")
        self.xp = xp
        self.n_layer, self.n_kv, self.d = n_layer, n_kv, head_dim
        self.max_ctx = max_ctx
        self.kind = kind
        self.length = 0  # positions [0, length) are valid in every layer
        self._cap = 0
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
    def _alloc(self, cap: int):
        xp = self.xp
        dt = xp.float16 if self.kind == "f16" else xp.int8
        shape = (self.n_kv, cap, self.d)
        return xp.zeros(shape, dt), xp.ones((self.n_kv, cap), xp.float32) if self.kind == "int8" else None

    def _grow(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = max(need, min(self.max_ctx, max(self._cap * 2, 16)))
        for name in ("_k", "_v"):
            arrs = getattr(self, name)
            scales = getattr(self, name + "s")
            for layer in range(self.n_layer):
                a, s = self._alloc(cap)
                if layer < len(arrs):
                    a[:, : self._cap] = arrs[layer][:, : self._cap]
                    if s is not None:
                        s[:, : self._cap] = scales[layer][:, : self._cap]
                    arrs[layer] = a
                    if s is not None:
                        scales[layer] = s
                else:
                    arrs.append(a)
                    if s is not None:
                        scales.append(s)
        if self._shadow:
            for shadows in (self._kd, self._vd):
                for layer in range(self.n_layer):
                    a = self.xp.zeros((self.n_kv, cap, self.d), self.xp.float32)
                    if layer < len(shadows):
                        a[:, : self._cap] = shadows[layer][:, : self._cap]
                        shadows[layer] = a
                    else:
                        shadows.append(a)
        self._cap = cap

    @property
    def nbytes(self) -> int:
        total = sum(int(a.nbytes) for a in self._k + self._v + self._kd + self._vd)
        return total + sum(int(a.nbytes) for a in self._ks + self._vs)

    # --- access ---------------------------------------------------------------------------
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

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)
