"""The qwen4exp MTP layer's tensor names: the one layout Strata reads, and the names other
writers give the same tensors, mapped onto it.

The checkpoint (Qwen/Qwen3.8-Flash-Next) ships the layer as 31 `mtp.*` tensors:
`mtp.fc_embedding`, `mtp.fc_hidden` (two [E, E] input projections), `mtp.pre_fc_norm_embedding`
[E], `mtp.pre_fc_norm_hidden` [hc*E] (one norm over all four streams), `mtp.hyper_connection_mixer.
{hc_norm, input_mix_weight_down, input_mix_weight_up}` (the layer's own exit mixer) and
`mtp.layers.0.*` (one QSA decoder layer: 2 hyper-connections, attention with its indexer, 512-expert
MoE with the gated shared expert). llama.cpp's converter at 0c1e57098 drops them
(`conversion/qwen4exp.py:28-30`). What the GGUF writers that keep them name them:

| source | input projection | exit mixer | norms | layer |
|---|---|---|---|---|
| ggml-org/llama.cpp#27836 (open) | `nextn.eh_proj` [2E, E]: `[fc_embedding, fc_hidden]`, embedding columns first | `nextn.hc_head_{norm,down,up}` | `nextn.enorm`, `nextn.hnorm` | trunk names, block N = n_layer |
| ggml-org/llama.cpp#28243 (open) | as #27836 | as #27836 | as #27836 | as #27836; its MTP-only file also carries `token_embd`, `output`, `output_hc_*` |
| ggml-org/llama.cpp#28610 (closed) | `nextn.embed_proj` + `nextn.hidden_proj`, [E, E] each | `nextn.hc_head_{norm,down,up}` | as #27836 | as #27836 |
| drluoto/llama.cpp `frspec-qwen4exp-strix` (the FR-Spec head) | `nextn.fc_embd` + `nextn.fc_hidden` | `nextn.hc_{norm,down,up}` | as #27836 | as #27836 |

Where each row was read (the pull requests' diffs are not stored where this was written; their
forks and threads are):
- #27836: its port turbo-tan/llama.cpp-tq3#81, `conversion/qwen4exp.py` (the mixer renamed onto the
  trailing block, `fc_embedding`/`fc_hidden` concatenated into `eh_proj` embedding-first); a
  review in ikawrakow/ik_llama.cpp#2369 that names #27836's per-block mixer `nextn.hc_head_*`.
- #28243: its review hunk at `conversion/qwen4exp.py:48` (the same per-block mixer rename as
  #27836); the MTP GGUF its author's organisation publishes (unsloth, Q8_0, 37 tensors: the
  layer's 26, the six `nextn.*`, `output_hc_*`, `token_embd`, `output`), as a public comparison
  table with the FR-Spec file lists it (an attribution by author).
- #28610: a stored `src/models/qwen4exp.cpp` with its draft graph and `h_nextn` export, loading
  `LLM_TENSOR_NEXTN_EMBED_PROJ` / `LLM_TENSOR_NEXTN_HIDDEN_PROJ` as `{n_embd, n_embd}` beside
  `NEXTN_HC_HEAD_*` (an attribution by those features, not by the pull request's own diff).
- FR-Spec: the public scripts that convert its head to #27836's names (its `nextn.hc_*` renamed to
  `nextn.hc_head_*`, its two projections joined into `nextn.eh_proj`). Its `d2t` vocabulary map
  and 65536-row `output` belong to a vocabulary-trimmed head, not supported here.
ikawrakow/ik_llama.cpp#2369 first read names of its own (`mtp.fc_embd`, `mtp.mixer_norm`, ...); a
review there points to the `blk.N.nextn.*` names the published heads carry. They are not accepted.

**Chosen layout: #27836's.** It is what the published MTP GGUFs carry; its fused `eh_proj`,
`enorm`, `hnorm` are the nextn names Strata already reads for qwen35 / qwen3next
(strata/mtp/draft.py `_NEXTN_NAMES`); and every other row maps onto it by renaming, the split
projections by joining their input columns (embedding half first, the order the converter of
#27836 writes). An MTP-only GGUF holds `blk.N.nextn.*` and block N's layer tensors under the trunk's
names, N = the target's block_count, and may carry the target's `token_embd`, `output`,
`output_hc_*` (written so llama.cpp can load the file alone; the draft uses the target's own).
Nextn tensors inside a pack use the same names at block N. Gammas are stored as 1 + w, as in
the rest of the pack.

`map_mtp_names` reads a file's tensor names into the canonical ones; an unknown name, two
names for one tensor, names of two layouts in one file, or a missing one is one line naming the
file and the tensor. `canonical_tensors` gives the tensors themselves under the canonical names,
the split projection's halves joined into one eh_proj (JoinedColumns), as the draft loads them
(strata/mtp/draft.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata.errors import StrataError
from strata.kernels.ggml_types import type_by_id

EMBED, HIDDEN = "embed", "hidden"  # the halves of the input projection: its input columns [0, E) and [E, 2E)
EH_PROJ = "nextn.eh_proj.weight"

# the canonical nextn tensors (suffixes after "blk.N."), ggml shapes with E = embedding_length,
# W = hc * E (the four streams), r = the hyper-connection low rank
CANONICAL: dict[str, str] = {
    EH_PROJ: "[2E, E]",
    "nextn.enorm.weight": "[E]",
    "nextn.hnorm.weight": "[W]",  # (#27836's loader also takes it as [E, hc]: the same values)
    "nextn.hc_head_norm.weight": "[W]",
    "nextn.hc_head_down.weight": "[W, r]",
    "nextn.hc_head_up.weight": "[r, W]",
}


@dataclass(frozen=True)
class Layout:
    """One writer's names for the nextn tensors: file suffix -> (canonical suffix, half or None)."""

    name: str
    names: dict[str, tuple[str, str | None]]


