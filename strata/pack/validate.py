"""Checks the model code runs against a pack, with one-line errors naming the culprit."""

from __future__ import annotations

from collections.abc import Iterable

from strata.errors import StrataError
from strata.model.archs import ARCHS, model_tensors


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def check_shape(pack, name: str, expected_ne: tuple[int, ...]):
    """The tensor (ggml order shape) must match what the metadata implies; returns it. Trailing
    dimensions of 1 do not count: ggml's shapes are padded with 1s, and llama-quantize writes
    an [E, 1] tensor back as [E]."""
    info = pack.tensor(name)
    if _squeezed(info.shape) != _squeezed(expected_ne):
        raise StrataError(
            f"pack {pack.label}: tensor {name} has shape {_fmt(info.shape)} "
            f"but the metadata implies {_fmt(expected_ne)}"
        )
    return info


def _squeezed(ne) -> tuple[int, ...]:
    dims = [int(d) for d in ne]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


def check_arch(arch: str | None, supported: Iterable[str]) -> str:
    supported = list(supported)
    if arch not in supported:
        raise StrataError(f"unsupported architecture {arch!r} (supported: {', '.join(supported)})")
    return arch


def check_tensors(pack, cfg) -> None:
    """Each tensor the model's main stack reads is present (unless optional) with the shape `cfg`
    implies: its architecture's table (strata/model/archs/), the one its layers read.

    Checked when the pack is opened, with the pack's name, so that a tensor the first window
    would otherwise trip over (an output head or a bias of the wrong length loads fine and fails
    only when multiplied) is refused at load."""
    for t in model_tensors(ARCHS[cfg.arch], cfg, nextn=False):
        if t.required or pack.has(t.name):
            check_shape(pack, t.name, t.ne)
