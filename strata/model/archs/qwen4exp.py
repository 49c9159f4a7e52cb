"""qwen4exp (Qwen3.8-Flash-Next; transformers `qwen4_exp`): the Qwen3.5 MoE backbone (Gated
DeltaNet on three layers of four, a sigmoid output gate; routed experts plus a gated shared expert)
with three parts of its own, each a shared layer: hyper-connections in place of every norm and
residual (layers/hyper_connections.py), Qwen Sparse Attention on the other layers
(layers/sparse_attention.py), and the hashed n-gram embedding on the layers `ple.layers` names
(layers/ngram_embedding.py). Sources: transformers 5.23 models/qwen4_exp/modeling_qwen4_exp.py
(the math: `M`), llama.cpp 0c1e57098 src/models/qwen4exp.cpp and conversion/qwen4exp.py (the
GGUF layout).

Hyperparameters: the common ones, the experts', the DeltaNet's (`ssm.*`), rope.dimension_sections,
`hyper_connection.*`, `attention.indexer.*` + `attention.compress_ratios`, `ple.*` +
embedding_length_per_layer_input. Tensors (per block): hc_attn_* and hc_ffn_* (norm, down, up,
inject); the DeltaNet's as qwen35moe's, or the QSA layer's attn_* + indexer.*; the MoE's
(ffn_gate_inp_shexp as [E, 1]); on PLE layers ple_key, ple_value, ple_norm_{key,query,conv},
ple_conv1d and the table per_layer_token_embd; the head: output_hc_{norm,down,up} and output. The
MTP layer (block N = the main stack's length, MtpLayer) has the QSA layer's tensors and nextn.*.

Graph (M:1254-1303, 1463-1476): the embedding copied into every stream; per layer [PLE] ->
HC read -> DeltaNet or QSA -> HC write -> HC read -> MoE -> HC write; the head's mix -> output.
Value head j of a DeltaNet layer reads key head j % H_k (GGUF's tiled order, as qwen35moe's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from strata.backend.base import Backend, RopeParams, SourceView
from strata.gguf.constants import ValueType as V
from strata.model.archs.spec import ArchSpec
from strata.model.layers import delta_net, delta_net_hparams, hyper_connections, moe, ngram_embedding, rope
from strata.model.layers import sparse_attention
from strata.model.layers.attention import norm_spec
from strata.model.layers.delta_net import DeltaNet
from strata.model.layers.delta_net_hparams import DeltaNetTraits, HybridConfig, read_hparams
from strata.model.layers.hparams import ArchTraits, ModelConfig
from strata.model.layers.hyper_connections import HyperMix
from strata.model.layers.moe import MoE
from strata.model.layers.ngram_embedding import NGramEmbedding, RowTable
from strata.model.layers.sparse_attention import SparseAttention
from strata.model.layers.tensors import Reader, TensorLookup, TensorSpec

NAME = "qwen4exp"
TRAITS = ArchTraits(rope_neox=True, qk_norm=True, moe=True, qkv_bias=False, norm_topk_default=True)
PLE_ROW_PAD = 128
DELTA_NET = DeltaNetTraits(grouped_heads=False, fused_ba=False, fused_qkvz=False, output_gate="sigmoid")


@dataclass(frozen=True)
class Qwen4ExpConfig(HybridConfig):
    """The DeltaNet's hyperparameters (HybridConfig) and the rest of qwen4exp's."""

    hc_count: int
    hc_rank: int
    idx_heads: int
    idx_dim: int
    idx_top_k: int  # tokens; top_k / ratio blocks
    compress_ratios: tuple[int, ...]  # per main-stack layer (0: dense)
    nextn_ratio: int  # the MTP layer's: its own entry after the main stack's, else theirs
    ple_layers: tuple[int, ...]
    ple_ngram: int
    ple_heads_per_ngram: int
    ple_conv_kernel: int
    ple_eos: int
    ple_image: int | None
    ple_row: int
    ple_multipliers: tuple[int, ...]
    ple_head_offsets: tuple[int, ...]
    ple_head_sizes: tuple[int, ...]

    @property
    def ple_embed_dim(self) -> int:
        return (self.ple_ngram - 1) * self.ple_heads_per_ngram * self.ple_row

    @property
    def ple_history_rows(self) -> int:
        return (self.ple_conv_kernel - 1) * self.ple_ngram if self.ple_layers else 0

    def extra_state_bytes(self, n_embd: int, replay_tokens: int, checkpoint: bool) -> int:
        """The PLE history (Qwen4ExpCache): the current one, the one at the window's start and the
        next; with a checkpoint also the rows of a window short enough to be cut inside."""
        row = 4 * self.hc_count * n_embd
        return (3 * self.ple_history_rows + (replay_tokens if checkpoint else 0)) * row if self.ple_layers else 0

    def extra_position_bytes(self, n_attention: int) -> int:
        """The indexer's float32 raw key in every attention layer, and the token id (the n-gram
        context)."""
        return 4 * n_attention * self.idx_dim + 8

    @property
    def ple_table_rows(self) -> int:
        """The rows the hash reaches."""
        return max(o + s for o, s in zip(self.ple_head_offsets, self.ple_head_sizes)) if self.ple_head_sizes else 0

    @property
    def ple_table_padded(self) -> int:
        """The table's rows in a pack: the reached rows padded to a multiple of PLE_ROW_PAD, as
        transformers allocates them (make_ngram_vocab_size_divisible_by, 128 in every config)."""
        return -(-self.ple_table_rows // PLE_ROW_PAD) * PLE_ROW_PAD


def read(v: Mapping[str, Any], n_layer: int, label: str | None) -> dict[str, Any]:
    where = f"pack {label}: " if label else ""
    ngram_embedding.required_with_layers(v, where, NAME)
    base = read_hparams(DELTA_NET, True, NAME, v, n_layer, label)
    ints = lambda key: tuple(int(x) for x in (v.get(key) if v.get(key) is not None else ()))  # noqa: E731
    ratios = ints("attention.compress_ratios")
    # transformers has one indexer_compress_ratio for every QSA layer, the MTP layer's included
    # (configuration_qwen4_exp.py:161): a pack without the MTP layer's entry takes the trunk's
    trunk = [r for r, rec in zip(ratios[:n_layer], base.recurrent) if not rec]
    nextn_ratio = ratios[n_layer] if len(ratios) > n_layer else next((r for r in trunk if r), 0)
    hp = Qwen4ExpConfig(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(HybridConfig)},
        hc_count=v["hyper_connection.count"], hc_rank=v["hyper_connection.low_rank"],
        idx_heads=v["attention.indexer.head_count"], idx_dim=v["attention.indexer.key_length"],
        idx_top_k=v["attention.indexer.top_k"], compress_ratios=ratios[:n_layer], nextn_ratio=nextn_ratio,
        ple_layers=ints("ple.layers"), ple_ngram=v["ple.ngram_size"], ple_heads_per_ngram=v["ple.heads_per_ngram"],
        ple_conv_kernel=v["ple.conv_kernel"], ple_eos=int(v.get("ple.eos_token_id") or 0),
        ple_image=v.get("ple.image_token_id"), ple_row=int(v.get("embedding_length_per_layer_input") or 0),
        ple_multipliers=ints("ple.layer_multipliers"), ple_head_offsets=ints("ple.head_offsets"),
        ple_head_sizes=ints("ple.head_vocab_sizes"),
    )
    sections = tuple(int(x) for x in v.get("rope.dimension_sections", ()))
    return {"hybrid": hp, "rope_sections": sections}


# --- tensors ---------------------------------------------------------------------------------
def _moe_tensors(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    """moe.py's table; the converter writes the shared expert's gate as [E, 1]."""
    out = moe.tensors(cfg, p, shared_ff=cfg.hybrid.shexp_ff, fused_gate_up=True)
    return [dataclasses.replace(t, ne=(cfg.n_embd, 1)) if t.name.endswith("ffn_gate_inp_shexp.weight") else t
            for t in out]


def block_tensors(cfg: ModelConfig, p: str, i: int) -> list[TensorSpec]:
    h, E = cfg.hybrid, cfg.n_embd
    hc = lambda part: hyper_connections.tensors(p + f"hc_{part}_", E, h.hc_count, h.hc_rank)  # noqa: E731
    mixer = delta_net.tensors(cfg, p) if h.recurrent[i] else sparse_attention.tensors(cfg, p, h.idx_heads, h.idx_dim)
    out = [*hc("attn"), *mixer, *hc("ffn"), *_moe_tensors(cfg, p)]
    if i in h.ple_layers:
        out += ngram_embedding.tensors(p, E, h.hc_count, h.ple_embed_dim, h.ple_conv_kernel,
                                       h.ple_table_padded, h.ple_row)
        if i != h.ple_layers[0]:  # one table for every PLE layer
            out = [t for t in out if t.name != ngram_embedding.TABLE]
    return out


def head_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    h = cfg.hybrid
    return [*hyper_connections.tensors("output_hc_", cfg.n_embd, h.hc_count, h.hc_rank, inject=False),
            TensorSpec("output.weight", (cfg.n_embd, cfg.vocab_size), "output", required=False)]


class _Flat(SourceView):
    """An [n, 1] tensor seen as [n] (what moe.py reads)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.src.shape[0]),)


