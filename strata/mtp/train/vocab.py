"""A draft's vocabulary: the tokens its target writes most (`mtp.vocab`, docs/MTP.md).

A draft that may propose only these tokens needs the shared output head on those rows only:
on the CPU the 49k-row head is ~20% of a target step, and a verification window runs it once
per drafted token. Tokens outside the vocabulary are never proposed, so the cost is the few
accepted drafts they would have given; verification stays exact whatever the draft proposes.

The counts come from the target's own answers (training data, or answers written for the count
by `strata mtp vocab`: pipeline.vocab_from_answers), never from the held-out prompts that
acceptance is measured on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from strata.gguf.constants import ValueType as V
from strata.gguf.reader import GGUFFile
from strata.gguf.writer import write_gguf
from strata.kernels.ggml_types import BY_NAME
from strata.mtp.defaults import FINGERPRINT_KEY
from strata.mtp.draft import VOCAB_TENSOR
from strata.mtp.train.collect import Sequence


def answer_token_counts(seqs: Iterable[Sequence], n_vocab: int) -> np.ndarray:
    """How often the target wrote each token: the tokens after every row that had logits (the
    answers; prompt rows were fed, not written)."""
    counts = np.zeros(n_vocab, np.int64)
    for s in seqs:
        rows = np.nonzero(s.top_ids[:, 0] >= 0)[0]
        np.add.at(counts, np.asarray(s.tokens, np.int64)[rows + 1], 1)
    return counts


def choose_vocab(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> np.ndarray:
    """The `size` most written tokens, plus `always` (end-of-generation: a draft that can
    propose the end saves a window per answer), ascending. Ties go to the lower id: a BPE
    vocabulary numbers its merges in the order it learned them, most frequent first, so when
    the counted text is short the unseen tokens it keeps are the common ones."""
    order = np.lexsort((np.arange(counts.size), -counts))  # by count, descending; then by id
    return np.unique(np.concatenate([order[:size], np.asarray(list(always), np.int64)])).astype(np.int64)


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """Share of the counted tokens that fall inside the vocabulary."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


VOCAB_NOTE_KEY = "strata-mtp.vocabulary"  # how the vocabulary was chosen (free text)


def with_vocab(draft: str | Path, ids: np.ndarray, out: str | Path, note: str | None = None,
               target_fingerprint: str | None = None) -> Path:
    """A copy of a draft GGUF with `mtp.vocab` set to ids (any earlier vocabulary replaced) and,
    given a note, how it was chosen; given the target's fingerprint, that too (FINGERPRINT_KEY)."""
    src = GGUFFile(draft)
    try:
        metadata, types = dict(src.metadata), dict(src.metadata_types)
        if note is not None:
            metadata[VOCAB_NOTE_KEY], types[VOCAB_NOTE_KEY] = note, V.STRING
        if target_fingerprint is not None:
            metadata[FINGERPRINT_KEY], types[FINGERPRINT_KEY] = target_fingerprint, V.STRING
        # copies: `out` may be `draft` itself
        tensors = [(name, t.ggml_type, t.shape, np.array(t.data())) for name, t in src.tensors.items()
                   if name != VOCAB_TENSOR]
        tensors.append((VOCAB_TENSOR, BY_NAME["I32"].id, (int(ids.size),), np.asarray(ids, "<i4")))
        return write_gguf(out, metadata, tensors, types)
    finally:
        src.close()
