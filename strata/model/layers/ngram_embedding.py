"""The per-layer n-gram embedding (qwen4exp's PLE): hashed 2- and 3-grams of the token ids look up
rows of one large table, and the result is gated into every hyper-connection stream on the
layers `ple.layers` names (transformers models/qwen4_exp/modeling_qwen4_exp.py:1074-1250;
llama.cpp src/models/qwen4exp.cpp:1044-1308).

Context (modeling_qwen4_exp.py:1110-1123): t_0 is the token itself, t_s the token s back; walking
back from t_1, the first EOS (`ple.eos_token_id`) or the sequence's start turns that slot and every
older one into EOS (the token's own EOS does not cut). Positions fed as image or video embeddings
hash `ple.image_token_id` (llama.cpp's rule; Strata feeds token ids only, which hash themselves).

Hash (modeling_qwen4_exp.py:1148-1161): for n = 2 .. N, m_n = XOR_{j<n} t_j * mult_j in 64-bit
integers (the key table keeps each product below 2^63, where signed and unsigned agree); head h
of the heads_per_ngram heads of n-gram n takes row (m_n mod vocab_h) + offset_h. The rows of all
heads, head-major, are one embedding e of (N - 1) * heads_per_ngram * row_len values.

The layer (modeling_qwen4_exp.py:1231-1250), over the streams X (n, c, E):

    k = RMS_c(W_key e) (c, E);  v = W_value e (E);  q = RMS_c(X)
    s_c = <k_c, q_c> / sqrt(E);  s_c <- sign(s_c) sqrt(max(|s_c|, 1e-6));  G_c = sigmoid(s_c) v
    C = silu(conv(RMS_c(G)))    depthwise, kernel K, dilation N: tap j reads t - (K-1-j) N
    X <- X + G + C

RMS_c is a per-stream RMS norm with its own (c x E) gains. The conv reads (K-1) N earlier rows of
RMS_c(G): the sequence state's PLE history (zero at the start; strata/model/qwen4exp_state.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from strata.backend.base import Backend, TensorSource
from strata.errors import StrataError
from strata.gguf.key_rules import AT_LEAST_1, Key, Kind, Range, Relation
from strata.gguf.reader import TensorInfo
from strata.gguf.row_source import HostTables
from strata.kernels.dequant import dequantize_rows
from strata.kernels.ggml_types import type_by_id
from strata.model.layers.attention import norm_spec
from strata.model.layers.hyper_connections import grouped_rms
from strata.model.layers.tensors import Reader, TensorSpec

TABLE = "per_layer_token_embd.weight"
GATE_FLOOR = 1e-6  # |s| is floored here before its square root (modeling_qwen4_exp.py:1241)


def _n_heads(v) -> int:
    return (v["ple.ngram_size"] - 1) * v["ple.heads_per_ngram"]


def _products_fit(v) -> bool:
    """Each t_j * mult_j below 2^63 for every token id (t_j < the vocabulary's size)."""
    top = max(1, len(v["tokenizer.ggml.tokens"]) - 1)
    return all(int(m) * top < 2**63 for m in v["ple.layer_multipliers"])


def _heads_apart(v) -> bool:
    """Each head's rows end where the next head's begin, or before."""
    off, size = [int(x) for x in v["ple.head_offsets"]], [int(x) for x in v["ple.head_vocab_sizes"]]
    return all(size[i] >= 1 for i in range(len(size))) and \
        all(off[i] + size[i] <= off[i + 1] for i in range(len(off) - 1)) and (not off or off[0] >= 0)


KEYS = (
    Key("ple.layers", Kind.COUNTS),
    Key("ple.ngram_size", Kind.COUNT, range=Range(2, 8), default=3),
    Key("ple.heads_per_ngram", Kind.COUNT, range=Range(1, 1024), default=8),
    Key("ple.conv_kernel", Kind.COUNT, range=Range(1, 64), default=4),
    Key("ple.eos_token_id", Kind.COUNT),
    Key("ple.image_token_id", Kind.COUNT),
    Key("embedding_length_per_layer_input", Kind.COUNT, range=AT_LEAST_1),
    Key("ple.layer_multipliers", Kind.COUNTS),
    Key("ple.head_offsets", Kind.COUNTS),
    Key("ple.head_vocab_sizes", Kind.COUNTS),
)
# what a pack with PLE layers must also hold (checked by `required_with_layers`)
WITH_LAYERS = ("ple.eos_token_id", "embedding_length_per_layer_input", "ple.layer_multipliers",
               "ple.head_offsets", "ple.head_vocab_sizes")
RELATIONS = (
    Relation("ple.layers", ("ple.layers", "block_count"),
             lambda v: all(0 <= int(i) < v["block_count"] for i in v["ple.layers"])
             and len(set(int(i) for i in v["ple.layers"])) == len(v["ple.layers"]),
             lambda v: f"must be distinct layer indices below block_count ({v['block_count']})"),
    Relation("ple.layer_multipliers", ("ple.layer_multipliers", "ple.ngram_size"),
             lambda v: len(v["ple.layer_multipliers"]) == v["ple.ngram_size"],
             lambda v: f"must have one entry per n-gram position (ple.ngram_size = {v['ple.ngram_size']})"),
    Relation("ple.layer_multipliers", ("ple.layer_multipliers", "tokenizer.ggml.tokens"), _products_fit,
             lambda v: "must keep every token id x multiplier below 2^63"),
    Relation("ple.head_offsets", ("ple.head_offsets", "ple.ngram_size", "ple.heads_per_ngram"),
             lambda v: len(v["ple.head_offsets"]) == _n_heads(v),
             lambda v: f"must have one entry per head ((ple.ngram_size - 1) x ple.heads_per_ngram = {_n_heads(v)})"),
    Relation("ple.head_vocab_sizes", ("ple.head_vocab_sizes", "ple.head_offsets"),
             lambda v: len(v["ple.head_vocab_sizes"]) == len(v["ple.head_offsets"]),
             lambda v: f"must have one entry per head ({len(v['ple.head_offsets'])} in ple.head_offsets)"),
    Relation("ple.head_vocab_sizes", ("ple.head_vocab_sizes", "ple.head_offsets"), _heads_apart,
             lambda v: "must be >= 1 and keep each head's rows [offset, offset + size) apart from the next head's"),
    Relation("ple.eos_token_id", ("ple.eos_token_id", "tokenizer.ggml.tokens"),
             lambda v: 0 <= v["ple.eos_token_id"] < len(v["tokenizer.ggml.tokens"]),
             lambda v: f"must be a token id below {len(v['tokenizer.ggml.tokens'])}"),
)


def required_with_layers(v, where: str, arch: str) -> None:
    """A pack with PLE layers needs the hash's keys (one line naming the first missing)."""
    if not len(v.get("ple.layers") or ()):
        return
    for name in WITH_LAYERS:
        if v.get(name) is None:
            raise StrataError(f"{where}metadata key {arch}.{name}: missing (ple.layers names PLE layers)")


def tensors(p: str, n_embd: int, count: int, embed_dim: int, kernel: int, table_rows: int,
            row_len: int) -> list[TensorSpec]:
    """A PLE layer's tensors (prefix p), and the table (once, with the first PLE layer)."""
    W = count * n_embd
    return [TensorSpec(p + "ple_key.weight", (embed_dim, W), "ple_proj"),
            TensorSpec(p + "ple_value.weight", (embed_dim, n_embd), "ple_proj"),
            norm_spec(p + "ple_norm_key.weight", W), norm_spec(p + "ple_norm_query.weight", W),
            norm_spec(p + "ple_norm_conv.weight", W),
            TensorSpec(p + "ple_conv1d.weight", (kernel, W), fill="bias", scale=0.3),
            TensorSpec(TABLE, (row_len, table_rows), "ple_table")]


def context(tokens: np.ndarray, start: int, count: int, n: int, eos: int) -> np.ndarray:
    """(count, n) ids t_0 .. t_{n-1} of positions [start, start + count), from `tokens` (every
    position of the sequence up to start + count): the EOS cut of the module doc."""
    out = np.empty((count, n), np.int64)
    pos = np.arange(start, start + count)
    out[:, 0] = tokens[pos]
    cut = np.zeros(count, bool)  # an EOS (or the start) seen walking back
    for s in range(1, n):
        src = pos - s
        inside = src >= 0
        prev = np.where(inside, tokens[np.maximum(src, 0)], eos)
        cut |= ~inside
        out[:, s] = np.where(cut, eos, prev)
        cut |= prev == eos
    return out


def hashed_rows(ctx: np.ndarray, mult: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                heads_per: int) -> np.ndarray:
    """ctx (t, N) context ids -> (t, (N-1) * heads_per) table rows, head-major (module doc)."""
    prod = ctx.astype(np.uint64) * mult.astype(np.uint64)[None, :]
    mixed = prod[:, 0]
    cols = []
    for n in range(2, ctx.shape[1] + 1):
        mixed = mixed ^ prod[:, n - 1]
        h = slice((n - 2) * heads_per, (n - 1) * heads_per)
        cols.append(mixed[:, None] % sizes[None, h].astype(np.uint64) + offsets[None, h].astype(np.uint64))
    return np.concatenate(cols, axis=1).astype(np.int64)


class RowTable:
    """The n-gram table read by rows: far too large to decode whole or to send to the device (320M
    rows on the real model), it stays on the host, and each window's rows come from a RowSource
    (strata/gguf/row_source.py, the mode --ple-io picks) as raw blocks, dequantized here; any
    GGML type whose blocks tile a row. Its shape is held to the metadata before it is opened
    (ram copies the whole table)."""

    def __init__(self, src: TensorInfo, hp: Any, tables: HostTables):
        row_len, self.rows = int(src.shape[0]), int(src.shape[1])
        gtype = type_by_id(src.ggml_type)
        if gtype is None or row_len % gtype.block_size:
            raise StrataError(f"tensor {src.name}: rows of {row_len} values are not whole blocks of its type")
        self.ggml_type, self.row_len = src.ggml_type, row_len
        self.row_bytes = row_len // gtype.block_size * gtype.type_size
        check_table(self, hp)
        self.source = tables.open(src, self.row_bytes, "n-gram table")

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """ids (...) row indices -> (..., row_len) float32."""
        raw = self.source.rows(ids.reshape(-1))
        return dequantize_rows(self.ggml_type, raw).reshape(*ids.shape, self.row_len)


def check_table(table: RowTable, hp: Any) -> None:
    """The table holds every row the hash reaches and rows of the metadata's width."""
    if table.row_len != hp.ple_row:
        raise StrataError(f"tensor {TABLE} has rows of {table.row_len} values but the metadata implies "
                          f"{hp.ple_row} (embedding_length_per_layer_input)")
    if table.rows < hp.ple_table_rows:
        raise StrataError(f"tensor {TABLE} has {table.rows} rows but ple.head_offsets + ple.head_vocab_sizes "
                          f"reach row {hp.ple_table_rows}")


class NGramEmbedding:
    """One PLE layer (module doc); the hash's constants come from the config (archs/qwen4exp.py)."""

    def __init__(self, b: Backend, r: Reader, table: RowTable, hp: Any, n_embd: int, eps: float):
        c, W = hp.hc_count, hp.hc_count * n_embd
        D = hp.ple_embed_dim
        self.b, self.hp, self.table, self.E, self.c, self.eps = b, hp, table, n_embd, c, eps
        self.w_key = b.linear_weight([r.req("ple_key.weight", (D, W))])
        self.w_value = b.linear_weight([r.req("ple_value.weight", (D, n_embd))])
        self.norm_key = b.vector(r.req("ple_norm_key.weight", (W,))).reshape(c, n_embd)
        self.norm_query = b.vector(r.req("ple_norm_query.weight", (W,))).reshape(c, n_embd)
        self.norm_conv = b.vector(r.req("ple_norm_conv.weight", (W,))).reshape(c, n_embd)
        K = hp.ple_conv_kernel
        self.conv_w = b.vector(r.req("ple_conv1d.weight", (K, W))).reshape(W, K)
        self.mult = np.asarray(hp.ple_multipliers, np.uint64)
        self.offsets = np.asarray(hp.ple_head_offsets, np.uint64)
        self.sizes = np.asarray(hp.ple_head_sizes, np.uint64)

    def rows(self, spans: Sequence[Any]) -> np.ndarray:
        """The window's table rows (n, heads), span after span, from each sequence's tokens."""
        hp = self.hp
        out = [hashed_rows(context(sp.cache.tokens, sp.start, sp.count, hp.ple_ngram, hp.ple_eos),
                           self.mult, self.offsets, self.sizes, hp.ple_heads_per_ngram) for sp in spans]
        return np.concatenate(out, axis=0)

    def run(self, X: Any, spans: Sequence[Any]) -> Any:
        """X (n, c, E) the window's streams -> G + C (n, c, E), to add to them; each span's PLE
        history is read at its start and its next one handed to its state."""
        b, xp, n, c, E = self.b, self.b.xp, X.shape[0], self.c, self.E
        e = b.asarray(self.table.gather(self.rows(spans)).reshape(n, -1))
        k = grouped_rms(b, b.linear(self.w_key, e).reshape(n, c, E), self.norm_key, self.eps)
        v = b.linear(self.w_value, e)
        q = grouped_rms(b, X, self.norm_query, self.eps)
        s = (k * q).sum(axis=-1) * (1.0 / float(E) ** 0.5)  # (n, c)
        s = xp.sign(s) * xp.sqrt(xp.maximum(xp.abs(s), GATE_FLOOR))
        G = b.sigmoid(s)[:, :, None] * v[:, None, :]
        Gn = grouped_rms(b, G, self.norm_conv, self.eps).reshape(n, c * E)
        convs, off = [], 0
        for sp in spans:
            rows = Gn[off : off + sp.count]
            convs.append(self._conv(sp.cache.ple_history(), rows))
            sp.cache.keep_ple_rows(rows)
            off += sp.count
        C = convs[0] if len(convs) == 1 else xp.concatenate(convs, axis=0)
        return G + C.reshape(n, c, E)

    def _conv(self, history: Any, rows: Any) -> Any:
        """silu of the dilated causal depthwise conv of rows (t, W) after history ((K-1) N, W)."""
        b, xp = self.b, self.b.xp
        K, dil, t = self.hp.ple_conv_kernel, self.hp.ple_ngram, rows.shape[0]
        xin = xp.concatenate([history, rows], axis=0)  # (K-1) dil + t rows
        y = xin[0:t] * self.conv_w[:, 0]
        for j in range(1, K):
            y = y + xin[j * dil : j * dil + t] * self.conv_w[:, j]
        return y * b.sigmoid(y)
