"""What a pack holds, summarised: tensors grouped by role over layers, by type, and the
metadata a reader wants first. Used by `strata inspect` (text and JSON)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from strata.kernels.ggml_types import type_by_id

_LAYER = re.compile(r"^(?P<prefix>.*?\bblk)\.(?P<layer>\d+)\.(?P<rest>.+)$")


def role_of(name: str) -> str:
    """blk.7.ffn_down_exps.weight -> blk.*.ffn_down_exps ; output_norm.weight -> output_norm."""
    m = _LAYER.match(name)
    role = f"{m['prefix']}.*.{m['rest']}" if m else name
    return role[: -len(".weight")] if role.endswith(".weight") else role


@dataclass
class RoleGroup:
    role: str
    count: int = 0
    nbytes: int = 0
    weights: int = 0
    types: Counter = field(default_factory=Counter)
    shapes: set = field(default_factory=set)

    def type_text(self) -> str:
        return ", ".join(f"{name} x{n}" for name, n in self.types.most_common())

    def shape_text(self) -> str:
        if len(self.shapes) != 1:
            return "mixed"
        return "[" + ", ".join(map(str, next(iter(self.shapes)))) + "]"

    def as_dict(self) -> dict:
        return {
            "role": self.role,
            "tensors": self.count,
            "types": dict(self.types.most_common()),
            "bytes": self.nbytes,
            "weights": self.weights,
            "shape": [list(s) for s in sorted(self.shapes)],
        }


def group_by_role(tensors) -> list[RoleGroup]:
    """Groups in first-seen order, non-layer tensors first."""
    groups: dict[str, RoleGroup] = {}
    for info in tensors:
        g = groups.setdefault(role_of(info.name), RoleGroup(role_of(info.name)))
        g.count += 1
        g.nbytes += info.nbytes
        g.weights += info.n_elements
        g.types[type_by_id(info.ggml_type).name] += 1
        g.shapes.add(tuple(info.shape))
    return sorted(groups.values(), key=lambda g: "*" in g.role)


def group_by_type(tensors) -> list[dict]:
    rows: dict[str, dict] = {}
    for info in tensors:
        name = type_by_id(info.ggml_type).name
        r = rows.setdefault(name, {"type": name, "tensors": 0, "bytes": 0, "weights": 0})
        r["tensors"] += 1
        r["bytes"] += info.nbytes
        r["weights"] += info.n_elements
    for r in rows.values():
        r["bits_per_weight"] = round(8 * r["bytes"] / r["weights"], 3) if r["weights"] else 0.0
    return sorted(rows.values(), key=lambda r: -r["bytes"])


# summary field -> metadata key suffix after "{arch}."
_ARCH_FIELDS = {
    "layers": "block_count",
    "embedding": "embedding_length",
    "feed_forward": "feed_forward_length",
    "heads": "attention.head_count",
    "kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "experts": "expert_count",
    "experts_used": "expert_used_count",
    "expert_feed_forward": "expert_feed_forward_length",
    "context": "context_length",
    "rope_freq_base": "rope.freq_base",
}


def metadata_summary(metadata: dict) -> dict:
    arch = metadata.get("general.architecture")
    out = {"arch": arch, "name": metadata.get("general.name")}
    for label, suffix in _ARCH_FIELDS.items():
        value = metadata.get(f"{arch}.{suffix}")
        if value is not None:
            out[label] = value
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else metadata.get(f"{arch}.vocab_size")
    if vocab is not None:
        out["vocab_size"] = vocab
    for label, key in (("tokenizer", "tokenizer.ggml.model"), ("pre_tokenizer", "tokenizer.ggml.pre")):
        if key in metadata:
            out[label] = metadata[key]
    out["chat_template"] = "tokenizer.chat_template" in metadata
    if "split.count" in metadata:
        out["split_count"] = metadata["split.count"]
    return {k: printable(v) for k, v in out.items()}


def printable(value):
    """Bytes that are not UTF-8 (kept by the reader as surrogates) as \\xNN escapes: a corrupt
    pack's listing must print, not fail on the terminal's encoding."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return value
