"""The MTP draft module (nextn style; format in docs/MTP.md).

Weights are loaded once and shared by every slot (`DraftModel`); each slot owns a
`DraftState` (its own KV cache plus the main-model hidden states the draft has not consumed
yet). The draft's block input for token x_p is
    eh_proj([enorm(embed(x_p)); hnorm(h_{p-1})])
where h_{p-1} is the main model's final-normed hidden state at position p-1. Its output,
through `output_norm` and the main model's output head, predicts x_{p+1} (NextnNet).

A target on hyper-connection streams (qwen4exp) has an MTP layer of its own kind (StreamsNet:
the architecture's MtpLayer reads the streams h_{p-1} (c n_embd wide) and hands the next draft
step its own streams); its tensors may come under any writer's names (NAME_MAPS,
strata/pack/mtp_names.py) and are read under one.
"""

from __future__ import annotations

import re

import numpy as np
from typing import Any

from strata.backend.base import Backend
from strata.errors import StrataError
from strata.kernels.ggml_types import BY_NAME
from strata.model.archs import ARCHS
from strata.model.config import ModelConfig
from strata.model.kv_cache import KVCache
from strata.model.layers.block import WindowView
from strata.model.layers.tensors import expect
from strata.model.transformer import Span, advance
from strata.pack.mtp_names import canonical_tensors

NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.")

# tensor roles of a draft, file form -> in-pack nextn form (block index N = the nextn layer)
_FILE_NAMES = {
    "enorm": "mtp.enorm.weight",
    "hnorm": "mtp.hnorm.weight",
    "eh_proj": "mtp.eh_proj.weight",
    "output_norm": "mtp.output_norm.weight",
}
_NEXTN_NAMES = {
    "enorm": "blk.{n}.nextn.enorm.weight",
    "hnorm": "blk.{n}.nextn.hnorm.weight",
    "eh_proj": "blk.{n}.nextn.eh_proj.weight",
    "output_norm": "blk.{n}.nextn.shared_head_norm.weight",
}


VOCAB_TENSOR = "mtp.vocab"  # optional, I32 [N]: the tokens the draft may propose (docs/MTP.md)


def draft_vocab(src: DraftSource, n_vocab: int) -> np.ndarray | None:
    """The draft's vocabulary (ascending token ids), or None when it may propose any token."""
    t = src.get(VOCAB_TENSOR)
    if t is None:
        return None
    where = f"{src.label}: {VOCAB_TENSOR}"
    if t.ggml_type != BY_NAME["I32"].id or len(t.shape) != 1:
        raise StrataError(f"{where}: expected a 1-D I32 tensor of token ids")
    ids = np.frombuffer(np.asarray(t.data()).tobytes(), dtype="<i4").astype(np.int64)
    if ids.size == 0 or ids[0] < 0 or ids[-1] >= n_vocab or np.any(np.diff(ids) <= 0):
        raise StrataError(f"{where}: expected distinct token ids in ascending order, each below the "
                          f"target's vocabulary of {n_vocab}")
    return ids


class DraftSource:
    """Where a draft's tensors come from: a separate GGUF (`mtp.*`) or nextn tensors in the pack."""

    def __init__(self, tensors: dict[str, Any], names: dict[str, str], block_prefix: str, label: str):
        self.tensors = tensors
        self.names = names
        self.block_prefix = block_prefix
        self.label = label

    def get(self, name: str):
        return self.tensors.get(name)

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tensors.values())


def find_draft(mtp: str | None, pack, label: str | None = None) -> DraftSource | None:
    """The draft named by --mtp (file or dir), else nextn tensors inside the pack, else None.

    A draft file's metadata is checked once, here, against its key table
    (strata.pack.draft_rules: types, ranges, and its target's architecture and width).
    label: how messages name the file (default "--mtp FILE")."""
    if mtp:
        from strata.pack.draft_rules import checked_draft_values
        from strata.pack.loader import open_pack, user_path

        label = label or f"--mtp {mtp}"
        p = user_path(mtp)
        if not p.exists():
            raise StrataError(f"{label}: no such file or directory")
        dp = open_pack(pack=str(p))
        checked_draft_values(f"{label}: ", dp.metadata, dp.metadata_types, pack)
        nextn = _nextn_source(dp.tensors, f"{label} (nextn layer {{n}})", label, _arch(pack), mtp_only=True)
        if nextn is not None:  # an MTP-only GGUF, as llama.cpp's converter writes it
            return nextn
        tensors = {k: v for k, v in dp.tensors.items() if k.startswith("mtp.")}
        if "mtp.eh_proj.weight" not in tensors:
            raise StrataError(f"{label}: no MTP draft tensors (neither mtp.eh_proj.weight "
                              f"nor blk.N.nextn.eh_proj.weight)")
        return DraftSource(tensors, dict(_FILE_NAMES), "mtp.blk.", label)
    return _nextn_source(pack.tensors, "nextn layer {n} of the pack", f"pack {pack.label}", _arch(pack),
                         mtp_only=False)


