"""What an architecture is, as the registry (strata/model/archs/__init__.py) holds it: llama.cpp's
three parts of `src/models/<arch>.cpp` as data and functions.

- hyperparameters: `keys` and `relations` beyond the common ones (layers/hparams.py), and `read`,
  the extra ModelConfig fields they give;
- tensors: `block_tensors` (and `nextn_tensors`), the one table of names and shapes that the
  loader's check, the layers and `strata pack synth` read (`model_tensors` puts a whole model
  together);
- graph: `block`, the shared layers one block stacks (layers/block.py), and `draft_block`, the
  MTP draft's block built from the same pieces.

The rest are traits the shared layers read, and the shapes of synthetic packs (`tiny`, `presets`:
SynthSpec field values, `types` naming a type plan of strata/pack/presets.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from strata.backend.base import Backend, RopeParams
from strata.gguf.key_rules import Key, Relation
from strata.model.layers.attention import norm_spec
from strata.model.layers.block import Block
from strata.model.layers.delta_net_hparams import DeltaNetTraits
from strata.model.layers.hparams import ArchTraits, ModelConfig
from strata.model.layers.tensors import Reader, TensorLookup, TensorSpec

# (backend, config, the block's tensors, rope, block index, index within its kind) -> Block
BlockBuilder = Callable[[Backend, ModelConfig, Reader, RopeParams, int, int], Block]
# (backend, target config, tensors, the draft block's prefix, rope) -> (the draft's config, Block)
DraftBuilder = Callable[[Backend, ModelConfig, TensorLookup, str, RopeParams], "tuple[ModelConfig, Block]"]


def no_extra(v: Mapping[str, Any], n_layer: int, label: str | None) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ArchSpec:
    name: str
    traits: ArchTraits
    block_tensors: Callable[[ModelConfig, str, int], list[TensorSpec]]  # (cfg, prefix, block index)
    block: BlockBuilder
    draft_block: DraftBuilder
    keys: tuple[Key, ...] = ()
    relations: tuple[Relation, ...] = ()
    # checked values, main-stack layers, pack label -> extra ModelConfig fields
    read: Callable[[Mapping[str, Any], int, str | None], dict[str, Any]] = no_extra
    nextn_tensors: Callable[[ModelConfig, int], list[TensorSpec]] | None = None  # nextn (MTP) layer i
    delta_net: DeltaNetTraits | None = None  # its Gated DeltaNet layers' traits (None: none)
    shared_expert: bool = False  # its MoE has a sigmoid-gated shared expert
    # the head's tensors when not output_norm + output (cfg) -> [TensorSpec]
    head_tensors: Callable[[ModelConfig], list[TensorSpec]] | None = None
    # its residual is hyper-connection streams, and `block` gives layers that run on them
    # (strata/model/hyper_transformer.py runs the model); else the one-vector residual of
    # strata/model/transformer.py
    residual_streams: bool = False
    # the `{arch}.*` keys of its own a synthetic pack writes: SynthSpec -> [(key, value, GGUF type)]
    synth_keys: Callable[[Any], list[tuple[str, Any, Any]]] | None = None
    tiny: Mapping[str, Any] = field(default_factory=dict)  # the TINY synthetic pack's SynthSpec fields
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # named synthetic packs
    # the backends its layers run on (strata/backend/select.py device_for_model: --device auto
    # takes the CPU for an architecture without CUDA layers, --device cuda refuses it in one line)
    devices: tuple[str, ...] = ("cpu", "cuda")

    @property
    def recurrent(self) -> bool:
        """Whether a sequence carries a recurrent state besides its KV cache."""
        return self.delta_net is not None


def model_tensors(spec: ArchSpec, cfg: ModelConfig, *, trunk: bool = True, nextn: bool = True) -> list[TensorSpec]:
    """The whole model in conversion order; an MTP-only file holds the head and the nextn layers."""
    E, V = cfg.n_embd, cfg.vocab_size
    out = [TensorSpec("token_embd.weight", (E, V), "embed")]
    if trunk:
        for i in range(cfg.n_layer):
            out += spec.block_tensors(cfg, f"blk.{i}.", i)
    if nextn and spec.nextn_tensors is not None:
        for i in range(cfg.n_layer, cfg.n_layer_all):
            out += spec.nextn_tensors(cfg, i)
    if spec.head_tensors is not None:
        return out + spec.head_tensors(cfg)
    out += [norm_spec("output_norm.weight", E), TensorSpec("output.weight", (E, V), "output", required=False)]
    return out