def _flat_shexp_gate(get: TensorLookup) -> TensorLookup:
    def lookup(name: str):
        src = get(name)
        if src is not None and name.endswith("ffn_gate_inp_shexp.weight") and tuple(src.shape)[1:] == (1,):
            return _Flat(src)
        return src
    return lookup


# --- the graph: one decoder layer (the whole model: strata/model/hyper_transformer.py) ------------
class Layer:
    """One decoder layer (module doc's graph); `mixer`, `recurrent` and `index` as Block's, and
    run(X, spans, positions, table) over the streams X (n, c, E)."""

    def __init__(self, b: Backend, cfg: ModelConfig, r: Reader, rope_p: RopeParams, i: int, index: int, *,
                 ratio: int | None = None):
        """i: the block (its kind, compress ratio and n-gram layer); ratio given: a QSA layer
        of that ratio outside the main stack (the MTP layer's), without an n-gram layer."""
        h, E, eps = cfg.hybrid, cfg.n_embd, cfg.rms_eps
        r = Reader(_flat_shexp_gate(r.get), r.prefix, r.tables)
        main = ratio is None
        self.recurrent, self.index = (h.recurrent[i] if main else False), index
        self.hc_attn = HyperMix(b, r, "hc_attn_", E, h.hc_count, h.hc_rank, eps)
        self.hc_ffn = HyperMix(b, r, "hc_ffn_", E, h.hc_count, h.hc_rank, eps)
        if main:
            ratio = h.compress_ratios[i] if i < len(h.compress_ratios) else 0
        self.mixer = DeltaNet(b, cfg, r) if self.recurrent else \
            SparseAttention(b, cfg, r, rope_p, ratio, h.idx_top_k, h.idx_heads, h.idx_dim)
        self.ffn = MoE(b, cfg, r, shared_ff=h.shexp_ff, normalize=True)
        self.ple = None
        if main and i in h.ple_layers:
            table = RowTable(Reader(r.get, "").req(ngram_embedding.TABLE, None), h, r.tables)
            self.ple = NGramEmbedding(b, r, table, h, E, eps)

    def run(self, X: Any, spans: Sequence[Any], positions: Any, table: Any) -> Any:
        if self.ple is not None:
            X = X + self.ple.run(X, spans)
        u, w = self.hc_attn.read(X)
        y = self.mixer.run(u, self.index, spans, table if self.recurrent else positions)
        X = HyperMix.write(X, w, y)
        u, w = self.hc_ffn.read(X)
        return HyperMix.write(X, w, self.ffn.run(u))


