"""User requests written by the target itself: varied prompts without a dataset.

An instruct model given its chat template up to the start of a user turn (and nothing after)
writes what it has learned a user says there: questions, tasks, role-play, code requests, on
every topic it knows (the "Magpie" way of drawing instructions from an aligned model). The
built-in templates (prompts.py) cover 70 topics in 30 phrasings; these cover whatever the
target has seen, which is what its users will ask it too.

A request counts only when the model closed the turn itself (an end-of-generation token within
`max_len` tokens); duplicates and requests that contain template markup are dropped.
"""

from __future__ import annotations

from typing import Callable, Iterable

from strata.errors import StrataError
from strata.mtp.train.collect import generate

SENTINEL = "\x01"  # stands in for the user's text while the template is rendered
MIN_TOKENS = 4  # shorter requests are greetings and fragments; the built-ins cover those


def user_turn_prefix(chat, tokenizer) -> list[int]:
    """The chat template's tokens up to where a user's message begins (system prompt included)."""
    text = chat.render([{"role": "user", "content": SENTINEL}])
    cut = text.find(SENTINEL)
    if cut < 0:
        raise StrataError("strata mtp train: --self-prompts: the chat template drops the user's text; "
                          "use the built-in prompts or --data instead")
    return tokenizer.encode(text[:cut], add_special=True)


def _key(text: str) -> str:
    """What makes two requests the same: their letters and digits, case aside."""
    return "".join(c for c in text.lower() if c.isalnum())


def write_prompts(model, tokenizer, chat, n: int, *, slots: int, seed: int, max_len: int = 64,
                  temperature: float = 1.0, time_budget_s: float | None = None, exclude: Iterable[str] = (),
                  log: Callable[[str], None] = print) -> list[str]:
    """Up to n distinct user requests, each sampled (top-50) from its own random stream.
    Requests equal to one in `exclude` (the held-out prompts), case and punctuation aside, are
    dropped: a model this size does write "Why is the sky blue?" on its own."""
    prefix = user_turn_prefix(chat, tokenizer)
    eog = set(tokenizer.eog_ids)
    if not eog:
        raise StrataError("strata mtp train: --self-prompts: the tokenizer has no end-of-generation token")
    # about 1 in 5 runs past max_len or repeats another: ask for more than n
    tries = [("self-prompt", prefix)] * (n + n // 3 + 8)
    seqs = generate(model, tries, slots=slots, max_new=max_len, sample_every=1, temperature=temperature,
                    eog=eog, seed=seed, log=log, time_budget_s=time_budget_s, what="requests written")
    out: list[str] = []
    seen = {_key(t) for t in exclude}
    for s in seqs:
        written = [int(t) for t in s.tokens[len(prefix):]]
        if not written or written[-1] not in eog or len(written) - 1 < MIN_TOKENS:
            continue  # cut off at max_len (or empty): not a whole request
        text = tokenizer.decode(written[:-1]).strip()
        if text and _key(text) not in seen and "<|" not in text:
            seen.add(_key(text))
            out.append(text)
        if len(out) == n:
            break
    log(f"data: {len(out)} requests written by the target ({len(seqs)} tries)")
    return out
