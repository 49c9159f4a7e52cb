"""The metadata keys an MTP draft file (`--mtp FILE|DIR`, or a shipped draft) is checked against,
once, when it is opened (strata.mtp.draft.find_draft); format in docs/MTP.md.

The same machinery as the pack's table (metadata_rules: Kind, Range, Key, Relation,
checked_table), with the draft's own keys: the `strata-mtp.*` ones when its general.architecture
is strata-mtp, or the target's `{arch}.*` ones when it names the target's architecture (an
MTP-only GGUF as llama.cpp's converter writes one, of blk.N.nextn.* tensors). RELATIONS hold the
draft to its target (same architecture and width). Which tensors it holds is find_draft's
business, and their shapes DraftModel's. The first violation is one line naming the file and
the key, e.g.

    --mtp d.gguf: metadata key strata-mtp.embedding_length: must equal the target's embedding_length (576), found 64
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from strata.gguf.reader import shown
from strata.pack.metadata_rules import ALIGNMENT, AT_LEAST_1, NAME, Key, Kind, Relation, checked_table
from strata.pack.presets import SUPPORTED_ARCHS

MTP_ARCH = "strata-mtp"  # general.architecture of a draft in the docs/MTP.md format (as mtp.train.export writes)
FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")  # what strata.mtp.defaults.target_fingerprint returns


def _fingerprint(value: str) -> str | None:
    return None if FINGERPRINT.fullmatch(value) else \
        f'must be "sha256:" and 64 lowercase hex digits, found {shown(value)}'


_MTP = (MTP_ARCH,)
_TEXT_NOTES = ("training", "vocabulary")  # free text written by `strata mtp train` / `strata mtp vocab`

KEYS: tuple[Key, ...] = (
    # strata-mtp (the docs/MTP.md format), or the target's own (an MTP-only GGUF, as llama.cpp's
    # converter writes one, with the normal {arch}.* keys)
    Key("general.architecture", Kind.TEXT, required=True, choices=_MTP + SUPPORTED_ARCHS),
    ALIGNMENT,
    NAME,
    Key("target_architecture", Kind.TEXT, required=True, choices=SUPPORTED_ARCHS, archs=_MTP),
    Key("embedding_length", Kind.COUNT, required=True, range=AT_LEAST_1, archs=_MTP),
    Key("target_fingerprint", Kind.TEXT, check=_fingerprint, archs=_MTP),
    *(Key(note, Kind.TEXT, archs=_MTP) for note in _TEXT_NOTES),
    Key("embedding_length", Kind.COUNT, range=AT_LEAST_1, archs=SUPPORTED_ARCHS),  # where it gives one
)

# What the relations need of the target: its keys, checked by the same machinery where it has
# them (`strata probe` opens a draft for a pack of tensors alone; the engine has checked the
# whole pack by then). Held under names no draft key has.
TARGET_ARCH, TARGET_WIDTH = "target architecture", "target width"
_TARGET_KEYS = (Key("general.architecture", Kind.TEXT), Key("embedding_length", Kind.COUNT, range=AT_LEAST_1))

RELATIONS: tuple[Relation, ...] = (
    Relation("general.architecture", ("general.architecture", TARGET_ARCH),
             lambda v: v["general.architecture"] in (MTP_ARCH, v[TARGET_ARCH]),
             lambda v: f"must be {MTP_ARCH} or the target's architecture ({v[TARGET_ARCH]})"),
    Relation("target_architecture", ("target_architecture", TARGET_ARCH),
             lambda v: v["target_architecture"] == v[TARGET_ARCH],
             lambda v: f"must be the target's general.architecture ({v[TARGET_ARCH]})"),
    Relation("embedding_length", ("embedding_length", TARGET_WIDTH),
             lambda v: v["embedding_length"] == v[TARGET_WIDTH],
             lambda v: f"must equal the target's embedding_length ({v[TARGET_WIDTH]})"),
)


def checked_draft_values(where: str, md: Mapping[str, Any], types: Mapping[str, Any] | None,
                         target: Any) -> dict[str, Any]:
    """Check a draft file's metadata against KEYS and RELATIONS (`where`, e.g. "--mtp d.gguf: ",
    goes in front of the one line); target: the pack it drafts for (a bad value of its own is
    named as the pack's)."""
    t = checked_table(f"pack {target.label}: " if target.label else "", target.metadata,
                      target.metadata_types, None, _TARGET_KEYS, ())
    given = {name: t[key] for name, key in ((TARGET_ARCH, "general.architecture"),
                                            (TARGET_WIDTH, "embedding_length")) if key in t}
    return checked_table(where, md, types, None, KEYS, RELATIONS, given)
