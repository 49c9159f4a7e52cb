"""What GET /slots and GET /props show a caller who is let in but runs no other client's requests.

/slots (llama-server's names) lists every slot's request: its sampling (stop strings, seed,
logit_bias, grammar kind), the id its client got and its task number. Those belong to the client
that sent the request, and anyone let in may ask, so by default a slot shows only its state and
counters; the engine flag `--slots` (llama-server's name for the same switch) shows the whole
object, for an operator who is every client. /props names the model by its file name: the
absolute path says where the operator keeps files, which no client needs.
"""

from __future__ import annotations

import os
from typing import Any

# the keys of one /slots entry that are state and counters, no client's request
PUBLIC_SLOT_KEYS = ("id", "n_ctx", "speculative", "is_processing", "next_token", "n_prompt_tokens", "mtp",
                    "expert_cache")


def slots_view(entries: list[dict[str, Any]], expose: bool) -> list[dict[str, Any]]:
    """/slots as `expose` allows: the entries whole, or each with only PUBLIC_SLOT_KEYS."""
    if expose:
        return entries
    return [{k: e[k] for k in PUBLIC_SLOT_KEYS if k in e} for e in entries]


def props_view(props: dict[str, Any]) -> dict[str, Any]:
    """/props with the model's file name in place of its path (as llama-server shows it)."""
    path = props.get("model_path") or ""
    return {**props, "model_path": os.path.basename(path.replace("\\", "/")) if path else ""}
