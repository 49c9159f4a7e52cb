"""The grammar library's view of a tokenizer, built once per Tokenizer.

llguidance computes a mask by walking a trie of every token's bytes, so it needs the exact
bytes of each id (Tokenizer.token_bytes, the bytes decoding emits) and which ids are special:
control tokens match only where a grammar names them (`<|im_end|>`), never as the text they
spell. User-defined tokens (Qwen's `<tool_call>`, say) are plain text here, so a grammar's
literal "<tool_call>" is matched by that one token as well as by its pieces.

The stop tokens are the tokenizer's end-of-generation ids (eos and the eog set): the mask
allows them exactly when the output may end, which is how a finished grammar ends generation.

Building takes ~0.15 s for a 49k vocabulary, so it is done once per Tokenizer and kept for as
long as the Tokenizer lives (weak keys), under a lock: request threads and the engine's
scheduler thread may ask at the same time.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import llguidance

from strata.grammar.errors import GrammarError


@dataclass(frozen=True)
class GrammarVocab:
    lib: Any  # llguidance.LLTokenizer
    n_tokens: int  # the tokenizer's vocabulary: the width of the library's masks
    stop_ids: frozenset[int]

    @property
    def lib_words(self) -> int:
        return (self.n_tokens + 31) // 32


class _TokenizerView:
    """What llguidance.LLTokenizer reads from a tokenizer object (its TokenizerWrapper's
    attributes). Calling it tokenizes text the way the model does, without special tokens."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, stop_ids: list[int]):
        n = tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        self.eos_token_id = stop_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, parse_special=False)


def stop_ids_of(tokenizer) -> list[int]:
    ids = set(tokenizer.eog_ids)
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    return sorted(ids)


def _build(tokenizer) -> GrammarVocab:
    stop_ids = stop_ids_of(tokenizer)
    if not stop_ids:
        raise GrammarError("constraint: the model's tokenizer names no end-of-generation token, "
                           "so a grammar could never end the output")
    lib = llguidance.LLTokenizer(_TokenizerView(tokenizer, stop_ids), eos_token=stop_ids)
    return GrammarVocab(lib=lib, n_tokens=tokenizer.vocab_size, stop_ids=frozenset(stop_ids))


class PerTokenizer:
    """A value made once per tokenizer object on first use (under a lock: the server's threads
    ask at once) and dropped with the tokenizer."""

    def __init__(self, make):
        self._make = make
        self._items: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, tokenizer):
        with self._lock:
            value = self._items.get(tokenizer)
            if value is None:
                value = self._items[tokenizer] = self._make(tokenizer)
            return value


# the tokenizer's GrammarVocab, built on first use
grammar_vocab = PerTokenizer(_build)
