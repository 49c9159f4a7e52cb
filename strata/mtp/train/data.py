"""The draft's training data: the target loaded with Strata's own engine, the text it answers
(built-in prompts, requests it writes itself, or files given with --data) as `Sequence`s, and
the length-bucketed batches both trainers draw from.

Log lines here are bare ("data: ..."): the command that runs the stage names itself in front.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from strata.engine.core import EngineCore
from strata.engine.options import parse_engine_args
from strata.errors import StrataError
from strata.mtp.train.collect import Sequence, answer_modes, generate, load_sequences, prefill_text, save_sequences
from strata.mtp.train.config import TrainConfig
from strata.mtp.train.measure import chat_ids
from strata.mtp.train.prompts import HELD_OUT, held_out, training_prompts
from strata.mtp.train.self_prompts import write_prompts

SELF_KIND = "self"  # answers to requests the target wrote itself
SELF_PROMPT_SHARE = 0.25  # of --data-minutes, at most, for writing the requests


def load_target(pack: str | None, log: Callable[[str], None], device: str = "cpu") -> EngineCore:
    args = ["--device", device] + (["--pack", str(pack)] if pack else [])
    return EngineCore.load(parse_engine_args(args, serving=False), log=lambda s: None)


def collect_data(core, cfg: TrainConfig, log) -> tuple[list[Sequence], list[Sequence]]:
    """(training sequences, held-out answers): the held-out prompts answered greedily, for
    teacher-forced acceptance while training."""
    eog = set(core.tokenizer.eog_ids)
    t0 = time.perf_counter()
    held = [(k, chat_ids(core, t)) for k, t in held_out(per_kind=cfg.held_out_per_kind)]
    if cfg.data:
        texts = []
        for f in cfg.data:
            p = Path(f)
            if not p.is_file():
                raise StrataError(f"--data {f}: no such file")
            texts.append(core.tokenizer.encode(p.read_text(encoding="utf-8", errors="replace"), add_special=True))
        train = prefill_text(core.model, texts, log=log)
    else:
        base = [(k, chat_ids(core, t)) for k, t in training_prompts(cfg.prompts)]
        # --answers N: N - 1 more answers to every prompt, all sampled (the first set alternates)
        work = list(zip(base * cfg.answers, answer_modes(len(base) * cfg.answers, 2, len(base))))
        budget = cfg.data_budget_s
        own = _self_prompts(core, cfg, log)
        if own:  # answered greedily: every request is new, and greedy text is what acceptance measures
            work = _interleave([(p, True) for p in own], work)
            budget = None if budget is None else max(budget - (time.perf_counter() - t0), 1.0)
        train = generate(core.model, [p for p, _ in work], slots=cfg.generate_slots, max_new=cfg.max_new, eog=eog,
                         seed=cfg.seed, log=log, time_budget_s=budget, greedy=[g for _, g in work])
    val = generate(core.model, held, slots=cfg.generate_slots, max_new=min(cfg.max_new, 96), sample_every=0, eog=eog,
                   log=log, seed=cfg.seed + 1)
    n = sum(int((s.top_ids[:, 0] >= 0).sum()) for s in train)
    log(f"data: {len(train)} sequences, {n} target rows for training, "
        f"{len(val)} held-out answers ({time.perf_counter() - t0:.0f} s)")
    if not train:
        raise StrataError("strata mtp train: no training text (is --data empty?)")
    return train, val


def _self_prompts(core, cfg: TrainConfig, log) -> list[tuple[str, list[int]]]:
    if not cfg.self_prompts:
        return []
    budget = None if cfg.data_budget_s is None else cfg.data_budget_s * SELF_PROMPT_SHARE
    texts = write_prompts(core.model, core.tokenizer, core.chat, cfg.self_prompts, slots=cfg.generate_slots,
                          seed=cfg.seed + 7, time_budget_s=budget, log=log,
                          exclude=[t for texts in HELD_OUT.values() for t in texts])
    return [(SELF_KIND, chat_ids(core, t)) for t in texts]


def _interleave(a: list, b: list) -> list:
    """a and b merged in proportion, so any prefix (a time budget's cut) holds both; a first."""
    if not a or not b:
        return a + b
    order = sorted([(i / len(a), 0, i) for i in range(len(a))] + [(j / len(b), 1, j) for j in range(len(b))])
    return [(a, b)[w][i] for _, w, i in order]


def cached_data(core, cfg: TrainConfig, log) -> tuple[list[Sequence], list[Sequence]]:
    """collect_data, or with --data-cache the sequences saved there (collected and saved when absent)."""
    if cfg.data_cache:
        tr, va = Path(cfg.data_cache + ".train.npz"), Path(cfg.data_cache + ".val.npz")
        if tr.is_file() and va.is_file():
            train_seqs, val_seqs = load_sequences(tr), load_sequences(va)
            log(f"data: {len(train_seqs)} sequences from {tr}, {len(val_seqs)} held-out from {va}")
            return train_seqs, val_seqs
    train_seqs, val_seqs = collect_data(core, cfg, log)
    if cfg.data_cache:
        save_sequences(tr, train_seqs)
        save_sequences(va, val_seqs)
    return train_seqs, val_seqs


class Batches:
    """Length-bucketed batches of about `batch_tokens` tokens (little padding), reshuffled per
    epoch, as host numpy arrays (`arrays`) that each trainer moves to its device."""

    def __init__(self, seqs: list[Sequence], batch_tokens: int, rng: np.random.Generator):
        self.seqs = sorted(seqs, key=lambda s: len(s.tokens))
        self.rng = rng
        self.groups: list[list[int]] = []
        cur: list[int] = []
        for i, s in enumerate(self.seqs):
            if cur and (len(cur) + 1) * len(s.tokens) > batch_tokens:
                self.groups.append(cur)
                cur = []
            cur.append(i)
        if cur:
            self.groups.append(cur)

    def __iter__(self):
        while True:
            for g in self.rng.permutation(len(self.groups)):
                yield self.arrays([self.seqs[i] for i in self.groups[g]])

    @staticmethod
    def arrays(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """tokens (B, N) int64, hidden (B, N-1, E) float32, top_ids (B, N-1, K) int64 (-1: no
        target), top_logits (B, N-1, K) float32; shorter sequences padded."""
        N = max(len(s.tokens) for s in seqs)
        B, E, K = len(seqs), seqs[0].hidden.shape[1], seqs[0].top_ids.shape[1]
        tokens = np.zeros((B, N), np.int64)
        hidden = np.zeros((B, N - 1, E), np.float32)
        top_ids = np.full((B, N - 1, K), -1, np.int64)
        top_lg = np.zeros((B, N - 1, K), np.float32)
        for b, s in enumerate(seqs):
            n = len(s.tokens)
            tokens[b, :n] = s.tokens
            hidden[b, : n - 1] = s.hidden
            top_ids[b, : n - 1] = s.top_ids
            top_lg[b, : n - 1] = s.top_logits
        return tokens, hidden, top_ids, top_lg
