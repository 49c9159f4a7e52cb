"""The metadata keys a model pack is checked against, once, when its model is built.

KEYS lists every key the engine reads: its kind (which GGUF value types it may have), whether it
is required, its range and its default. RELATIONS lists what must hold between keys once each
is valid alone. `checked_values` walks both tables in one loop each and returns the keys' values
(defaults filled in) for strata.model.config, which reads nothing else; the first violation is
one line naming the pack and the key:

    pack P: metadata key qwen3.attention.head_count: must be >= 1, found 0

`checked_table` is that loop for any table of Keys and Relations: an MTP draft file's is in
strata/pack/draft_rules.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from strata.errors import StrataError
from strata.gguf.constants import ALIGNMENT_KEY, ValueType as V
from strata.gguf.reader import MAX_ALIGNMENT, shown
from strata.model.hybrid.config import HYBRID_ARCHS, HYBRID_MOE_ARCHS, IMROPE_ARCHS
from strata.pack.presets import MOE_ARCHS, SUPPORTED_ARCHS

_INTS = frozenset({V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64})
_FLOATS = frozenset({V.FLOAT32, V.FLOAT64})


class Kind(Enum):
    """What a key holds, and the GGUF value types that may carry it (arrays: element types)."""

    COUNT = ("an integer", _INTS, False)
    REAL = ("a number", _INTS | _FLOATS, False)
    FLAG = ("a bool", frozenset({V.BOOL}), False)
    TEXT = ("a string", frozenset({V.STRING}), False)
    COUNTS = ("an array of integers", _INTS, True)
    FLAGS = ("an array of bools or integers", _INTS | frozenset({V.BOOL}), True)
    REALS = ("an array of numbers", _INTS | _FLOATS, True)
    TEXTS = ("an array of strings", frozenset({V.STRING}), True)

    def __init__(self, words: str, types: frozenset, is_array: bool):
        self.words = words
        self.types = types
        self.is_array = is_array

    def accepts(self, vtype) -> bool:
        if isinstance(vtype, tuple):
            return self.is_array and vtype[1] in self.types
        return not self.is_array and vtype in self.types


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Range:
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself excluded (> instead of >=)

    def problem(self, x) -> str | None:
        """What is wrong with x (None: it is in range); a float must also be finite."""
        if isinstance(x, float) and not math.isfinite(x):
            return "must be finite"
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return f"must be {'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None and x > self.high:
            return f"must be <= {_num(self.high)}"
        return None


AT_LEAST_1 = Range(1, 2**31 - 1)
AT_LEAST_0 = Range(0, 2**31 - 1)
POSITIVE = Range(0, None, low_open=True)

# A value check beyond the range: what is wrong, saying what was found (None: nothing is wrong).
Check = Callable[[Any], "str | None"]


def _power_of_two(x: int) -> str | None:
    return None if x & (x - 1) == 0 else f"must be a power of two, found {x}"


def utf8_problem(texts, what: str = "token") -> str | None:
    """Token and merge texts must be UTF-8 (the reader keeps other bytes as surrogates, which the
    tokenizer library cannot take); names the first one that is not."""
    try:
        "".join(texts).encode("utf-8")  # one pass over the whole vocabulary in the common case
        return None
    except UnicodeEncodeError:
        for i, t in enumerate(texts):
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raw = t.encode("utf-8", "surrogateescape")[:40]
                return f"{what} {i} is not valid UTF-8 ({raw!r})"
    return None


def _not_empty(values) -> str | None:
    return None if len(values) else "must not be empty"


@dataclass(frozen=True)
class Key:
    name: str  # "{arch}." is put in front unless it starts with "general." or "tokenizer."
    kind: Kind
    required: bool = False
    range: Range | None = None
    default: Any = None  # a value, or a function of the values read so far
    check: Check | None = None
    archs: tuple[str, ...] = SUPPORTED_ARCHS  # the architectures whose model reads it
    choices: tuple[str, ...] | None = None

    def full_name(self, arch: str) -> str:
        return self.name if self.name.startswith(("general.", "tokenizer.")) else f"{arch}.{self.name}"


DENSE_ARCHS = tuple(a for a in SUPPORTED_ARCHS if a not in MOE_ARCHS)
AT_LEAST_2 = Range(2, 64)


def _four_sections(values) -> str | None:
    return None if len(values) == 4 and all(int(x) >= 0 for x in values) else \
        f"must be 4 non-negative integers, found {len(values)} value(s)"

# the reader checks it too: it needs the alignment to find the tensor data
ALIGNMENT = Key(ALIGNMENT_KEY, Kind.COUNT, range=Range(8, MAX_ALIGNMENT), default=32, check=_power_of_two)
NAME = Key("general.name", Kind.TEXT)  # (an MTP draft's table has these two as well)

# Every key the model and tokenizer read; order matters only for defaults that use earlier keys.
KEYS: tuple[Key, ...] = (
    Key("general.architecture", Kind.TEXT, required=True),
    ALIGNMENT,
    NAME,
    Key("embedding_length", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("block_count", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("nextn_predict_layers", Kind.COUNT, range=AT_LEAST_0, default=0),
    Key("context_length", Kind.COUNT, range=AT_LEAST_1, default=4096),
    Key("feed_forward_length", Kind.COUNT, required=True, range=AT_LEAST_1, archs=DENSE_ARCHS),
    # the hybrid MoE archs read it only as the shared expert's width when theirs is not given
    Key("feed_forward_length", Kind.COUNT, range=AT_LEAST_1, archs=HYBRID_MOE_ARCHS),
    Key("attention.head_count", Kind.COUNT, required=True, range=AT_LEAST_1),
    Key("attention.head_count_kv", Kind.COUNT, range=AT_LEAST_1, default=lambda v: v["attention.head_count"]),
    Key("attention.key_length", Kind.COUNT, range=AT_LEAST_1,
        default=lambda v: v["embedding_length"] // v["attention.head_count"]),
    Key("attention.value_length", Kind.COUNT, range=AT_LEAST_1, default=lambda v: v["attention.key_length"]),
    Key("attention.layer_norm_rms_epsilon", Kind.REAL, range=POSITIVE, default=1e-6),
    Key("rope.freq_base", Kind.REAL, range=POSITIVE, default=10000.0),
    Key("rope.dimension_count", Kind.COUNT, range=AT_LEAST_1, default=lambda v: v["attention.key_length"]),
    Key("rope.scaling.type", Kind.TEXT, default="none", choices=("none", "linear")),
    Key("rope.scaling.factor", Kind.REAL, range=Range(0, None), default=1.0),  # 0: none (llama.cpp's reading)
    Key("vocab_size", Kind.COUNT, range=AT_LEAST_1),
    Key("expert_count", Kind.COUNT, required=True, range=AT_LEAST_1, archs=MOE_ARCHS),
    Key("expert_used_count", Kind.COUNT, required=True, range=AT_LEAST_1, archs=MOE_ARCHS),
    Key("expert_feed_forward_length", Kind.COUNT, required=True, range=AT_LEAST_1, archs=MOE_ARCHS),
    Key("expert_weights_norm", Kind.FLAG, archs=MOE_ARCHS),
    Key("expert_shared_feed_forward_length", Kind.COUNT, range=AT_LEAST_1, archs=HYBRID_MOE_ARCHS),
    # the hybrid family (strata/model/hybrid/config.py)
    Key("ssm.conv_kernel", Kind.COUNT, required=True, range=AT_LEAST_2, archs=HYBRID_ARCHS),
    Key("ssm.state_size", Kind.COUNT, required=True, range=Range(1, 1024), archs=HYBRID_ARCHS),
    Key("ssm.group_count", Kind.COUNT, required=True, range=Range(1, 4096), archs=HYBRID_ARCHS),
    Key("ssm.time_step_rank", Kind.COUNT, required=True, range=Range(1, 4096), archs=HYBRID_ARCHS),
    Key("ssm.inner_size", Kind.COUNT, required=True, range=AT_LEAST_1, archs=HYBRID_ARCHS),
    Key("full_attention_interval", Kind.COUNT, range=Range(1, 2**31 - 1), default=4, archs=HYBRID_ARCHS),
    Key("attention.recurrent_layers", Kind.FLAGS, archs=HYBRID_ARCHS),
    Key("rope.dimension_sections", Kind.COUNTS, required=True, check=_four_sections, archs=IMROPE_ARCHS),
    Key("tokenizer.ggml.model", Kind.TEXT, required=True),
    Key("tokenizer.ggml.pre", Kind.TEXT),
    Key("tokenizer.ggml.tokens", Kind.TEXTS, required=True, check=lambda t: _not_empty(t) or utf8_problem(t)),
    Key("tokenizer.ggml.token_type", Kind.COUNTS),
    Key("tokenizer.ggml.scores", Kind.REALS),
    Key("tokenizer.ggml.merges", Kind.TEXTS, check=lambda m: utf8_problem(m, "merge")),
    *(Key(f"tokenizer.ggml.{name}_token_id", Kind.COUNT)  # negative: none (some converters write -1)
      for name in ("bos", "eos", "eot", "eom", "padding")),
    *(Key(f"tokenizer.ggml.{name}", Kind.FLAG) for name in ("add_bos_token", "add_eos_token", "add_space_prefix")),
    Key("tokenizer.chat_template", Kind.TEXT),
)


@dataclass(frozen=True)
class Relation:
    """`holds(values)` must be true whenever every key in `needs` has a value; the error names `key`."""

    key: str
    needs: tuple[str, ...]
    holds: Callable[[Mapping[str, Any]], bool]
    must: Callable[[Mapping[str, Any]], str]


def _n_tokens(v) -> int:
    return len(v["tokenizer.ggml.tokens"])


_TOKEN_IDS = tuple(k.name for k in KEYS if k.name.endswith("_token_id"))

RELATIONS: tuple[Relation, ...] = (
    Relation("attention.head_count_kv", ("attention.head_count", "attention.head_count_kv"),
             lambda v: v["attention.head_count"] % v["attention.head_count_kv"] == 0,
             lambda v: f"must divide attention.head_count ({v['attention.head_count']})"),
    Relation("attention.value_length", ("attention.key_length", "attention.value_length"),
             lambda v: v["attention.value_length"] == v["attention.key_length"],
             lambda v: f"must equal attention.key_length ({v['attention.key_length']})"),
    Relation("rope.dimension_count", ("rope.dimension_count", "attention.key_length"),
             lambda v: v["rope.dimension_count"] <= v["attention.key_length"] and v["rope.dimension_count"] % 2 == 0,
             lambda v: f"must be even and <= the head size attention.key_length ({v['attention.key_length']})"),
    Relation("nextn_predict_layers", ("nextn_predict_layers", "block_count"),
             lambda v: v["nextn_predict_layers"] < v["block_count"],
             lambda v: f"must be below block_count ({v['block_count']})"),
    Relation("expert_used_count", ("expert_used_count", "expert_count"),
             lambda v: v["expert_used_count"] <= v["expert_count"],
             lambda v: f"must be in [1, expert_count ({v['expert_count']})]"),
    Relation("ssm.time_step_rank", ("ssm.time_step_rank", "ssm.group_count"),
             lambda v: v["ssm.time_step_rank"] % v["ssm.group_count"] == 0,
             lambda v: f"must be a multiple of ssm.group_count ({v['ssm.group_count']})"),
    Relation("ssm.inner_size", ("ssm.inner_size", "ssm.state_size", "ssm.time_step_rank"),
             lambda v: v["ssm.inner_size"] == v["ssm.state_size"] * v["ssm.time_step_rank"],
             lambda v: f"must equal ssm.state_size x ssm.time_step_rank ({v['ssm.state_size'] * v['ssm.time_step_rank']})"),
    Relation("attention.recurrent_layers", ("attention.recurrent_layers", "block_count"),
             lambda v: len(v["attention.recurrent_layers"]) == v["block_count"],
             lambda v: f"must have one entry per block ({v['block_count']} in block_count)"),
    Relation("rope.dimension_sections", ("rope.dimension_sections", "rope.dimension_count"),
             lambda v: 0 < sum(int(x) for x in v["rope.dimension_sections"]) <= v["rope.dimension_count"] // 2,
             lambda v: f"must sum to between 1 and half of rope.dimension_count ({v['rope.dimension_count'] // 2})"),
    Relation("vocab_size", ("vocab_size", "tokenizer.ggml.tokens"),
             lambda v: v["vocab_size"] == _n_tokens(v),
             lambda v: f"must equal the number of tokens in tokenizer.ggml.tokens ({_n_tokens(v)})"),
    *(Relation(name, (name, "tokenizer.ggml.tokens"), lambda v, name=name: len(v[name]) == _n_tokens(v),
               lambda v: f"must have one entry per token ({_n_tokens(v)} in tokenizer.ggml.tokens)")
      for name in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores")),
    *(Relation(name, (name, "tokenizer.ggml.tokens"), lambda v, name=name: v[name] < _n_tokens(v),
               lambda v: f"must be a token id below {_n_tokens(v)}")
      for name in _TOKEN_IDS),
)


def _vtype_of(value: Any):
    """The GGUF type a plain Python value stands for (metadata built in code carries no types)."""
    if isinstance(value, (bool, np.bool_)):
        return V.BOOL
    if isinstance(value, (int, np.integer)):
        return V.INT64
    if isinstance(value, (float, np.floating)):
        return V.FLOAT64
    if isinstance(value, str):
        return V.STRING
    if isinstance(value, np.ndarray):
        return V.ARRAY, (V.FLOAT64 if value.dtype.kind == "f" else V.BOOL if value.dtype.kind == "b" else V.INT64)
    if isinstance(value, (list, tuple)):
        return V.ARRAY, (_vtype_of(value[0]) if len(value) else V.INT64)
    return None


def _type_words(vtype) -> str:
    if isinstance(vtype, tuple):
        return f"an array of {V(vtype[1]).name}"
    return V(vtype).name if vtype is not None else "of no GGUF type"


def checked_values(label: str, md: Mapping[str, Any], types: Mapping[str, Any] | None = None,
                   arch: str | None = None) -> dict[str, Any]:
    """Check the pack's metadata against KEYS and RELATIONS; returns {key name as in KEYS: value}
    with defaults filled in, for every key the architecture reads. arch: defaults to the pack's."""
    return checked_table(f"pack {label}: " if label else "", md, types, arch, KEYS, RELATIONS)


