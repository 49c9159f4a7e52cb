"""The `--expert-profile` file: how often each layer's experts were routed to.

JSON, so a person can read and diff it:

    {"format": "strata-expert-profile", "version": 1,
     "tokens": 5120,                       # token positions whose routing was counted
     "layers": {"blk.0.": [12, 0, 7, ...], # per layer (its tensor prefix): tokens per expert
                ...}}

A layer's counts divided by `tokens` are each expert's expected tokens per position: the cache
preloads the hottest experts over all layers and seeds its policy's counts with them. Written by
`strata experts profile` (and by an engine given --expert-profile-out, at exit).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from strata.errors import StrataError

FORMAT = "strata-expert-profile"
VERSION = 1


@dataclass
class ExpertProfile:
    tokens: int
    layers: dict[str, np.ndarray]  # layer prefix -> int64 counts per expert

    def rates(self, layer: str) -> np.ndarray | None:
        """Expected tokens per position routed to each of the layer's experts (None: not profiled)."""
        c = self.layers.get(layer)
        if c is None or self.tokens <= 0:
            return None
        return c.astype(np.float64) / float(self.tokens)

    def check_model(self, path: str | os.PathLike, model_layers: Mapping[str, int]) -> None:
        """Refuse a profile of another model: a layer the model lacks, or another expert count."""
        for name, counts in self.layers.items():
            n = model_layers.get(name)
            if n is None:
                raise StrataError(f"{path}: layer {name!r} of the expert profile is not an expert layer of this "
                                  f"model (its layers: {_short(model_layers)}); was it recorded for another model?")
            if len(counts) != n:
                raise StrataError(f"{path}: layer {name!r} has {len(counts)} expert counts, the model's layer "
                                  f"has {n} experts; was it recorded for another model?")


def _short(names: Mapping[str, int]) -> str:
    keys = list(names)
    return ", ".join(keys[:4]) + (f", ... ({len(keys)} in all)" if len(keys) > 4 else "")


def write_profile(path: str | os.PathLike, tokens: int, layers: Mapping[str, np.ndarray]) -> None:
    body = {"format": FORMAT, "version": VERSION, "tokens": int(tokens),
            "layers": {k: [int(x) for x in np.asarray(v).reshape(-1)] for k, v in layers.items()}}
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        tmp.write_text(json.dumps(body, separators=(",", ":")) + "\n")
        os.replace(tmp, p)
    except OSError as e:
        raise StrataError(f"{path}: cannot write the expert profile ({e.strerror or e})") from None


def read_profile(path: str | os.PathLike) -> ExpertProfile:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise StrataError(f"{path}: cannot read the expert profile ({e.strerror or e})") from None
    try:
        body = json.loads(text)
    except ValueError as e:
        raise StrataError(f"{path}: not an expert profile (not JSON: {e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise StrataError(f"{path}: not an expert profile (no \"format\": \"{FORMAT}\"); "
                          "`strata experts profile` writes one")
    if body.get("version") != VERSION:
        raise StrataError(f"{path}: expert profile version {body.get('version')!r}, this build reads {VERSION}")
    tokens = body.get("tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise StrataError(f"{path}: \"tokens\" must be a whole number >= 0, not {tokens!r}")
    layers = body.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise StrataError(f"{path}: \"layers\" must be an object of layer name -> expert counts")
    out: dict[str, np.ndarray] = {}
    for name, counts in layers.items():
        if (not isinstance(counts, list) or not counts
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)):
            raise StrataError(f"{path}: layers[{name!r}] must be a list of whole numbers >= 0 (one per expert)")
        out[name] = np.asarray(counts, np.int64)
    return ExpertProfile(tokens, out)
