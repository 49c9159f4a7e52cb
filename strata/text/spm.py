"""BPE merges for a SentencePiece-style (`llama`) vocabulary, derived from token scores.

SentencePiece BPE vocabularies ship scores, not merges. llama.cpp tokenizes them by
repeatedly joining the adjacent pair whose concatenation is a token with the highest score.
A BPE model reproduces that when every split of a token into two tokens becomes a merge,
ranked by the joined token's score (best first): at each step both pick the same pair.
"""

from __future__ import annotations

from collections.abc import Sequence


def merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool]
) -> list[tuple[str, str]]:
    """Every (left, right) with left, right and left+right mergeable tokens, best score first.

    `mergeable[i]` says whether token i takes part in merging (normal tokens; never control,
    byte or unused tokens, which SentencePiece never builds out of text). Ties in score go
    to the lower token id, then to the lower ids of the two parts, so the order is stable.
    """
    ids = {}
    for i, text in enumerate(tokens):
        if mergeable[i]:
            ids[text] = i  # a duplicated text keeps its last id, as llama.cpp's lookup does
    ranked = []
    for text, joined in ids.items():
        for cut in range(1, len(text)):
            left = ids.get(text[:cut])
            if left is None:
                continue
            right = ids.get(text[cut:])
            if right is not None:
                ranked.append((-float(scores[joined]), joined, left, right, text[:cut], text[cut:]))
    ranked.sort()
    return [(r[4], r[5]) for r in ranked]
