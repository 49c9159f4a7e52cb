"""The id a pack is served under (/v1/models, the answers' `model`) and the names a request
may give for it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from strata.server.served_core import ServedCore

# file stems that name no model (`model-00001-of-00003.gguf`, `ggml-model-q4_0.gguf`'s split sets):
# such a pack is served under its general.name, slugged, as a directory pack is
GENERIC_STEMS = frozenset({"model", "ggml-model", "consolidated", "pytorch_model"})
_NOT_IN_SLUG = re.compile(r"[^a-z0-9._-]+")


def slug(name: str) -> str:
    """'Smollm2 135M 8k Lc100K Mix1 Ep2' -> 'smollm2-135m-8k-lc100k-mix1-ep2': lower case,
    spaces to '-', only [a-z0-9._-]."""
    return _NOT_IN_SLUG.sub("", "-".join(name.lower().split())).strip("-.")


def model_id_of(pack: Any, named_dir: bool) -> str:
    """The id a pack is served under without --alias: the file stem the user named
    (`SmolLM2-135M-Instruct.Q4_1`; a split set's stem without `-0000i-of-0000N`), else (a
    directory, a generic stem) its general.name slugged, else the file stem, else 'strata'."""
    from strata.pack.loader import SHARD_NAME

    name = pack.main.path.name
    m = SHARD_NAME.match(name)
    stem = m["stem"] if m else (name[:-5] if name.lower().endswith(".gguf") else Path(name).stem)
    if not named_dir and stem and stem.lower() not in GENERIC_STEMS:
        return stem
    general = pack.metadata.get("general.name")
    return (slug(general) if isinstance(general, str) else "") or stem or "strata"


def served_names(core: ServedCore) -> tuple[str, frozenset[str]]:
    """(the served id, every name a request may give for it). A core without a pack (the tests'
    scripted ones) is served under its model_name."""
    pack, opts = core.pack, core.opts
    if pack is None or opts is None:
        return core.model_name, frozenset({core.model_name})
    from strata.pack.loader import user_path

    named_dir = opts.pack is not None and opts.native is None and user_path(opts.pack).is_dir()
    served = model_id_of(pack, named_dir)
    general = pack.metadata.get("general.name")
    # general.name as is: the id clients were given before ids were file stems
    return served, frozenset({served} | ({general} if isinstance(general, str) and general else set()))
