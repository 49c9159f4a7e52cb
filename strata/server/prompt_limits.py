"""What the loaded model can take of a prompt, checked before any work is spent on it.

- Token ids must lie in [0, vocabulary size): an id past the embedding table would fail the
  whole window the request joins, not only the request (the vocabulary size is the smaller of
  the tokenizer's and the model's: an id must be both decodable and embeddable).
- A text of B bytes becomes at least B / L tokens, where L is the byte length of the
  vocabulary's longest token: when that already reaches the context, the prompt cannot fit,
  and it is refused before it is templated and tokenized (seconds of CPU for megabytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from strata.server.errors import APIError, invalid
from strata.server.served_core import ServedCore

# a character outside the vocabulary may still become one token (<unk>): never assume fewer
# than 4 bytes (one UTF-8 character) per token
MIN_TOKEN_BYTES = 4


@dataclass(frozen=True)
class PromptLimits:
    vocab_size: int | None = None  # None: unknown, ids are not checked here
    max_token_bytes: int | None = None  # None: unknown, texts are not pre-checked

    @classmethod
    def of_core(cls, core: ServedCore) -> "PromptLimits":
        tok = core.tokenizer
        # the tokenizer's and the model's vocabulary (a scripted core has no model config)
        vocab = min(tok.vocab_size, core.cfg.vocab_size) if core.cfg is not None else tok.vocab_size
        longest = max(MIN_TOKEN_BYTES, max(len(tok.token_bytes(i)) for i in range(tok.vocab_size)))
        return cls(vocab, longest)

    def check_ids(self, ids: Sequence[int], param: str, keyed: bool = False) -> None:
        """400 naming the first id outside the vocabulary: by its place (`prompt[1]`), or, for
        the keys of a table (`keyed`: logit_bias), by the field alone."""
        if self.vocab_size is None or not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return
        i = next(i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
        where = param if keyed else f"{param}[{i}]"
        raise invalid(f"{where}: token id {ids[i]} is out of range for a vocabulary of {self.vocab_size} tokens",
                      param=where)

    def fewest_tokens(self, n_bytes: int) -> int:
        """A lower bound on the tokens of a text of n_bytes (0 when unknown)."""
        if not self.max_token_bytes:
            return 0
        return -(-n_bytes // self.max_token_bytes)

    def refuse_if_cannot_fit(self, texts: Sequence[str], n_ctx: int, param: str) -> None:
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        fewest = self.fewest_tokens(n_bytes)
        if fewest >= n_ctx:
            raise overflow(fewest, n_ctx, param, at_least=True)


def overflow(n_prompt: int, n_ctx: int, param: str = "messages", *, at_least: bool = False) -> APIError:
    has = f"at least {n_prompt}" if at_least else f"{n_prompt}"
    return APIError("exceed_context_size_error", f"the prompt has {has} tokens; the context holds {n_ctx}",
                    param=param, code="exceed_context_size_error",
                    extra={"n_prompt_tokens": int(n_prompt), "n_ctx": int(n_ctx)})
