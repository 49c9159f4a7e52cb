"""A compiled grammar and the per-request matchers made from it.

CompiledGrammar keeps one llguidance matcher at the grammar's start whose first mask has been
computed: that first mask builds the lexer's automata and the token trie walk caches (tens of
ms), which every copy then shares. `matcher()` is a deep copy of it (~10 us), so a request
pays nothing at admission. The copy is taken under a lock, since the server's request threads
and the engine's scheduler thread may both hold the same CompiledGrammar.

Masks are bit sets over token ids in the engine's layout: uint32 words, bit (t % 32) of word
t // 32 for token t. The model's logit width (n_vocab) may be wider than the tokenizer (a
padded output head) or, rarely, narrower; ids the tokenizer lacks are never allowed.

Two library behaviours the Matcher hides:
- an llguidance matcher that consumes a token the grammar forbids enters a permanent error
  state; `accept` therefore tries the token (try_consume_tokens, which changes nothing on a
  refusal) and reports False, so a rejected draft token costs nothing;
- once a grammar is complete (stopped), the library allows end-of-generation but does not
  count it as a consumed token; the Matcher records it in its own history so that
  `rollback(n)` always undoes exactly the last n tokens `accept` took.
A matcher that hits one of the library's resource limits mid-output (its error state) allows
only the stop tokens, so the request ends instead of sampling from an empty mask; `error`
says why.
"""

from __future__ import annotations

import threading

import llguidance
import numpy as np

from strata.grammar.errors import GrammarError, one_line
from strata.grammar.vocab import GrammarVocab


class Matcher:
    """One request's position in a grammar. Not thread-safe: one request, one thread."""

    def __init__(self, lib_matcher, vocab: GrammarVocab, n_vocab: int):
        self._m = lib_matcher
        self._vocab = vocab
        self._n_vocab = n_vocab
        self.vocab_words = (n_vocab + 31) // 32
        self._allowed_ids = min(n_vocab, vocab.n_tokens)  # ids that can ever be allowed
        # per accepted token: True when the library consumed it, False for the end-of-generation
        # token taken after the grammar stopped (the library does not count that one)
        self._history: list[bool] = []
        # narrower logits than the tokenizer: the library's full mask lands here first
        self._scratch = None if n_vocab >= vocab.n_tokens else np.zeros(vocab.lib_words, np.uint32)

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the set of tokens allowed next into out (np.uint32[vocab_words])."""
        if out.dtype != np.uint32 or out.shape != (self.vocab_words,) or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"mask: need a contiguous uint32[{self.vocab_words}], "
                             f"got {out.dtype}{list(out.shape)}")
        if self._m.is_error():
            out[:] = _bits([t for t in self._vocab.stop_ids if t < self._n_vocab], self.vocab_words)
            return
        lib_words = self._vocab.lib_words
        if self._scratch is None:
            self._m.unsafe_compute_mask_ptr(out.ctypes.data, lib_words * 4)
            out[lib_words:] = 0
        else:
            self._m.unsafe_compute_mask_ptr(self._scratch.ctypes.data, lib_words * 4)
            out[:] = self._scratch[: self.vocab_words]
            tail = self._n_vocab % 32
            if tail:
                out[-1] &= np.uint32((1 << tail) - 1)

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""
        token = int(token)
        if not 0 <= token < self._allowed_ids:
            return False
        if token in self._vocab.stop_ids and self._m.is_stopped():
            self._history.append(False)
            return True
        if self._m.try_consume_tokens([token]) != 1:
            return False
        self._history.append(True)
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (a speculative draft's rejected tail)."""
        if not 0 <= n <= len(self._history):
            raise ValueError(f"rollback({n}): only {len(self._history)} tokens were accepted")
        if n == 0:
            return
        consumed = sum(self._history[-n:])
        del self._history[-n:]
        if consumed and not self._m.rollback(consumed):
            raise RuntimeError(f"the grammar library could not roll back {consumed} tokens")

    def is_accepting(self) -> bool:
        """The output may end here: end-of-generation is allowed now."""
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        """The grammar is complete: nothing but end-of-generation may follow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the library gave up on this output (a resource limit), else None."""
        return one_line(self._m.get_error()) if self._m.is_error() else None

    @property
    def accepted(self) -> int:
        return len(self._history)


class CompiledGrammar:
    """A grammar ready for one tokenizer and logit width; `matcher()` per request."""

    def __init__(self, kind: str, lib_grammar: str, vocab: GrammarVocab, n_vocab: int):
        self.kind = kind
        self.n_vocab = n_vocab
        self.vocab_words = (n_vocab + 31) // 32
        self._vocab = vocab
        start = llguidance.LLMatcher(vocab.lib, lib_grammar, log_level=0)
        mask = np.zeros(vocab.lib_words, np.uint32)
        if not start.is_error():
            start.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)  # builds the shared automata
        if start.is_error():
            raise GrammarError(f"{kind}: {one_line(start.get_error())}")
        if not mask.any():
            raise GrammarError(f"{kind}: the grammar accepts no output")
        self._start = start
        self._lock = threading.Lock()

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start."""
        with self._lock:
            copy = self._start.deep_copy()
        return Matcher(copy, self._vocab, self.n_vocab)


def _bits(ids: list[int], words: int) -> np.ndarray:
    mask = np.zeros(words, np.uint32)
    for t in ids:
        mask[t // 32] |= np.uint32(1 << (t % 32))
    return mask
