"""How a layer names and reads its tensors: `TensorSpec` rows (the one table that the loader's
shape check, the layers and `strata pack synth` read) and `Reader` (a layer's tensors, each
checked against the shape its table gives).

Shapes are ggml order (ne0, the row length, first). `role` is the synth type role that picks a
tensor's type (`--type ROLE=TYPE`); None keeps it F32 (norms, gates, biases, the conv kernel).
`fill` and `scale` say how synth fills an F32 tensor (strata/pack/synth.py: norm gains near 1,
normal "bias" values, "weight" blocks, "ssm_a" decays); a quantized one is always random blocks of
RMS 1/sqrt(row length). `required` False: the pack may lack it (an alternative form may stand in,
or the layer does without). `synth` False: a real pack may hold it, synth writes none. `form`:
the DeltaNet input form it belongs to (delta_net.INPUT_FORMS); None: any pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from strata.backend.base import SourceView, TensorSource
from strata.errors import StrataError
from strata.gguf.row_source import HostTables


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]
    role: str | None = None  # synth type role (None: F32)
    fill: str = "weight"  # an F32 tensor's synth fill: weight | norm | bias | ssm_a
    scale: float | None = None  # an F32 tensor's synth scale (None: 1 / sqrt(ne0))
    required: bool = True
    synth: bool = True  # written by strata pack synth
    form: str | None = None


TensorLookup = Callable[[str], TensorSource | None]


def expect(src: TensorSource | None, name: str, shape: tuple[int, ...] | None) -> TensorSource:
    """The tensor, present and (shape given) of that shape, else one line naming it."""
    if src is None:
        raise StrataError(f"pack: missing required tensor {name}")
    if shape is not None and tuple(src.shape) != tuple(shape):
        raise StrataError(
            f"tensor {name} has shape {list(src.shape)} but the metadata implies {list(shape)}"
        )
    return src


class AsColumn(SourceView):
    """A 1-D tensor (n,) seen as an (n, 1) matrix: a one-output gate fused into another linear."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.src.shape[0]), 1)


class Reader:
    """Tensors of one layer (`prefix`), each checked against its expected shape; `tables` reads
    those that stay on the host by rows (the n-gram table: strata/gguf/row_source.py), one
    for the whole model, so that a table several layers share is opened once."""

    def __init__(self, get: TensorLookup, prefix: str, tables: HostTables | None = None):
        self.get, self.prefix = get, prefix
        self.tables = tables if tables is not None else HostTables()

    def req(self, name: str, shape: tuple[int, ...] | None) -> TensorSource:
        return expect(self.get(self.prefix + name), self.prefix + name, shape)

    def opt(self, name: str) -> TensorSource | None:
        return self.get(self.prefix + name)

    def either(self, fused: str, fused_shape: tuple[int, ...], parts: Sequence[tuple[str, tuple[int, ...]]]):
        """The fused tensor if the pack has it, else the parts: [sources]."""
        if self.opt(fused) is not None:
            return [self.req(fused, fused_shape)]
        missing = [n for n, _ in parts if self.opt(n) is None]
        if missing:
            raise StrataError(f"pack: missing required tensor {self.prefix}{missing[0]} "
                              f"(or {self.prefix}{fused} in its place)")
        return [self.req(n, s) for n, s in parts]

    def spec(self, t: TensorSpec) -> TensorSource:
        """A tensor of a table (its name is whole, prefix included)."""
        return expect(self.get(t.name), t.name, t.ne)
