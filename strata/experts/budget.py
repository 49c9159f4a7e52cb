"""`--expert-cache auto|off|SIZE|N%` as slots: which tensors are experts, which layers share a
pool, and how many slots each pool gets.

SIZE is bytes of the device given to the pool (512MiB, 20GiB; KB/MB/GB/TB are powers of ten),
N% a share of the experts (12.5% allowed); either caches the same share of each pool's experts, at
least one slot each. `auto` fills what the device has left after everything else (auto_budget;
the engine estimates the rest: strata/engine/expert_room.py); `off` keeps every expert resident.
A pool that would hold every expert is no pool: the experts load resident, as without the flag.
Sizes are the backend's (Backend.expert_bytes): quantized blocks on the GPU, float32 on the CPU.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from strata.experts.cache import GroupSpec, PoolSizes, PoolSpec
from strata.kernels.ggml_types import type_by_id
from strata.units import size_text

GiB = 1 << 30
UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
MAX_BYTES = 1 << 50
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]+)\s*$")
# the device memory auto leaves free beyond its estimate of the rest (allocator slack, workspaces)
AUTO_MARGIN = 1 << 30


@dataclass(frozen=True)
class CacheRequest:
    kind: str  # "auto", "off", "bytes" or "share"
    value: float = 0.0  # bytes, or the share in (0, 1]

    def __str__(self) -> str:
        if self.kind == "bytes":
            return f"{self.value / GiB:.2f} GiB"
        if self.kind == "share":
            return f"{self.value * 100:g}%"
        return self.kind


def parse_cache_request(text: str) -> CacheRequest:
    """The flag's value; ValueError says what is expected."""
    v = text.strip().lower()
    if v in ("auto", "off"):
        return CacheRequest(v)
    expected = "auto, off, a size with its unit (512MiB, 20GiB) or a share of the experts (50%)"
    if v.endswith("%"):
        try:
            share = float(v[:-1])
        except ValueError:
            raise ValueError(f"expected {expected}, got {text!r}") from None
        if not 0 < share <= 100:
            raise ValueError(f"a share of the experts must be in (0%, 100%], got {text!r}")
        return CacheRequest("share", share / 100.0)
    m = _SIZE.match(v)
    if m is None or m.group(2) not in UNITS:
        raise ValueError(f"expected {expected}, got {text!r}")
    n = float(m.group(1)) * UNITS[m.group(2)]
    if not 0 < n <= MAX_BYTES:
        raise ValueError(f"a size must be in (0, 1 PiB], got {text!r}")
    return CacheRequest("bytes", n)


@dataclass(frozen=True)
class ExpertTensor:
    name: str
    group: str  # the layer's tensor prefix ("blk.3.")
    role: str  # ffn_gate_exps, ffn_up_exps, ffn_gate_up_exps or ffn_down_exps
    n_expert: int
    expert_bytes: int  # one expert of it on the device (resident or in a slot)
    block_bytes: int = 0  # all of its experts' GGUF blocks (the pack's bytes)


_ROLE = re.compile(r"^(.*?)(ffn_(?:gate_up|gate|up|down)_exps)\.weight$")


def split_expert_name(name: str) -> tuple[str, str] | None:
    """'blk.3.ffn_down_exps.weight' -> ('blk.3.', 'ffn_down_exps'); None for a tensor that is not
    an expert tensor (moe.py's names)."""
    m = _ROLE.match(name)
    return (m.group(1), m.group(2)) if m else None


def expert_tensors(infos: Iterable, expert_bytes: Callable[[int, tuple[int, ...]], int]) -> list[ExpertTensor]:
    """The expert tensors among pack tensors (name, ggml_type, shape ne [in, out, n_expert])."""
    out = []
    for t in infos:
        parts = split_expert_name(t.name)
        if parts is None or len(t.shape) != 3:
            continue
        shape = tuple(int(x) for x in t.shape)
        gtype = type_by_id(t.ggml_type)
        blocks = gtype.row_bytes(shape[0]) * shape[1] * shape[2] if gtype is not None else 0
        out.append(ExpertTensor(t.name, parts[0], parts[1], shape[2], int(expert_bytes(t.ggml_type, shape)), blocks))
    return out


