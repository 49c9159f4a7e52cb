"""compile_constraint: a ConstraintSpec to a CompiledGrammar, cached per tokenizer.

Each kind is one row of KINDS, a function from the spec's source to llguidance's grammar
text; the rest (matcher, first mask, errors) is the same for every kind.

The server compiles a request's constraint on its request thread to refuse a bad schema with
400 before the request is queued; the engine compiles it again on its scheduler thread when
the request is admitted. The second call is a cache hit: a bounded LRU per tokenizer, keyed by
(kind, source, n_vocab). Compiling happens outside the cache's lock (a large schema can take
a while and llguidance releases the GIL meanwhile), so two threads compiling the same new
grammar at once both do the work and the second result is dropped. Failures are not cached:
a bad schema costs its own compile each time, as a good one costs it once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import llguidance

from strata.grammar.errors import GrammarError
from strata.grammar.matcher import CompiledGrammar
from strata.grammar.schema import JSON_OPTIONS, parse_schema, strict_schema
from strata.grammar.vocab import PerTokenizer, grammar_vocab
from strata.protocol import ConstraintSpec

CACHE_ENTRIES = 64  # per tokenizer; a grammar with its warmed automata is ~0.1-2 MB


def _json_grammar(schema: dict, where: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(strict_schema(schema, where), defaults=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"{where}: {e}") from None


def _json_object(source: str) -> str:
    return _json_grammar({"type": "object"}, "json_object")


def _json_schema(source: str) -> str:
    return _json_grammar(parse_schema(source, "json_schema"), "json_schema")


def _lark(source: str) -> str:
    if not isinstance(source, str) or not source.strip():
        raise GrammarError("lark: the grammar is empty")
    return llguidance.LLMatcher.grammar_from_lark(source)


# kind -> llguidance grammar text from the spec's source (strata.protocol.ConstraintSpec)
KINDS: dict[str, Callable[[str], str]] = {
    "json_object": _json_object,  # any JSON object; source unused
    "json_schema": _json_schema,  # source: the schema as JSON text, made strict (schema.py)
    "lark": _lark,  # source: a Lark grammar in llguidance's dialect (%json {...} blocks allowed)
}


class _LRU:
    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value):
        with self._lock:
            self._items.setdefault(key, value)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return self._items[key]

    def __len__(self) -> int:
        return len(self._items)


# compiled grammars, per tokenizer
_cache_for = PerTokenizer(lambda tokenizer: _LRU(CACHE_ENTRIES))


def compile_constraint(spec: ConstraintSpec, tokenizer, n_vocab: int | None = None) -> CompiledGrammar:
    """The compiled grammar of `spec` (kind, source) for this tokenizer; GrammarError in one
    line when the kind is unknown or the schema / grammar cannot be used. n_vocab is the
    model's logit width when it differs from the tokenizer's vocabulary."""
    kind, source = spec.kind, spec.source
    build = KINDS.get(kind) if isinstance(kind, str) else None
    if build is None:
        raise GrammarError(f"constraint kind {kind!r}: unknown (known: {', '.join(KINDS)})")
    if not isinstance(source, str):
        raise GrammarError(f"{kind}: the source must be text, not {type(source).__name__}")
    width = tokenizer.vocab_size if n_vocab is None else int(n_vocab)
    if width < 1:
        raise ValueError(f"n_vocab must be positive, got {n_vocab}")
    cache = _cache_for(tokenizer)
    key = (kind, "" if kind == "json_object" else source, width)
    compiled = cache.get(key)
    if compiled is None:
        vocab = grammar_vocab(tokenizer)
        compiled = cache.put(key, CompiledGrammar(kind, build(source), vocab, width))
    return compiled
