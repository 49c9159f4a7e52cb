"""The start-up capability probe: can every tensor of this pack run on the chosen backend?

Run once before any slot is admitted. It walks every tensor of the pack and of the MTP draft,
gives each a role (its name with the layer number replaced by `*`), and checks each against the
native kernel table for every path that uses it:

  decode  every model tensor, 1..parallel columns (one token per slot per window)
  verify  every model tensor, up to parallel * (spec + 1) columns (batch-MTP verification windows)
  draft   the draft's tensors plus the model's output head and token embedding (shared), 1 per slot

Each (tensor, path) is "native" (a native kernel; wider windows split into launches of at most
max_cols columns), "generic" (dequantize + matmul) or "cannot run" (no dequantizer and no kernel,
or a type id Strata does not know). From that and the engine flags it decides, per slot, whether
batch-MTP is on, and says so in ONE start-up line, so a pack the native kernels cannot verify in
batches degrades to one token per slot in shared windows (each slot still drafts while it is the
only one busy) instead of failing at the first concurrent admission.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from strata.kernels.ggml_types import type_by_id
from strata.kernels.native_table import NativeTable

NATIVE, GENERIC, CANNOT_RUN = "native", "generic", "cannot run"
PATHS = ("decode", "verify", "draft")
FLOAT_MATMUL_TYPES = frozenset({"F32", "F16", "BF16"})

# reason code -> the words of the start-up line (the code is what metrics carry)
REASONS: dict[str, str] = {
    "not_requested": "--batch-mtp not given",
    "single_slot": "only one slot (--parallel 1): there is nothing to batch",
    "no_draft": "no MTP draft (needs --spec > 0 and a draft: --mtp or nextn tensors in the pack)",
    "multi_gpu": "the model is split over {n_gpus} GPUs (batch-MTP needs one GPU)",
    "no_room": "no room for this slot's private MTP state ({per_slot} per slot, {free} free)",
    "no_checkpoint": "no rollback copy of the recurrent state (--state-checkpoints, or no memory for one)",
    "no_native_kernel": "{groups} ({why})",
    "cannot_run": "the pack cannot run on {backend}",
}

# reason code -> what a slot without batch-MTP does instead, (one slot, several): the end of its
# clause in the start-up line. Without batch-MTP a slot still drafts and verifies on its own
# (the one-slot proposer) in any window where no other slot is busy; only a window it shares
# adds one token for it (strata/batch/scheduler.py, _mtp_allowed).
INSTEAD: dict[str, tuple[str, str]] = {
    "single_slot": ("it drafts and verifies on its own in every window, as without --batch-mtp",
                    "each drafts and verifies on its own in every window, as without --batch-mtp"),
    "no_draft": ("it decodes one token per window", "they decode one token per window"),
    "no_checkpoint": ("it never drafts: one token per window", "they never draft: one token per window"),
}
SHARED_WINDOWS_ONLY = ("it drafts only in windows where no other slot is busy, and adds one token per "
                       "window shared with other slots",
                       "each drafts only in windows where no other slot is busy, and adds one token per "
                       "window shared with other slots")


def instead(code: str | None, n_slots: int) -> str:
    """What n_slots slots that lack batch-MTP for reason `code` do instead (INSTEAD)."""
    one, many = INSTEAD.get(code or "", SHARED_WINDOWS_ONLY)
    return one if n_slots == 1 else many


_LAYER = re.compile(r"(?<=\.)\d+(?=\.)")  # a dotted all-digit component: blk.12.x -> blk.*.x
_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")


def role_of(name: str) -> str:
    """`blk.12.ffn_down_exps.weight` -> `blk.*.ffn_down_exps` (the '.weight' suffix dropped)."""
    role = _LAYER.sub("*", name)
    return role[: -len(".weight")] if role.endswith(".weight") else role


def is_draft_name(name: str) -> bool:
    return name.startswith("mtp.") or bool(_NEXTN.match(name))


def draft_names_in(tensors: Mapping[str, tuple]) -> set[str]:
    """The draft's tensors inside a pack: `mtp.*`, and every tensor of a nextn layer (a layer N
    with `blk.N.nextn.*` tensors is the draft's block, not part of the main model's decode)."""
    layers = {m.group(1) for n in tensors if (m := _NEXTN.match(n))}
    prefixes = tuple(f"blk.{n}." for n in layers)
    return {n for n in tensors if n.startswith("mtp.") or (prefixes and n.startswith(prefixes))}


def _default_dequantizable(type_id: int) -> bool:
    """True when strata.kernels.dequant has a dequantizer for the type."""
    try:
        from strata.kernels.dequant import DEQUANTIZERS
    except ImportError:  # dequant not importable: only plain float storage is known to work
        t = type_by_id(type_id)
        return t is not None and t.name in ("F32", "F16", "BF16")
    t = type_by_id(type_id)
    return type_id in DEQUANTIZERS or (t is not None and t.name in DEQUANTIZERS)


@dataclass(frozen=True)
class PathStatus:
    status: str  # native | generic | cannot run
    ncols: int  # columns a window puts through this tensor on this path
    launches: int = 1  # native launches those columns need (ceil(ncols / max_cols))
    why: str = ""  # for generic / cannot run: the missing piece


@dataclass
class TensorReport:
    name: str
    role: str
    type_id: int
    type_name: str
    shape: tuple[int, ...]
    op: str  # matvec | lookup | elementwise
    draft: bool
    paths: dict[str, PathStatus] = field(default_factory=dict)


@dataclass
class SlotCapability:
    slot: int
    batch_mtp: bool
    reason: str | None  # the human words; None when batch-MTP is on
    tensors: list[str] = field(default_factory=list)  # tensors that keep it off (no_native_kernel)
    reason_code: str | None = None  # short machine name for metrics


def _type_name(type_id: int) -> str:
    t = type_by_id(type_id)
    return t.name if t else f"unknown type {type_id}"


# tensors read by row or by tap, never as a mat-vec (name suffix -> op)
NOT_MATVEC = {
    "ssm_conv1d.weight": "elementwise",  # a DeltaNet layer's conv taps (F32), read by the conv kernel
    "ple_conv1d.weight": "elementwise",  # the n-gram layer's dilated depthwise conv taps
    "per_layer_token_embd.weight": "lookup",  # the n-gram table: 16 rows gathered per token by hash
}


def _op_of(name: str, shape: Sequence[int], has_output_head: bool) -> str:
    """How the engine uses the tensor: only mat-vecs need a native kernel."""
    dims = [d for d in shape]
    if len(dims) <= 1 or all(d == 1 for d in dims[1:]):
        return "elementwise"  # norms, biases, scales: read whole, no mat-vec
    if name.startswith("token_embd") and has_output_head:
        return "lookup"  # rows gathered by token id; tied embeddings are also the output head
    return next((op for suffix, op in NOT_MATVEC.items() if name.endswith(suffix)), "matvec")


def _classify(table: NativeTable, backend: str, type_id: int, op: str, ncols: int,
              dequantizable: Callable[[int], bool]) -> PathStatus:
    t = type_by_id(type_id)
    if t is None:
        return PathStatus(CANNOT_RUN, ncols, why=f"unknown GGML type id {type_id}")
    if op != "matvec":
        # lookups and elementwise reads only need the values: any dequantizer will do
        if dequantizable(type_id) or table.lookup(backend, type_id):
            return PathStatus(NATIVE, ncols, why=op)
        return PathStatus(CANNOT_RUN, ncols, why=f"no dequantizer for {t.name}")
    k = table.lookup(backend, type_id)
    if k is not None:
        return PathStatus(NATIVE, ncols, k.launches(ncols))
    if t.name in FLOAT_MATMUL_TYPES:
        # a float matrix needs no quantized kernel: every backend's float matmul takes any width
        return PathStatus(NATIVE, ncols, why="float matmul")
    if dequantizable(type_id):
        return PathStatus(GENERIC, ncols, why=f"no native MMVQ kernel for {t.name} on {backend}")
    return PathStatus(CANNOT_RUN, ncols, why=f"no native kernel and no dequantizer for {t.name}")


def slot_ranges(slots: Sequence[int]) -> str:
    """[0,1,2,5] -> 'slots 0-2, 5'; [3] -> 'slot 3'."""
    parts, start, prev = [], None, None
    for s in sorted(slots):
        if start is None:
            start = prev = s
        elif s == prev + 1:
            prev = s
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = s
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    word = "slot" if len(slots) == 1 else "slots"
    return f"{word} {', '.join(parts)}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def group_tensors(reports: Sequence[TensorReport], limit: int = 4) -> str:
    """'48 tensors blk.*.ffn_down_exps are Q2_0, 1 tensor output is IQ4_NL' (most frequent first)."""
    counts = Counter((r.role, r.type_name) for r in reports)
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    words = [f"{n} tensor{'s' if n != 1 else ''} {role} {'are' if n != 1 else 'is'} {tname}"
             for (role, tname), n in items[:limit]]
    if len(items) > limit:
        rest = sum(n for _, n in items[limit:])
        words.append(f"and {rest} more tensor{'s' if rest != 1 else ''} in {len(items) - limit} more groups")
    return ", ".join(words)


@dataclass
class ProbeReport:
    backend: str
    parallel: int
    spec: int
    batch_mtp_requested: bool
    tensors: list[TensorReport]
    slots: list[SlotCapability]
    notes: list[str] = field(default_factory=list)  # e.g. window splits

    @property
    def can_run(self) -> bool:
        """False only when some tensor on the decode path cannot run at all."""
        return not self.blocking("decode", (CANNOT_RUN,))

    def blocking(self, path: str, statuses: tuple[str, ...] = (GENERIC, CANNOT_RUN)) -> list[TensorReport]:
        return [t for t in self.tensors if path in t.paths and t.paths[path].status in statuses]

    def fallback_reason_code(self, slot: int) -> str | None:
        """Why slot runs without batch-MTP (None when it has it)."""
        return self.slots[slot].reason_code

    @property
    def fallback_reason_codes(self) -> dict[int, str | None]:
        return {s.slot: s.reason_code for s in self.slots}

    def startup_lines(self) -> list[str]:
        """The start-up line(s): one line about batch-MTP when it was asked for, plus a line when
        the pack cannot run. Nothing when --batch-mtp was not given and the pack runs."""
        lines = []
        if not self.can_run:
            bad = self.blocking("decode", (CANNOT_RUN,))
            lines.append(f"strata probe: the pack cannot run on {self.backend}: {group_tensors(bad)} "
                         f"({bad[0].paths['decode'].why})")
        if not self.batch_mtp_requested:
            return lines
        on = [s.slot for s in self.slots if s.batch_mtp]
        off = [s for s in self.slots if not s.batch_mtp]
        head = f"strata probe: batch-MTP on for {slot_ranges(on)}" if on else ""
        if on and not off:
            return lines + [f"{head} ({self._on_detail()})"]
        # one line: every off slot shares its reason except when room ran out part way; each
        # reason's clause says what its slots do instead
        by_reason: dict[str, list[SlotCapability]] = {}
        for s in off:
            by_reason.setdefault(s.reason or "", []).append(s)
        clauses = [f"batch-MTP off for {slot_ranges([s.slot for s in ss])}: {why}; "
                   f"{instead(ss[0].reason_code, len(ss))}" for why, ss in by_reason.items()]
        text = "; ".join(([head[len('strata probe: '):]] if head else []) + clauses)
        return lines + [f"strata probe: {text}"]

    def _on_detail(self) -> str:
        verify = [t.paths["verify"] for t in self.tensors if "verify" in t.paths]
        launches = max((p.launches for p in verify), default=1)
        cols = self.parallel * (self.spec + 1)
        split = f", split into {launches} launches" if launches > 1 else ""
        return (f"{self.backend}: every verify and draft tensor has a native kernel; "
                f"verification windows of up to {cols} columns{split}")

    def summary_rows(self) -> list[dict]:
        """One row per (role, type, op): count and the status on each path that uses it."""
        groups: dict[tuple, dict] = {}
        for t in self.tensors:
            key = (t.role, t.type_name, t.op, tuple((p, s.status) for p, s in t.paths.items()))
            g = groups.setdefault(key, {"role": t.role, "type": t.type_name, "op": t.op, "count": 0,
                                        **{p: s.status for p, s in t.paths.items()}})
            g["count"] += 1
        return sorted(groups.values(), key=lambda g: (g["role"], g["type"]))

    def format_table(self) -> str:
        rows = self.summary_rows()
        header = ("role", "type", "op", "count") + PATHS
        cells = [[str(r.get(h, "-")) for h in header] for r in rows]
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([fmt.format(*header)] + [fmt.format(*c) for c in cells])

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "parallel": self.parallel,
            "spec": self.spec,
            "batch_mtp_requested": self.batch_mtp_requested,
            "can_run": self.can_run,
            "slots": [{"slot": s.slot, "batch_mtp": s.batch_mtp, "reason": s.reason,
                       "reason_code": s.reason_code, "tensors": s.tensors} for s in self.slots],
            "groups": self.summary_rows(),
            "tensors": [{"name": t.name, "role": t.role, "type": t.type_name, "type_id": t.type_id,
                         "shape": list(t.shape), "op": t.op, "draft": t.draft,
                         "paths": {p: {"status": s.status, "ncols": s.ncols, "launches": s.launches,
                                       **({"why": s.why} if s.why else {})}
                                   for p, s in t.paths.items()}}
                        for t in self.tensors],
            "notes": self.notes,
            "lines": self.startup_lines(),
        }


def _tensor_reports(tensors: Mapping[str, tuple], draft_tensors: Mapping[str, tuple] | None,
                    parallel: int, spec: int, backend: str, table: NativeTable,
                    dequantizable: Callable[[int], bool]) -> list[TensorReport]:
    verify_cols = parallel * (spec + 1)
    draft_names = set(draft_tensors or ()) | draft_names_in(tensors)
    model = {n: v for n, v in tensors.items() if n not in draft_names}
    draft = {n: v for n, v in tensors.items() if n in draft_names}
    draft.update(draft_tensors or {})
    has_head = any(n.startswith("output.") or n == "output" for n in model)
    shared = {n for n in model if n.startswith(("output.", "token_embd."))} if draft else set()

    out = []
    for name, (type_id, shape) in list(model.items()) + list(draft.items()):
        is_draft = name in draft
        op = _op_of(name, shape, has_head or is_draft)
        r = TensorReport(name, role_of(name), int(type_id), _type_name(type_id), tuple(shape), op, is_draft)
        if not is_draft:
            r.paths["decode"] = _classify(table, backend, type_id, op, parallel, dequantizable)
            r.paths["verify"] = _classify(table, backend, type_id, op, verify_cols, dequantizable)
        if is_draft or name in shared:
            r.paths["draft"] = _classify(table, backend, type_id, op, parallel, dequantizable)
        out.append(r)
    return out


def run_probe(tensors: Mapping[str, tuple], draft_tensors: Mapping[str, tuple] | None,
              backend: str, table: NativeTable, *, parallel: int, spec: int, batch_mtp: bool,
              n_gpus: int = 1, mtp_state_bytes_per_slot: int = 0,
              free_bytes: int | None = None, checkpoints: int | None = None,
              dequantizable: Callable[[int], bool] | None = None) -> ProbeReport:
    """Check every tensor (name -> (ggml type id, shape)) against the table; decide batch-MTP per slot.

    parallel, spec, batch_mtp: the engine's --parallel, --spec and --batch-mtp, as plain values
    (this floor knows no options object). The draft exists when it
    has tensors (draft_tensors, or nextn tensors among `tensors`) and --spec > 0. checkpoints: a
    hybrid model's slots [0, checkpoints) keep a rollback copy of their recurrent state
    (strata/engine/checkpoints.py; None: every slot); the others never draft, with or without
    --batch-mtp, which their reason (no_checkpoint) says wherever a draft could run.
    """
    deq = dequantizable or _default_dequantizable
    parallel = max(1, int(parallel))
    spec = max(0, int(spec))
    reports = _tensor_reports(tensors, draft_tensors, parallel, spec, backend, table, deq)
    has_draft = spec > 0 and any(r.draft for r in reports)
    rep = ProbeReport(backend, parallel, spec, bool(batch_mtp), reports, [])

    def all_slots(code: str, tensors_: list[str] = (), **fmt) -> list[SlotCapability]:
        why = REASONS[code].format(**fmt)
        return [SlotCapability(i, False, why, list(tensors_), code) for i in range(parallel)]

    blockers = [r for r in reports for p in ("verify", "draft")
                if p in r.paths and r.paths[p].status != NATIVE]
    blockers = list({id(r): r for r in blockers}.values())  # a tensor on both paths counts once
    if not rep.can_run:
        rep.slots = all_slots("cannot_run", backend=backend)
    elif not batch_mtp:
        rep.slots = all_slots("not_requested")
    elif not has_draft:  # (before single_slot: that one's line says the slot drafts)
        rep.slots = all_slots("no_draft")
    elif parallel <= 1:
        rep.slots = all_slots("single_slot")
    elif n_gpus != 1:
        rep.slots = all_slots("multi_gpu", n_gpus=n_gpus)
    elif blockers:
        kinds = {r.paths.get("verify", r.paths.get("draft")).status for r in blockers}
        why = f"no native MMVQ kernel on {backend}" if kinds == {GENERIC} else \
            f"no native MMVQ kernel on {backend}; some cannot run at all"
        if backend in table.unavailable and not table.kernels(backend):
            why += f"; {backend} kernels {table.unavailable[backend]}"
        rep.slots = all_slots("no_native_kernel", [r.name for r in blockers],
                              groups=group_tensors(blockers), why=why)
    else:
        room = parallel
        if free_bytes is not None and mtp_state_bytes_per_slot > 0:
            room = min(parallel, max(0, free_bytes) // mtp_state_bytes_per_slot)
        why = REASONS["no_room"].format(per_slot=_mib(mtp_state_bytes_per_slot),
                                        free=_mib(free_bytes or 0))
        rep.slots = [SlotCapability(i, True, None, [], None) if i < room
                     else SlotCapability(i, False, why, [], "no_room") for i in range(parallel)]
    if rep.can_run and has_draft and checkpoints is not None:
        for i in range(checkpoints, parallel):  # (more telling than not_requested: no MTP at all there)
            rep.slots[i] = SlotCapability(i, False, REASONS["no_checkpoint"], [], "no_checkpoint")

    for path, cols in (("decode", parallel), ("verify", parallel * (spec + 1))):
        split = max((r.paths[path].launches for r in reports if path in r.paths
                     and r.paths[path].status == NATIVE and r.op == "matvec"), default=1)
        if split > 1:
            rep.notes.append(f"{path}: windows of {cols} columns run as up to {split} native launches each")
    return rep


def tensor_map(infos: Mapping[str, object]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (ggml type id, shape) from a pack's or draft's TensorInfo mapping."""
    return {name: (int(t.ggml_type), tuple(t.shape)) for name, t in infos.items()}