# by the target's residual (ArchSpec.residual_streams): the map of a file's MTP names onto the
# one layout read, where several writers name that layer's tensors differently ((tensors, label,
# mtp_only) -> (block N, {canonical name: tensor}) or None); None: the nextn names as they are
NAME_MAPS = {False: None, True: canonical_tensors}


def _arch(pack: Any) -> str | None:
    return pack.metadata.get("general.architecture")


def _name_map(arch: str | None):
    spec = ARCHS.get(arch or "")
    return NAME_MAPS[spec is not None and spec.residual_streams]


def _nextn_source(all_tensors: dict[str, Any], label: str, where: str, arch: str | None, *,
                  mtp_only: bool) -> DraftSource | None:
    """The first nextn layer's tensors (blk.N.*, N its index), or None without one; where the
    architecture has a NAME_MAPS entry, under the canonical names (errors name `where`)."""
    mapper = _name_map(arch)
    if mapper is not None:
        found = mapper(all_tensors, where, mtp_only=mtp_only)
        if found is None:
            return None
        n, tensors = found
        return DraftSource(tensors, {k: v.format(n=n) for k, v in _NEXTN_NAMES.items()}, f"blk.{n}.",
                           label.format(n=n))
    layers = sorted({int(m.group(1)) for name in all_tensors if (m := NEXTN.match(name))})
    if not layers:
        return None
    n = layers[0]
    prefix = f"blk.{n}."
    tensors = {k: v for k, v in all_tensors.items() if k.startswith(prefix)}
    names = {k: v.format(n=n) for k, v in _NEXTN_NAMES.items()}
    return DraftSource(tensors, names, prefix, label.format(n=n))


class NextnNet:
    """A nextn draft (module doc): input norms and eh_proj on one vector per position, the
    architecture's draft block, the head norm; the target's head."""

    def __init__(self, backend: Backend, cfg: ModelConfig, src: DraftSource, target: Any):
        self.b, self.target = backend, target
        E = cfg.n_embd

        def need(role: str, shape):
            name = src.names[role]
            return expect(src.get(name), f"{src.label}: {name}", shape)

        self.enorm = backend.vector(need("enorm", (E,)))
        self.hnorm = backend.vector(need("hnorm", (E,)))
        self.eh_proj = backend.linear_weight([need("eh_proj", (2 * E, E))])
        # a nextn layer without its own head norm shares the model's (llama.cpp's reading)
        head_norm = src.get(src.names["output_norm"])
        if head_norm is None and src.block_prefix.startswith("blk."):
            self.output_norm = target.output_norm
        else:
            self.output_norm = backend.vector(need("output_norm", (E,)))
        # the draft's block, built by the target's architecture from its own layers (a nextn
        # layer: gated attention with the target's FFN)
        self.cfg, self.layer = target.draft_parts(cfg, src.get, src.block_prefix)

    def block_out(self, tokens: Any, hidden: Any, spans: list[Span]) -> Any:
        """The block output rows (pre-norm) of a window."""
        b, c, xp = self.b, self.cfg, self.b.xp
        e = b.rms_norm(b.embed(self.target.embd, tokens), self.enorm, c.rms_eps)
        h = b.rms_norm(hidden, self.hnorm, c.rms_eps)
        x = b.linear(self.eh_proj, xp.concatenate([e, h], axis=1))
        x, y = self.layer.run(x, None, WindowView(spans, spans, b.begin_window(spans)))
        return x + y

    def finish(self, rows: Any) -> tuple[Any, Any]:
        """Block output rows -> (the next step's hidden, the head's input): both the normed rows."""
        normed = self.b.rms_norm(rows, self.output_norm, self.cfg.rms_eps)
        return normed, normed

    def logits(self, x: Any) -> Any:
        return self.target.logits(x)

    def new_cache(self, max_ctx: int, kind: str) -> KVCache:
        c = self.cfg
        return KVCache(self.b.xp, 1, c.n_head_kv, c.head_dim, max_ctx, kind)

    def state_bytes(self, max_ctx: int, kind: str) -> int:
        """Private bytes per slot at full context: the draft KV cache (1 layer) + buffers."""
        c = self.cfg
        per_tok = 2 * c.n_head_kv * c.head_dim * (2 if kind == "f16" else 1)
        if kind == "int8":
            per_tok += 2 * c.n_head_kv * 4
        buffers = 4 * (3 * c.n_embd + self.target.n_vocab) * 8  # per-step activations, logits
        return per_tok * max_ctx + buffers


