"""The machinery that checks a GGUF file's metadata against a table of keys, once, when it is opened.

A `Key` says what a key holds (its `Kind`: which GGUF value types may carry it), whether it is
required, its range, its default and any further check; a `Relation` says what must hold between
keys once each is valid alone. `checked_table` walks a table of both in one loop each and returns
the values (defaults filled in); the first violation is one line naming the file and the key:

    pack P: metadata key qwen3.attention.head_count: must be >= 1, found 0

The model's table is strata/model/config.py's (each architecture's own keys with its ArchSpec);
an MTP draft file's is strata/pack/draft_rules.py's.
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


def not_empty(values) -> str | None:
    return None if len(values) else "must not be empty"


@dataclass(frozen=True)
class Key:
    name: str  # "{arch}." is put in front unless it starts with "general." or "tokenizer."
    kind: Kind
    required: bool = False
    range: Range | None = None
    default: Any = None  # a value, or a function of the values read so far
    check: Check | None = None
    archs: tuple[str, ...] | None = None  # the architectures whose reader reads it (None: every one)
    choices: tuple[str, ...] | None = None

    def full_name(self, arch: str) -> str:
        return self.name if self.name.startswith(("general.", "tokenizer.")) else f"{arch}.{self.name}"

    def read_for(self, arch: str | None) -> bool:
        return self.archs is None or arch in self.archs or self.name.startswith(("general.", "tokenizer."))


AT_LEAST_2 = Range(2, 64)

# the reader checks it too: it needs the alignment to find the tensor data
ALIGNMENT = Key(ALIGNMENT_KEY, Kind.COUNT, range=Range(8, MAX_ALIGNMENT), default=32, check=_power_of_two)
NAME = Key("general.name", Kind.TEXT)  # (an MTP draft's table has these two as well)


@dataclass(frozen=True)
class Relation:
    """`holds(values)` must be true whenever every key in `needs` has a value; the error names `key`."""

    key: str
    needs: tuple[str, ...]
    holds: Callable[[Mapping[str, Any]], bool]
    must: Callable[[Mapping[str, Any]], str]




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



def checked_table(where: str, md: Mapping[str, Any], types: Mapping[str, Any] | None, arch: str | None,
                  keys: tuple[Key, ...], relations: tuple[Relation, ...],
                  given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check metadata against a table of keys and relations (a model's: strata.model.config; an
    MTP draft's: strata.pack.draft_rules); the first violation is one line, `where` (e.g.
    "pack P: ") in front. given: values from elsewhere that relations may need (e.g. the
    target's, for a draft), under names no key has; they are not in what is returned."""
    types = types or {}

    def fail(name: str, what: str) -> StrataError:
        return StrataError(f"{where}metadata key {shown(name)}: {what}")

    arch = arch or md.get("general.architecture")
    values: dict[str, Any] = {}
    for key in keys:
        if not key.read_for(arch):
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