@dataclass(frozen=True)
class CachePlan(PoolSizes):
    pools: tuple[PoolSpec, ...]
    groups: tuple[GroupSpec, ...]
    request: CacheRequest
    expert_bytes: int  # every expert's bytes
    pool_bytes: int  # the slots'
    block_bytes: int = 0  # every pooled tensor's GGUF blocks
    tensors: tuple[str, ...] = ()  # the pooled tensors' names

    def line(self, slots: str, blocks: str, why: str = "") -> str:
        """The start-up line: how many slots of how many experts, in GiB, where the slots are
        (`slots`) and where every expert's blocks stay (`blocks`: the backend's words), and
        `why` (auto's arithmetic) when given."""
        line = (f"strata: experts: {self.n_slots} slot{'s' if self.n_slots != 1 else ''} of {self.n_units} "
                f"({size_text(self.pool_bytes, gib_digits=2)}) {slots}; every expert's blocks ({size_text(self.block_bytes, gib_digits=2)}) {blocks} "
                f"(--expert-cache {self.request}, {len(self.pools)} "
                f"pool{'s' if len(self.pools) != 1 else ''} over {len(self.groups)} layers)")
        return line + (f"; {why}" if why else "")


def plan_cache(tensors: Sequence[ExpertTensor], request: CacheRequest, auto_bytes: int | None = None) -> CachePlan | None:
    """Slots per pool for the request (auto: auto_bytes of budget, None: all resident); None when
    every expert stays resident (off, auto with room for all, or a pool that holds them all)."""
    groups: dict[str, dict[str, ExpertTensor]] = {}
    for t in tensors:
        groups.setdefault(t.group, {}).setdefault(t.role, t)  # a role's first tensor (the store pools that one)
    if not groups or request.kind == "off":
        return None
    layouts: dict[tuple, list[str]] = {}
    for name, roles in groups.items():
        key = tuple(sorted((r, t.expert_bytes) for r, t in roles.items()))
        layouts.setdefault(key, []).append(name)
    unit_bytes = {k: sum(b for _, b in k) for k in layouts}
    n_expert = {name: max(t.n_expert for t in roles.values()) for name, roles in groups.items()}
    total = sum(unit_bytes[k] * sum(n_expert[g] for g in names) for k, names in layouts.items())
    if request.kind == "share":
        share = request.value
    elif request.kind == "bytes":
        share = request.value / total
    elif auto_bytes is None:
        return None
    else:
        share = auto_bytes / total
    pools, specs, pool_bytes = [], [], 0
    all_fit = True
    for p, (key, names) in enumerate(layouts.items()):
        units = sum(n_expert[g] for g in names)
        slots = min(units, max(1, math.floor(share * units + 1e-9)))
        all_fit &= slots == units
        pools.append(PoolSpec(slots, unit_bytes[key]))
        pool_bytes += slots * unit_bytes[key]
        specs += [(g, p) for g in names]
    if all_fit:
        return None
    order = list(groups)  # the pack's order of layers
    group_specs = tuple(GroupSpec(g, n_expert[g], p) for g, p in sorted(specs, key=lambda s: order.index(s[0])))
    pooled = [t for roles in groups.values() for t in roles.values()]
    return CachePlan(tuple(pools), group_specs, request, total, pool_bytes,
                     sum(t.block_bytes for t in pooled), tuple(t.name for t in pooled))


def auto_budget(free: int | None, other: int, margin: int = AUTO_MARGIN) -> int | None:
    """Device bytes auto gives the pool: what is free after the other weights, the KV caches, the
    recurrent state and the draft (`other`, an estimate) and a margin; None where free memory is
    unknown (then every expert stays resident)."""
    if free is None:
        return None
    return max(0, free - other - margin)