# --- the MTP layer -----------------------------------------------------------------------------
def nextn_tensors(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    """Block i's MTP layer under the names strata/pack/mtp_names.py reads (CANONICAL, LAYER): the
    input projection [fc_embedding | fc_hidden] as one [2E, E] eh_proj, its two input norms
    (hnorm over all the streams), a QSA decoder layer under the trunk's names, and its exit mixer."""
    h, E, p = cfg.hybrid, cfg.n_embd, f"blk.{i}."
    return [TensorSpec(p + "nextn.eh_proj.weight", (2 * E, E), "nextn_eh_proj"),
            norm_spec(p + "nextn.enorm.weight", E), norm_spec(p + "nextn.hnorm.weight", h.hc_count * E),
            *hyper_connections.tensors(p + "hc_attn_", E, h.hc_count, h.hc_rank),
            *sparse_attention.tensors(cfg, p, h.idx_heads, h.idx_dim),
            *hyper_connections.tensors(p + "hc_ffn_", E, h.hc_count, h.hc_rank), *_moe_tensors(cfg, p),
            *hyper_connections.tensors(p + "nextn.hc_head_", E, h.hc_count, h.hc_rank, inject=False)]


class MtpLayer:
    """The MTP layer as vLLM runs it (vllm/models/qwen4_exp/nvidia/mtp.py at 03cae78,
    Qwen4ExpMultiTokenPredictor: `V:line`), on a draft step's tokens t (the token after each
    position) and the streams H (m, c E) of the position before:

        e   = W_fe RMS(E[t]) gamma_e        pre_fc_norm_embedding, fc_embedding (V:194-202, 226-228,
                                            295-296)
        H'  = RMS(H) gamma_h                pre_fc_norm_hidden: ONE norm over all c E values
                                            (V:229-231, 304-306)
        x_c = W_fh H'_c + e                 fc_hidden shared by the streams (V:203-211, 307); the
                                            embedding is the layer's pending block output with no
                                            injection (V:309, 318-319), which enters every stream
                                            with weight 1 (the combine's rule without injection
                                            logits, nvidia/ops/hc.py:218-228)
        X   = Layer(x)                      one decoder layer of layer_type full_attention (V:212-219):
                                            QSA with its indexer (V:250-258), the MoE with its gated
                                            shared expert, both hyper-connections, no n-gram layer
                                            (V docstring: "forces PLE off")
        u   = mixer(X)                      hyper_connection_mixer, a read without inject
                                            (use_combine=False, V:241-245, 337-341)
        logits = W_out u                    the target's output head, shared

    The pair [fc_embedding | fc_hidden] is the one [2E, E] eh_proj (embedding columns first:
    strata/pack/mtp_names.py), so x_c = eh_proj [e_n; H'_c] is one product per stream. A later
    draft step reads this layer's own X at the step before, never a mix of it (V:298-301, 333-342:
    "multi_hidden" is returned beside u for the next step). Its compress ratio is the trunk's
    (Qwen4ExpConfig.nextn_ratio). The layer's state (qwen4exp_state.py MtpState: its KV cache and
    indexer keys, made by HyperTransformer.draft_cache) is the draft's cache."""

    def __init__(self, b: Backend, cfg: ModelConfig, get: TensorLookup, prefix: str, rope_p: RopeParams):
        h, E = cfg.hybrid, cfg.n_embd
        r = Reader(get, prefix)
        self.b, self.cfg, self.c, self.E, self.eps = b, cfg, h.hc_count, E, cfg.rms_eps
        self.enorm = b.vector(r.req("nextn.enorm.weight", (E,)))
        self.hnorm = b.vector(r.req("nextn.hnorm.weight", (h.hc_count * E,)))
        self.eh_proj = b.linear_weight([r.req("nextn.eh_proj.weight", (2 * E, E))])
        self.layer = Layer(b, cfg, r, rope_p, cfg.n_layer, 0, ratio=h.nextn_ratio)
        self.mixer = HyperMix(b, r, "nextn.hc_head_", E, h.hc_count, h.hc_rank, cfg.rms_eps, inject=False)

    def block_out(self, e: Any, hidden: Any, spans: Sequence[Any], positions: Any) -> Any:
        """e (m, E) the tokens' embeddings, hidden (m, c E) the streams before them -> X (m, c E)."""
        b, xp, c, E = self.b, self.b.xp, self.c, self.E
        m = e.shape[0]
        e = b.rms_norm(e, self.enorm, self.eps)
        H = b.rms_norm(hidden, self.hnorm, self.eps).reshape(m, c, E)
        pairs = xp.concatenate([xp.broadcast_to(e[:, None, :], (m, c, E)), H], axis=2).reshape(m * c, 2 * E)
        X = b.linear(self.eh_proj, pairs).reshape(m, c, E)
        return self.layer.run(X, spans, positions, None).reshape(m, c * E)

    def finish(self, rows: Any) -> tuple[Any, Any]:
        """X rows -> (what the next draft step reads: X itself, what the head reads: the mix)."""
        return rows, self.mixer.read(rows.reshape(rows.shape[0], self.c, self.E))[0]

    def state_bytes(self, max_ctx: int, kind: str) -> int:
        """Private bytes per slot at full context: KV (kv_cache.py's sizes) and f32 indexer keys
        per position, and a step's activations (c E wide) and logits."""
        c = self.cfg
        per_tok = 2 * c.n_head_kv * c.head_dim * (2 if kind == "f16" else 1) + 4 * c.hybrid.idx_dim
        if kind == "int8":
            per_tok += 2 * c.n_head_kv * 4
        return per_tok * max_ctx + 4 * (4 * self.c * c.n_embd + c.vocab_size) * 8


def draft_block(b: Backend, cfg: ModelConfig, get: TensorLookup, prefix: str, rope_p: RopeParams):
    """The MTP layer, whole (ArchSpec.draft_block of an architecture on streams: the draft
    model runs its inputs, layer and exit mixer through block_out / finish)."""
    return cfg, MtpLayer(b, cfg, get, prefix, rope_p)


# --- synthetic packs -------------------------------------------------------------------------
def _primes_after(start: int, count: int) -> list[int]:
    out, x = [], start
    while len(out) < count:
        x += 1
        if x > 1 and all(x % d for d in range(2, int(x**0.5) + 1)):
            out.append(x)
    return out


def synth_keys(spec: Any) -> list[tuple[str, Any, Any]]:
    """The keys of a synthetic pack (SynthSpec; its `extra` gives the shapes of SYNTH_DEFAULTS):
    one QSA layer in every full_attention_interval, PLE on layer 1, head vocabularies the primes
    after ple_vocab_base as transformers picks them, multipliers that keep every product below
    2^63."""
    x = {**SYNTH_DEFAULTS, **spec.extra}
    n, heads = spec.n_layer, (x["ple_ngram"] - 1) * x["ple_heads_per_ngram"]
    sizes = _primes_after(x["ple_vocab_base"] - 1, heads)
    offsets = [sum(sizes[:i]) for i in range(heads)]
    top = (2**63 - 1) // max(1, spec.vocab)
    mult = [(top // (3 + 2 * j)) | 1 for j in range(x["ple_ngram"])]
    # the MTP layers (after the main stack) are QSA layers of the same ratio
    ratios = [0 if (i + 1) % spec.attn_interval and i < n else x["compress_ratio"] for i in range(n + spec.nextn)]
    u32, arr = V.UINT32, lambda t: (V.ARRAY, t)  # noqa: E731
    return [("hyper_connection.count", x["hc_count"], u32), ("hyper_connection.low_rank", x["hc_rank"], u32),
            ("attention.indexer.head_count", x["idx_heads"], u32), ("attention.indexer.key_length", x["idx_dim"], u32),
            ("attention.indexer.top_k", x["top_k"], u32),
            ("attention.compress_ratios", np.asarray(ratios, np.int32), arr(V.INT32)),
            ("ple.layers", np.asarray([1], np.int32), arr(V.INT32)), ("ple.ngram_size", x["ple_ngram"], u32),
            ("ple.heads_per_ngram", x["ple_heads_per_ngram"], u32), ("ple.conv_kernel", x["ple_conv"], u32),
            ("ple.eos_token_id", spec.vocab - 1, u32), ("embedding_length_per_layer_input", x["ple_row"], u32),
            ("ple.layer_multipliers", np.asarray(mult, np.uint64), arr(V.UINT64)),
            ("ple.head_offsets", np.asarray(offsets, np.uint64), arr(V.UINT64)),
            ("ple.head_vocab_sizes", np.asarray(sizes, np.uint64), arr(V.UINT64))]


SYNTH_DEFAULTS = dict(hc_count=4, hc_rank=32, idx_heads=4, idx_dim=32, top_k=32, compress_ratio=4, ple_ngram=3,
                      ple_heads_per_ngram=8, ple_conv=4, ple_row=32, ple_vocab_base=257)
# 3 DeltaNet layers and 1 QSA layer, PLE on layer 1 (rows of 32: the Q8_0 default fits every row), one
# MTP layer
TINY_SHAPE = dict(n_layer=4, n_embd=256, n_ff=32, n_head=4, n_head_kv=2, head_dim=32, n_expert=8, n_expert_used=3,
                  expert_ff=32, rope_freq_base=1e7, rope_dim=8, rope_sections=(2, 1, 1, 0), ssm_state=16,
                  ssm_groups=2, ssm_heads=6, shexp_ff=32, nextn=1, types="tiny-hybrid")
# Qwen3.8-Flash-Next's widths (QWEN4EXP.md section 1) with 12 of its 48 layers and an n-gram table
# of 16M rows (the real one has 320M; same row width and type), quantized as llama-quantize's IQ3_S
FLASH_SHAPE = dict(n_layer=12, n_embd=2560, n_ff=640, n_head=24, n_head_kv=2, head_dim=256, vocab=248320,
                   n_expert=512, n_expert_used=10, expert_ff=640, context=262144, rope_freq_base=1e7, rope_dim=64,
                   rope_sections=(11, 11, 10, 0), ssm_state=128, ssm_groups=16, ssm_heads=48, shexp_ff=640,
                   nextn=1, types="streams-iq3s",
                   extra=dict(hc_rank=320, idx_heads=4, idx_dim=128, top_k=2048, ple_row=160, ple_vocab_base=1000003))

# all 48 layers and the real n-gram table (16 prime vocabularies from 20000003, 320001536 rows padded):
# the pack's memory math (QWEN4EXP.md section 1); too large to write on the test machines. No MTP
# layer: the converter drops it (conversion/qwen4exp.py:28-30), so a hub pack has none
FULL_SHAPE = dict(FLASH_SHAPE, n_layer=48, nextn=0, extra=dict(FLASH_SHAPE["extra"], ple_vocab_base=20000000))

SPEC = ArchSpec(
    name=NAME,
    traits=TRAITS,
    keys=(moe.KEYS + moe.SHARED_KEYS + delta_net_hparams.KEYS + rope.IMROPE_KEYS + hyper_connections.KEYS
          + sparse_attention.KEYS + ngram_embedding.KEYS),
    relations=(moe.RELATIONS + delta_net_hparams.RELATIONS + rope.IMROPE_RELATIONS + sparse_attention.RELATIONS
               + ngram_embedding.RELATIONS),
    read=read,
    block_tensors=block_tensors,
    block=Layer,  # type: ignore[arg-type]  # on the hyper-connection streams (ArchSpec.residual_streams)
    draft_block=draft_block,  # type: ignore[arg-type]  # the whole MTP layer (MtpLayer), not a Block
    nextn_tensors=nextn_tensors,
    delta_net=DELTA_NET,
    shared_expert=True,
    head_tensors=head_tensors,
    residual_streams=True,
    synth_keys=synth_keys,
    tiny=TINY_SHAPE,
    presets={"qwen4exp-flash": FLASH_SHAPE, "qwen4exp-full": FULL_SHAPE, "qwen4exp-tiny": TINY_SHAPE},
    # the sparse attention's indexer and block selection, the n-gram table and the stream mixes
    # have no CUDA kernels yet
    devices=("cpu",),
)