class StreamsNet:
    """The MTP layer of an architecture on hyper-connection streams (ArchSpec.residual_streams,
    qwen4exp): the architecture's draft block is the whole layer (archs/qwen4exp.py MtpLayer:
    its input projection, decoder layer and exit mixer, with its own state); it reads the
    target's streams (the target's hidden rows) and hands its own to the next step."""

    def __init__(self, backend: Backend, cfg: ModelConfig, src: DraftSource, target: Any):
        self.b, self.target = backend, target
        self.cfg, self.mtp = target.draft_parts(cfg, src.get, src.block_prefix)

    def block_out(self, tokens: Any, hidden: Any, spans: list[Span]) -> Any:
        b = self.b
        return self.mtp.block_out(b.embed(self.target.embd, tokens), hidden, spans, b.begin_window(spans))

    def finish(self, rows: Any) -> tuple[Any, Any]:
        return self.mtp.finish(rows)

    def logits(self, x: Any) -> Any:
        return self.b.linear(self.target.output, x)

    def new_cache(self, max_ctx: int, kind: str) -> Any:
        return self.target.draft_cache(max_ctx, kind)

    def state_bytes(self, max_ctx: int, kind: str) -> int:
        return self.mtp.state_bytes(max_ctx, kind)


# the draft's network by the target's residual (ArchSpec.residual_streams)
NETS = {False: NextnNet, True: StreamsNet}


