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
only the stop tokens, so nothing is sampled from an empty mask, and the engine ends the
request with `refusal`'s error (not a "stop": the output is not what the grammar asked for).

The library computes its limits lazily: a mask may allow a token whose consumption then
exceeds one (a pattern `a{1000000}`, an object of thousands of optional properties, a
property name of a million characters). CompiledGrammar therefore walks the first
PROBE_STEPS tokens of the grammar at compile time, trying PROBE_TOKENS of the allowed tokens
at each step, so that such a grammar is refused with the request (400) in the common case; a
limit met later ends its request alone (`refusal`: one line and a code the server answers
with 400), as does a step where the request's logit_bias bans every token the grammar allows.
"""

from __future__ import annotations

import threading

import llguidance
import numpy as np

from strata.grammar.errors import GrammarError, one_line
from strata.grammar.vocab import GrammarVocab

PROBE_STEPS = 8  # tokens walked at compile time (a few ms on a json_object grammar)
PROBE_TOKENS = 16  # allowed tokens tried at each of them
# FinishEvent codes of a constrained request that cannot go on (the server answers 400)
LIMIT_CODE = "grammar_limit"
DEAD_END_CODE = "grammar_dead_end"


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

    def allows(self, token: int) -> bool:
        """Whether the mask allows token now (a mask computation: for the rare checks, not per row)."""
        token = int(token)
        if not 0 <= token < self._allowed_ids:
            return False
        mask = np.zeros(self.vocab_words, np.uint32)
        self.fill_mask(mask)
        return bool(mask[token // 32] >> np.uint32(token % 32) & np.uint32(1))

    def refusal(self, token: int, banned: set[int]) -> tuple[str, str]:
        """(message, code) for a token `accept` refused although the engine sampled from this
        matcher's mask: the library hit a limit consuming it (LIMIT_CODE), or no token was left
        to sample because `banned` (the request's -inf biases) holds every one the grammar
        allows (DEAD_END_CODE); else the engine broke its own rule (internal_error)."""
        if self._m.is_error():
            return (f"the grammar library gave up at output token {len(self._history) + 1}: {self.error}; "
                    f"make the grammar smaller", LIMIT_CODE)
        mask = np.zeros(self.vocab_words, np.uint32)
        self.fill_mask(mask)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: self._n_vocab])
        if allowed.size and all(int(t) in banned for t in allowed):
            return (f"logit_bias: bans every token the grammar allows at output token {len(self._history) + 1}; "
                    f"nothing can be generated", DEAD_END_CODE)
        return f"internal error: the grammar refused token {token}, which its mask allowed", "internal_error"


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
        _probe(kind, start, mask)
        self._start = start
        self._lock = threading.Lock()

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start."""
        with self._lock:
            copy = self._start.deep_copy()
        return Matcher(copy, self._vocab, self.n_vocab)


def _probe(kind: str, start, first_mask: np.ndarray) -> None:
    """Walk the grammar's first tokens on a copy (the lowest allowed id each step, after trying
    PROBE_TOKENS of them): a library limit met there is a GrammarError now, not a failure
    after the request was admitted. A walk that reaches the grammar's end stops early."""
    m = start.deep_copy()
    mask = first_mask.copy()
    for _ in range(PROBE_STEPS):
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        for t in allowed[:PROBE_TOKENS]:
            trial = m.deep_copy()
            if trial.try_consume_tokens([int(t)]) != 1 and trial.is_error():
                raise GrammarError(f"{kind}: exceeds a limit of the grammar library: {one_line(trial.get_error())}")
        if not allowed.size or m.is_stopped() or m.try_consume_tokens([int(allowed[0])]) != 1:
            return
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if m.is_error():
            raise GrammarError(f"{kind}: exceeds a limit of the grammar library: {one_line(m.get_error())}")


def _bits(ids: list[int], words: int) -> np.ndarray:
    mask = np.zeros(words, np.uint32)
    for t in ids:
        mask[t // 32] |= np.uint32(1 << (t % 32))
    return mask