def _same(*suffixes: str) -> dict[str, tuple[str, str | None]]:
    return {s: (s, None) for s in suffixes}


_NORMS = _same("nextn.enorm.weight", "nextn.hnorm.weight")
_HC_HEAD = _same("nextn.hc_head_norm.weight", "nextn.hc_head_down.weight", "nextn.hc_head_up.weight")

LAYOUTS: tuple[Layout, ...] = (
    Layout("ggml-org/llama.cpp#27836", {**_same(EH_PROJ), **_NORMS, **_HC_HEAD}),
    Layout("ggml-org/llama.cpp#28243", {**_same(EH_PROJ), **_NORMS, **_HC_HEAD}),
    Layout("ggml-org/llama.cpp#28610", {"nextn.embed_proj.weight": (EH_PROJ, EMBED),
                               "nextn.hidden_proj.weight": (EH_PROJ, HIDDEN), **_NORMS, **_HC_HEAD}),
    Layout("FR-Spec (drluoto)", {"nextn.fc_embd.weight": (EH_PROJ, EMBED), "nextn.fc_hidden.weight": (EH_PROJ, HIDDEN),
                                 "nextn.hc_norm.weight": ("nextn.hc_head_norm.weight", None),
                                 "nextn.hc_down.weight": ("nextn.hc_head_down.weight", None),
                                 "nextn.hc_up.weight": ("nextn.hc_head_up.weight", None), **_NORMS}),
)

# block N's layer: a QSA layer under the trunk's names (llama.cpp src/models/qwen4exp.cpp:153-260)
LAYER: frozenset[str] = frozenset(f"{s}.weight" for s in (
    *(f"hc_{part}_{w}" for part in ("attn", "ffn") for w in ("norm", "down", "up", "inject")),
    "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
    "indexer.q_proj", "indexer.k_proj", "indexer.q_norm", "indexer.k_norm",
    "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps",
    "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
))

# the target's tensors an MTP-only file may carry beside the layer (not read: the target's are used)
SHARED: frozenset[str] = frozenset({"token_embd.weight", "output.weight", "output_hc_norm.weight",
                                    "output_hc_down.weight", "output_hc_up.weight"})

# names some heads carry that this layout does not read, and why
UNSUPPORTED: dict[str, str] = {
    "d2t": "the FR-Spec head's vocabulary map (a head trimmed to part of the vocabulary)",
    "nextn.shared_head_norm.weight": "a head whose exit mixer is split between this norm and top-level "
                                     "output_hc_* cannot be told from the target's copies; write nextn.hc_head_*",
}

