"""The metadata keys a model pack is checked against, once, when its model is built: the table of
strata/model/config.py (the keys every architecture shares, then each architecture's own, with
its ArchSpec), on the machinery of strata/gguf/key_rules.py, which an MTP draft file's table
(draft_rules.py) uses too. Both are named here for the pack's readers and tests.
"""

from __future__ import annotations

from strata.gguf.key_rules import (  # noqa: F401
    ALIGNMENT, AT_LEAST_0, AT_LEAST_1, AT_LEAST_2, NAME, POSITIVE, Check, Key, Kind, Range, Relation, checked_table,
    utf8_problem,
)
from strata.model.config import KEYS, RELATIONS, checked_values  # noqa: F401

__all__ = ["ALIGNMENT", "AT_LEAST_0", "AT_LEAST_1", "AT_LEAST_2", "Check", "KEYS", "Key", "Kind", "NAME", "POSITIVE",
           "RELATIONS", "Range", "Relation", "checked_table", "checked_values", "utf8_problem"]
