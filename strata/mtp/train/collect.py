"""Training text for a draft: the target's own tokens, final-normed hiddens and next-token logits.

Two sources, both run through Strata's own Transformer (no PyTorch needed here), on either
backend (only Transformer.forward/logits/new_cache and the backend's to_host are used):
- `generate`: the target answers prompts itself, many sequences per window (a batched decode
  costs about what one sequence costs on a memory-bound CPU), greedy or sampled;
- `prefill_text`: text the user gives, cut into pieces and prefilled (logits for every row).

Per sequence we keep tokens x_0..x_{N-1}, hiddens h_0..h_{N-2} (what Transformer.forward
returns: the input of the output head) and, for the rows where the target's next-token
distribution was computed, its top-K logits. The draft entry for x_p reads h_{p-1} and is
taught the target's distribution logits(h_p).

Progress lines are bare ("data: ..."): the command that runs the stage puts its name in front.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata.model.transformer import Span

TOP_K = 16  # target logits kept per row: the candidates the draft must rank like the target


@dataclass
class Sequence:
    tokens: np.ndarray  # (N,) int32
    hidden: np.ndarray  # (N-1, E) float16: h_0..h_{N-2}
    top_ids: np.ndarray  # (N-1, K) int32: target's top-K next tokens at rows 0..N-2 (-1: not computed)
    top_logits: np.ndarray  # (N-1, K) float32
    kind: str = ""


class _Live:
    def __init__(self, index: int, kind: str, prompt: list[int], cache, greedy: bool, max_new: int, rng):
        self.index = index  # the prompt's place in the list: results come back in that order
        self.kind = kind
        self.tokens = list(prompt)
        self.n_prompt = len(prompt)
        self.cache = cache
        self.greedy = greedy
        self.max_new = max_new
        self.rng = rng
        self.hidden: list[np.ndarray] = []
        self.tops: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.fed = 0  # tokens already in the cache

    def finish(self, E: int) -> Sequence:
        n = len(self.tokens)
        hid = np.concatenate(self.hidden, axis=0)[: n - 1].astype(np.float16)
        ids = np.full((n - 1, TOP_K), -1, np.int32)
        lg = np.zeros((n - 1, TOP_K), np.float32)
        for row, (i, v) in self.tops.items():
            if row < n - 1:
                ids[row], lg[row] = i, v
        return Sequence(np.asarray(self.tokens, np.int32), hid, ids, lg, self.kind)


def _top(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    idx = np.argpartition(-row, TOP_K)[:TOP_K]
    idx = idx[np.argsort(-row[idx], kind="stable")]
    return idx.astype(np.int32), row[idx].astype(np.float32)


SAMPLE_TOP = 50  # top-50 sampling: varied but on-distribution text


def _sample(row: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    top = np.argpartition(-row, SAMPLE_TOP)[:SAMPLE_TOP]
    return _sample_from(top, row[top], temperature, rng)


def _sample_from(ids: np.ndarray, vals: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    z = vals.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(ids[rng.choice(len(ids), p=p / p.sum())])


class _DeviceRows:
    """A window's logits rows reduced on the device (GPU backend): the SAMPLE_TOP best ids and
    logits of each row, best first, and its argmax; only those cross to the host, not the
    49k-wide rows, so collection keeps up with a 64-slot decode."""

    def __init__(self, xp, logits):
        order = xp.argsort(-logits, axis=1)[:, :SAMPLE_TOP]
        self.ids = xp.asnumpy(order).astype(np.int32)
        self.vals = xp.asnumpy(xp.take_along_axis(logits, order, axis=1)).astype(np.float32)
        self.best = xp.asnumpy(xp.argmax(logits, axis=1))

    def top(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[r, :TOP_K], self.vals[r, :TOP_K]


def answer_modes(n: int, sample_every: int = 2, sampled_from: int | None = None) -> list[bool]:
    """Greedy (True) or sampled, per prompt: every `sample_every`-th sampled (0: none), and all
    from `sampled_from` on."""
    return [(sample_every <= 0 or i % sample_every != sample_every - 1) and (sampled_from is None or i < sampled_from)
            for i in range(n)]


def generate(model, prompts: list[tuple[str, list[int]]], *, slots: int = 16, max_new: int = 160,
             sample_every: int = 2, temperature: float = 0.8, eog: set[int] = frozenset(), seed: int = 0,
             log: Callable[[str], None] = print, time_budget_s: float | None = None,
             sampled_from: int | None = None, greedy: list[bool] | None = None,
             what: str = "answers") -> list[Sequence]:
    """Let the target answer every prompt; one window decodes all live sequences together.

    Every `sample_every`-th prompt is sampled (temperature, top-50; 1: all, 0: none), the rest
    greedy: greedy text is what greedy acceptance is measured on, sampled text adds variety.
    Prompts from index `sampled_from` on are all sampled (more answers to the same prompts:
    each has its own random stream). `greedy`, one flag per prompt, overrides both rules.

    Newly admitted prompts are prefilled in a window of their own, so decode windows hold one
    token per sequence: on the GPU those (up to 64 rows) replay CUDA graphs instead of
    launching every kernel from Python. Admissions wait for an eighth of the slots to be
    free, so prompt windows stay rare.
    """
    E = model.cfg.n_embd
    modes = answer_modes(len(prompts), sample_every, sampled_from) if greedy is None else list(greedy)
    queue = deque(enumerate(prompts))
    live: list[_Live] = []
    done: list[tuple[int, Sequence]] = []
    caches = [model.new_cache(4096, "f16") for _ in range(slots)]
    admit_batch = max(1, slots // 8)
    t0 = time.perf_counter()
    n_tok, last_log = 0, t0
    while queue or live:
        out_of_time = time_budget_s is not None and time.perf_counter() - t0 > time_budget_s
        room = slots - len(live)
        admit = not out_of_time and (room >= min(admit_batch, len(queue)) or not live)
        while admit and queue and len(live) < slots:
            i, (kind, ids) = queue.popleft()
            used = {id(s.cache) for s in live}
            cache = next(c for c in caches if id(c) not in used)
            cache.length = 0
            live.append(_Live(i, kind, ids, cache, modes[i], max_new, np.random.default_rng([seed, i])))
        if not live:
            break
        # prompts just admitted go first, alone; then the decode windows (one token each)
        window = [s for s in live if len(s.tokens) - s.fed > 1] or live
        spans, toks = [], []
        for s in window:
            new = s.tokens[s.fed :]
            spans.append(Span(s.cache, s.fed, len(new)))
            toks.extend(new)
        last_rows = np.cumsum([sp.count for sp in spans]) - 1
        # the head on each sequence's last row inside the window (in the window's graph on cuda)
        hidden, logits = model.forward(np.asarray(toks, np.int64), spans, logit_rows=last_rows)
        xp = model.b.xp
        device = _DeviceRows(xp, logits) if xp is not np else None
        if device is None:
            logits = model.b.to_host(logits)
        hidden = model.b.to_host(hidden)
        off = 0
        keep = [s for s in live if s not in window]
        for r, (s, sp) in enumerate(zip(window, spans)):
            s.hidden.append(np.asarray(hidden[off : off + sp.count], np.float32))
            off += sp.count
            s.fed += sp.count
            if device is None:
                row = logits[r]
                s.tops[s.fed - 1] = _top(row)
                nxt = int(np.argmax(row)) if s.greedy else _sample(row, temperature, s.rng)
            else:
                s.tops[s.fed - 1] = device.top(r)
                nxt = int(device.best[r]) if s.greedy else _sample_from(device.ids[r], device.vals[r], temperature, s.rng)
            s.tokens.append(nxt)
            n_tok += 1
            if nxt in eog or len(s.tokens) - s.n_prompt >= s.max_new or out_of_time:
                done.append((s.index, s.finish(E)))
            else:
                keep.append(s)
        live = keep
        now = time.perf_counter()
        if now - last_log > 20:
            last_log = now
            log(f"data: {len(done)}/{len(prompts)} {what}, {n_tok} tokens generated, "
                f"{n_tok / (now - t0):.0f} tok/s")
    return [seq for _, seq in sorted(done, key=lambda d: d[0])]  # in prompt order, whatever finished first


def prefill_text(model, token_lists: list[list[int]], *, piece: int = 256, batch: int = 8,
                 log: Callable[[str], None] = print) -> list[Sequence]:
    """User text: pieces of `piece` tokens, prefilled `batch` at a time, logits for every row."""
    pieces = [t[i : i + piece] for t in token_lists for i in range(0, max(1, len(t) - 1), piece)]
    pieces = [p for p in pieces if len(p) >= 8]
    caches = [model.new_cache(piece, "f16") for _ in range(batch)]
    out: list[Sequence] = []
    t0 = time.perf_counter()
    for a in range(0, len(pieces), batch):
        group = pieces[a : a + batch]
        spans = []
        for c, p in zip(caches, group):
            c.length = 0
            spans.append(Span(c, 0, len(p)))
        hidden = model.forward(np.concatenate([np.asarray(p, np.int64) for p in group]), spans)
        logits = model.b.to_host(model.logits(hidden))
        hidden = model.b.to_host(hidden)
        off = 0
        for p in group:
            n = len(p)
            lg = logits[off : off + n - 1]
            idx = np.argpartition(-lg, TOP_K, axis=1)[:, :TOP_K]
            vals = np.take_along_axis(lg, idx, axis=1)
            order = np.argsort(-vals, axis=1, kind="stable")
            out.append(Sequence(np.asarray(p, np.int32), hidden[off : off + n - 1].astype(np.float16),
                                np.take_along_axis(idx, order, 1).astype(np.int32),
                                np.take_along_axis(vals, order, 1).astype(np.float32), "text"))
            off += n
        log(f"data: {min(a + batch, len(pieces))}/{len(pieces)} text pieces prefilled "
            f"({time.perf_counter() - t0:.0f} s)")
    return out


def save_sequences(path, seqs: list[Sequence]) -> None:
    """One .npz holding every sequence (concatenated, with lengths), so data is collected once."""
    lens = np.asarray([len(s.tokens) for s in seqs], np.int64)
    np.savez(path, lens=lens, kinds=np.asarray([s.kind for s in seqs]),
             tokens=np.concatenate([s.tokens for s in seqs]), hidden=np.concatenate([s.hidden for s in seqs]),
             top_ids=np.concatenate([s.top_ids for s in seqs]), top_logits=np.concatenate([s.top_logits for s in seqs]))


def load_sequences(path) -> list[Sequence]:
    with np.load(path) as z:  # each z[key] reads the whole array again: read every one once
        lens, kinds, tokens, hidden, top_ids, top_logits = (z[k] for k in (
            "lens", "kinds", "tokens", "hidden", "top_ids", "top_logits"))
    out, a, b = [], 0, 0
    for n, kind in zip(lens, kinds):
        n = int(n)
        out.append(Sequence(tokens[a : a + n], hidden[b : b + n - 1], top_ids[b : b + n - 1],
                            top_logits[b : b + n - 1], str(kind)))
        a += n
        b += n - 1
    return out