def checked_table(where: str, md: Mapping[str, Any], types: Mapping[str, Any] | None, arch: str | None,
                  keys: tuple[Key, ...], relations: tuple[Relation, ...],
                  given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check metadata against a table of keys and relations (the pack's: KEYS and RELATIONS; an
    MTP draft's: strata.pack.draft_rules); the first violation is one line, `where` (e.g.
    "pack P: ") in front. given: values from elsewhere that relations may need (e.g. the
    target's, for a draft), under names no key has; they are not in what is returned."""
    types = types or {}

    def fail(name: str, what: str) -> StrataError:
        return StrataError(f"{where}metadata key {shown(name)}: {what}")

    arch = arch or md.get("general.architecture")
    values: dict[str, Any] = {}
    for key in keys:
        if arch not in key.archs and not key.name.startswith(("general.", "tokenizer.")):
            continue
        name = key.full_name(arch)
        if name not in md:
            if key.required:
                raise fail(name, f"missing ({key.kind.words} is required)")
            if key.default is not None:
                values[key.name] = key.default(values) if callable(key.default) else key.default
            continue
        value = md[name]
        vtype = types[name] if name in types else _vtype_of(value)
        if vtype is None or not key.kind.accepts(vtype):
            raise fail(name, f"must be {key.kind.words}, found {_type_words(vtype)} ({shown(value)})")
        if key.kind is Kind.TEXT and utf8_problem([value]):  # it reaches the tokenizer, logs and replies
            raise fail(name, f"is not valid UTF-8 ({shown(value)})")
        if key.kind is Kind.REAL:
            value = float(value)
        problem = key.range.problem(value) if key.range is not None else None
        if problem:
            raise fail(name, f"{problem}, found {shown(_num(value))}")
        if key.choices is not None and value not in key.choices:
            raise fail(name, f"must be one of {', '.join(key.choices)}, found {shown(value)}")
        problem = key.check(value) if key.check is not None else None
        if problem:
            raise fail(name, problem)
        values[key.name] = value
    known = {**(given or {}), **values}
    for rel in relations:
        if all(n in known for n in rel.needs) and not rel.holds(known):
            key = next(k for k in keys if k.name == rel.key)
            found = known[rel.key]
            found = len(found) if isinstance(found, (list, np.ndarray)) else found
            raise fail(key.full_name(arch), f"{rel.must(known)}, found {shown(found)}")
    return values