_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")
_ALIASES: dict[str, tuple[tuple[str, str | None], frozenset[str]]] = {}
for _layout in LAYOUTS:
    for _file_name, _target in _layout.names.items():
        _known = _ALIASES.get(_file_name)
        assert _known is None or _known[0] == _target, _file_name  # one meaning per name, across layouts
        _ALIASES[_file_name] = (_target, (_known[1] if _known else frozenset()) | {_layout.name})


@dataclass(frozen=True)
class MtpTensors:
    """A file's MTP tensors by canonical name: `nextn` maps each canonical nextn suffix held whole
    to the file's tensor name; `eh_proj_halves` maps "embed"/"hidden" to the two tensors of a
    split input projection (empty when `nextn` holds it fused); `layer` the layer's tensors
    (same suffixes in every layout); `shared` the target copies the file carries."""

    block: int
    layouts: tuple[str, ...]
    nextn: dict[str, str]
    eh_proj_halves: dict[str, str]
    layer: dict[str, str]
    shared: tuple[str, ...]


def map_mtp_names(names: Iterable[str], label: str, *, mtp_only: bool) -> MtpTensors | None:
    """The MTP layer in a file's tensor names, by canonical name; None when there is no
    `blk.N.nextn.*` tensor (and the file is a pack: an MTP-only file without one is an error).

    mtp_only: the file is an MTP-only GGUF (every tensor must be the layer's or a target copy);
    otherwise a pack, whose other tensors are the trunk's and are not looked at."""
    names = list(names)
    blocks = sorted({int(m.group(1)) for n in names if (m := _NEXTN.match(n))})
    if not blocks:
        if mtp_only:
            raise StrataError(f"{label}: no MTP layer (no blk.N.nextn.* tensor)")
        return None
    if len(blocks) > 1:
        raise StrataError(f"{label}: MTP layers in blocks {', '.join(map(str, blocks))}; qwen4exp has one")
    prefix = f"blk.{blocks[0]}."
    found = _Found(label)
    shared = []
    for name in names:
        if name.startswith(prefix):
            found.add(name, name[len(prefix):])
        elif mtp_only and name in SHARED:
            if name in shared:
                raise StrataError(f"{label}: tensor {name} appears twice")
            shared.append(name)
        elif mtp_only:
            raise StrataError(f"{label}: tensor {name}: {_why_unknown(name, 'an MTP-only file')}")
    return found.result(blocks[0], prefix, tuple(shared))


def _why_unknown(suffix: str, where: str) -> str:
    return UNSUPPORTED.get(suffix) or f"not a tensor of {where} in any known layout ({', '.join(l.name for l in LAYOUTS)})"


class _Found:
    """The tensors of block N as they are read, with the checks between them."""

    def __init__(self, label: str):
        self.label = label
        self.by_target: dict[tuple[str, str | None], str] = {}
        self.layer: dict[str, str] = {}
        self.layouts: frozenset[str] | None = None
        self.seen: list[tuple[str, frozenset[str]]] = []

    def add(self, name: str, suffix: str) -> None:
        if not suffix.startswith("nextn."):
            if suffix not in LAYER:
                raise StrataError(f"{self.label}: tensor {name}: {_why_unknown(suffix, 'the MTP layer')}")
            if suffix in self.layer:
                raise StrataError(f"{self.label}: tensor {name} appears twice")
            self.layer[suffix] = name
            return
        if suffix not in _ALIASES:
            raise StrataError(f"{self.label}: tensor {name}: {_why_unknown(suffix, 'the MTP layer')}")
        target, layouts = _ALIASES[suffix]
        clash = self.by_target.get(target) or self._fused_against_half(target)
        if clash == name:
            raise StrataError(f"{self.label}: tensor {name} appears twice")
        if clash is not None:
            raise StrataError(f"{self.label}: tensors {clash} and {name} are both {_describe(target)}")
        self._same_layout(name, layouts)
        self.by_target[target] = name

    def _same_layout(self, name: str, layouts: frozenset[str]) -> None:
        """Every nextn name of a file comes from one layout (a mix is a file put together by hand)."""
        common = layouts if self.layouts is None else self.layouts & layouts
        if not common:
            other, other_layouts = next(((n, ls) for n, ls in self.seen if not ls & layouts), self.seen[-1])
            raise StrataError(f"{self.label}: tensor {name} is named as in {', '.join(sorted(layouts))}, "
                              f"{other} as in {', '.join(sorted(other_layouts))}; a file uses one layout")
        self.seen.append((name, layouts))
        self.layouts = common

    def _fused_against_half(self, target: tuple[str, str | None]) -> str | None:
        """The fused projection and one of its halves name the same weights."""
        suffix, half = target
        if half is None:
            return self.by_target.get((suffix, EMBED)) or self.by_target.get((suffix, HIDDEN))
        return self.by_target.get((suffix, None))

    def result(self, block: int, prefix: str, shared: tuple[str, ...]) -> MtpTensors:
        halves = {half: n for (suffix, half), n in self.by_target.items() if half is not None}
        if len(halves) == 1:
            (half, name), = halves.items()
            other = HIDDEN if half == EMBED else EMBED
            raise StrataError(f"{self.label}: tensor {name} is the {half} half of the input projection, "
                              f"and its {other} half is missing")
        nextn = {suffix: n for (suffix, half), n in self.by_target.items() if half is None}
        for suffix in CANONICAL:
            if suffix not in nextn and not (suffix == EH_PROJ and halves):
                raise StrataError(f"{self.label}: the MTP layer lacks {prefix}{suffix}{_aliases_of(suffix)}")
        return MtpTensors(block, tuple(sorted(self.layouts or ())), nextn, halves, dict(self.layer), shared)