class DraftModel:
    """Shared draft weights + the ops to run them for one slot at a time."""

    def __init__(self, backend: Backend, cfg: ModelConfig, src: DraftSource, target: Any):
        self.b = backend
        self.src = src
        self.target = target
        self.net = NETS[target.spec.residual_streams](backend, cfg, src, target)
        self.cfg = self.net.cfg
        # window graphs where the target's take them
        self.graphs = backend.graphs if target.draft_graphable else None
        # A draft vocabulary narrows the shared head to its tokens where the backend asks for it
        # (the CPU, where the head is ~20% of a target step; on the GPU it is a few us of a
        # window and the full head stays). Verification is exact whatever the draft proposes.
        self.vocab = draft_vocab(src, target.n_vocab)
        self.head_subset = backend.head_columns(target.output, self.vocab) if self.vocab is not None else None

    def new_cache(self, max_ctx: int, kind: str) -> Any:
        return self.net.new_cache(max_ctx, kind)

    def _prepare(self, items: list[tuple[KVCache, Any, Any]]):
        """Tokens (host), main hiddens (device) and spans of a draft window; caches get room."""
        xp = self.b.xp
        tokens = np.concatenate([np.asarray(t, dtype=np.int64).reshape(-1) for _, t, _ in items])
        hidden = items[0][2] if len(items) == 1 else xp.concatenate([h for _, _, h in items], axis=0)
        spans = [Span(cache, cache.length, int(np.asarray(t).size)) for cache, t, _ in items]
        for sp in spans:
            sp.cache.ensure(sp.start + sp.count)
        return tokens, hidden, spans

    def _block_out(self, tokens: Any, hidden: Any, spans: list[Span]) -> Any:
        """The draft's device work for a window: block output rows (before `finish`)."""
        return self.net.block_out(tokens, hidden, spans)

    def _run(self, items: list[tuple[KVCache, Any, Any]]) -> Any:
        """One draft forward over several slots: items are (cache, tokens (m,), main hiddens (m, E)).

        Each item is a span appended to its own cache; returns the block output rows (pre-norm).
        """
        tokens, hidden, spans = self._prepare(items)
        out = self._block_out(tokens, hidden, spans)
        advance(spans)
        return out

    def head(self, normed: Any) -> Any:
        """Logits of the draft's rows through the shared output head: all of them, or (a
        narrowed head) its vocabulary's, the other tokens at -inf so they are never proposed."""
        if self.head_subset is None:
            return self.net.logits(normed)
        xp = self.b.xp
        full = xp.full((normed.shape[0], self.target.n_vocab), -xp.inf, dtype=xp.float32)
        full[:, self.vocab] = self.b.linear(self.head_subset, normed)
        return full

    def step(self, cache: KVCache, tokens: Any, hidden: Any):
        """Append draft entries for `tokens` (m,) with main hiddens `hidden` (m, E) (h_{p-1} per x_p).

        Returns (draft hidden (m, E), logits (m, vocab)) for every row (a draft on streams:
        its streams (m, c E)).
        """
        carry, head_in = self.net.finish(self._run([(cache, tokens, hidden)]))
        return carry, self.head(head_in)

    def last_rows(self, tokens: Any, hidden: Any, ends: Any, spans: list[Span], full: bool = True):
        out = self._block_out(tokens, hidden, spans)
        carry, head_in = self.net.finish(out[ends])
        logits = self.head(head_in)
        return (carry, logits) if full else (carry, *self.b.top_rows(logits))

    def step_last(self, items: list[tuple[KVCache, Any, Any]], full: bool = True):
        """Like step, batched over slots, but only each item's last row goes through the head.

        Returns (draft hiddens (n_items, E), host logits (n_items, vocab)); with full=False
        (greedy drafting) (draft hiddens, (argmax ids, top probabilities) on the host) instead,
        so a whole vocabulary per row never leaves the device. On a backend with window graphs
        (CUDA) the whole step, head included, replays one captured graph.
        """
        b = self.b
        tokens, hidden, spans = self._prepare(items)
        ends = np.cumsum([sp.count for sp in spans]) - 1
        graphs = self.graphs
        if graphs is not None and graphs.takes(spans):
            def window(d):
                return self.last_rows(d["tokens"], d["hidden"], d["ends"], spans, full)

            inputs = {"tokens": tokens, "hidden": hidden, "ends": ends}
            # all read before the next draft step replays: the hiddens feed it, the rest goes
            # to the host now
            outs = graphs.run_fn(("draft", id(self), full), window, inputs, spans, borrow=(True, True, True))
        else:
            outs = self.last_rows(tokens, hidden, b.xp.asarray(ends), spans, full)
        advance(spans)
        if full:
            return outs[0], b.to_host(outs[1])
        return outs[0], (b.to_host(outs[1]), b.to_host(outs[2]))

    def can_chain(self, items: list[tuple[KVCache, Any, Any]]) -> bool:
        """Whether chain_greedy runs these items as one graph (a backend with window graphs)."""
        graphs = self.graphs
        return graphs is not None and graphs.takes([Span(c, c.length, int(np.asarray(t).size)) for c, t, _ in items])

    def chain_greedy(self, items: list[tuple[KVCache, Any, Any]], k: int) -> tuple[np.ndarray, np.ndarray]:
        """k greedy draft steps for several slots in one graph replay: step 1 over each item's
        tokens (catch-up, as step_last), steps 2..k each fed the previous step's argmax and
        draft hidden on the device, so the host waits once instead of once per step.
        Returns host arrays (ids (n_items, k), top probabilities (n_items, k)). Each cache
        keeps step 1's entries only (the speculative steps' entries are rolled back): the
        same drafts and the same cache as k calls of step_last(full=False) that never stop.
        Needs can_chain(items)."""
        b = self.b
        tokens, hidden, spans = self._prepare(items)
        n = len(spans)
        ends = np.cumsum([sp.count for sp in spans]) - 1
        committed = [sp.start + sp.count for sp in spans]
        for sp, c in zip(spans, committed):
            sp.cache.ensure(c + k - 1)
        steps = [[Span(sp.cache, c + j, 1) for sp, c in zip(spans, committed)] for j in range(k - 1)]

        def window(d):
            g, ids, top = self.last_rows(d["tokens"], d["hidden"], d["ends"], spans, full=False)
            all_ids, all_top = [ids], [top]
            for step in steps:
                g, ids, top = self.last_rows(ids, g, d["rows"], step, full=False)
                all_ids.append(ids)
                all_top.append(top)
            return b.xp.stack(all_ids, axis=1), b.xp.stack(all_top, axis=1)

        inputs = {"tokens": tokens, "hidden": hidden, "ends": ends, "rows": np.arange(n)}
        ids, top = self.graphs.run_fn(("draft-chain", id(self), k), window, inputs, spans, borrow=(True, True), more=steps)
        for sp, c in zip(spans, committed):
            sp.cache.length = c
        return b.to_host(ids), b.to_host(top)

    def state_bytes(self, max_ctx: int, kind: str) -> int:
        """Private bytes per slot at full context: the draft's cache + buffers."""
        return self.net.state_bytes(max_ctx, kind)