def _describe(target: tuple[str, str | None]) -> str:
    suffix, half = target
    return f"{suffix}" if half is None else f"the {half} half of {suffix}"


def _aliases_of(suffix: str) -> str:
    others = sorted(n for n, ((s, _), _) in _ALIASES.items() if s == suffix and n != suffix)
    return f" (or {', '.join(others)})" if others else ""


@dataclass(frozen=True)
class JoinedColumns:
    """Two [E, O] tensors of one type seen as one [2E, O]: each output row the first's row, then
    the second's (a split input projection as the fused eh_proj, embedding half first). Rows of
    whole blocks join byte-wise, whatever the type."""

    first: Any
    second: Any
    name: str

    @property
    def ggml_type(self) -> int:
        return self.first.ggml_type

    @property
    def shape(self) -> tuple[int, ...]:
        return (2 * int(self.first.shape[0]), *map(int, self.first.shape[1:]))

    @property
    def nbytes(self) -> int:
        return int(self.first.nbytes) + int(self.second.nbytes)

    def data(self) -> np.ndarray:
        rows = int(np.prod(self.first.shape[1:]))
        a = np.asarray(self.first.data()).reshape(rows, -1)
        b = np.asarray(self.second.data()).reshape(rows, -1)
        return np.ascontiguousarray(np.concatenate([a, b], axis=1)).reshape(-1)


def _type_name(t: Any) -> str:
    known = type_by_id(t.ggml_type)
    return known.name if known is not None else f"type {t.ggml_type}"


def _joined(tensors: Mapping[str, Any], halves: dict[str, str], name: str, label: str) -> JoinedColumns:
    first, second = tensors[halves[EMBED]], tensors[halves[HIDDEN]]
    if first.ggml_type != second.ggml_type or tuple(first.shape) != tuple(second.shape) or len(first.shape) != 2:
        raise StrataError(f"{label}: tensors {halves[EMBED]} and {halves[HIDDEN]} (the halves of the input "
                          f"projection) must be 2-D of one type and shape, found {_type_name(first)} "
                          f"{list(first.shape)} and {_type_name(second)} {list(second.shape)}")
    return JoinedColumns(first, second, name)


def canonical_tensors(tensors: Mapping[str, Any], label: str, *, mtp_only: bool) -> tuple[int, dict[str, Any]] | None:
    """The MTP layer of a file (map_mtp_names) as (block N, {canonical name: tensor}), names
    under "blk.N.", a split input projection joined into one eh_proj; None: no MTP layer (a pack)."""
    found = map_mtp_names(tensors, label, mtp_only=mtp_only)
    if found is None:
        return None
    prefix = f"blk.{found.block}."
    out = {prefix + suffix: tensors[name] for suffix, name in {**found.nextn, **found.layer}.items()}
    if found.eh_proj_halves:
        out[prefix + EH_PROJ] = _joined(tensors, found.eh_proj_halves, prefix + EH_PROJ, label)
    return found.block, out
