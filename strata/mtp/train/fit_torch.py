"""The PyTorch trainer: the candidate loss over unrolled passes, teacher-forced acceptance and
the AdamW loop, with autograd (net.py's DraftNet). Imports torch: only the pipeline's torch
path imports this module, after checking that PyTorch is installed.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from strata.mtp.train.collect import Sequence
from strata.mtp.train.config import TrainConfig
from strata.mtp.train.data import Batches
from strata.mtp.train.fit import StepPlan, acceptance_log, after_step
from strata.mtp.train.net import DraftNet, candidate_loss
from strata.mtp.train.xp_net import PASS_WEIGHT, lr_factor  # loss weight of pass j: PASS_WEIGHT ** (j-1)


def batch_tensors(arrays) -> tuple[torch.Tensor, ...]:
    """A batch of Batches.arrays as torch tensors on the host (sharing the arrays' memory)."""
    return tuple(torch.from_numpy(a) for a in arrays)


def _targets(top_ids, top_lg, first_row: int, count: int):
    """Rows [first_row, first_row + count) of the target's top-K, flattened, with a validity mask."""
    ids = top_ids[:, first_row : first_row + count]
    lg = top_lg[:, first_row : first_row + count]
    return ids, lg, ids[..., 0] >= 0


def _mined(net, g, rng: np.random.Generator, n: int, rows: int = 64) -> np.ndarray:
    """Hard negatives: the tokens the draft itself ranks highest (full head, a few rows, no grad).

    Without them the candidate loss never sees the tokens the draft wrongly prefers among the
    ~49k it is not shown, and full-vocabulary argmax agreement lags far behind candidate agreement.
    """
    with torch.no_grad():
        flat = g.detach().reshape(-1, g.shape[-1])
        pick = torch.from_numpy(rng.choice(flat.shape[0], size=min(rows, flat.shape[0]), replace=False)).to(g.device)
        top = (flat[pick] @ net.head.T).topk(8, dim=-1).indices.unique()
    top = top.cpu().numpy()
    return rng.choice(top, size=min(n, len(top)), replace=False) if len(top) else top


def batch_loss(net, batch, rng: np.random.Generator, n_neg: int = 1024, two_pass: bool = True, passes: int = 2):
    """Pass j's row r is entry x_{r+j} (cache index r+j-1), drafted j-th; its target is row r+j."""
    tokens, hidden, top_ids, top_lg = batch
    T = hidden.shape[1]
    outs = net.unrolled(tokens, hidden, passes if two_pass else 1)
    g1 = outs[0]
    vocab = net.head.shape[0]
    pool = top_ids[top_ids >= 0].unique().cpu().numpy()
    neg = np.concatenate([rng.choice(pool, size=min(n_neg // 2, len(pool)), replace=False),
                          rng.integers(0, vocab, size=n_neg // 4), _mined(net, g1, rng, n_neg // 4)])
    neg = torch.from_numpy(neg.astype(np.int64)).unique().to(g1.device)
    out = {}
    total = 0.0
    for j, g in enumerate(outs, start=1):
        n = T - j  # rows j..T-1 have targets
        if n < 1:
            break
        ids, lg, ok = _targets(top_ids, top_lg, j, n)
        loss, agree = candidate_loss(net, g[:, :n][ok], ids[ok], lg[ok], neg)
        total = total + PASS_WEIGHT ** (j - 1) * loss
        out[f"loss{j}"], out[f"agree{j}"] = float(loss.detach()), float(agree)
    return total, out


def teacher_forced_acceptance(net, seqs: list[Sequence], passes: int = 3) -> list[float]:
    """Greedy acceptance on held-out answers with the full head: P(d1 ok), P(d2 ok | d1 ok), ...

    Position j runs the draft chained j steps deep (`DraftNet.unrolled`), as serving does.
    """
    hit, tries = np.zeros(passes, np.int64), np.zeros(passes, np.int64)
    with torch.no_grad():
        for s in seqs:
            device = net.head.device  # --device cuda: the batch goes where the net is
            tokens, hidden, top_ids, _ = (t.to(device) for t in batch_tensors(Batches.arrays([s])))
            T = hidden.shape[1]
            if T <= passes:
                continue
            tgt = top_ids[0, :, 0]
            n = T - passes  # rows whose whole chain has targets
            chain_ok = torch.ones(n, dtype=torch.bool, device=device)
            for j in range(passes):  # prompt rows have no target: they are no drafting window
                chain_ok &= tgt[1 + j : 1 + j + n] >= 0
            for j, g in enumerate(net.unrolled(tokens, hidden, passes)):
                want = tgt[1 + j : 1 + j + n]
                ok = (g[0, :n] @ net.head.T).argmax(-1) == want
                tries[j] += int(chain_ok.sum())
                chain_ok = chain_ok & ok
                hit[j] += int(chain_ok.sum())
    return [float(h / max(t, 1)) for h, t in zip(hit, tries)]


def fit_torch(cfg: TrainConfig, dims, weights, embed, head, train_seqs, val_seqs, log):
    """AdamW + the cosine schedule with PyTorch autograd -> (role -> float32 weights, seconds, steps)."""
    net = DraftNet(dims, weights, embed, head).to(cfg.device)
    net.embed, net.head = net.embed.to(cfg.device), net.head.to(cfg.device)
    acceptance_log(log, 0, teacher_forced_acceptance(net, val_seqs))

    opt = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    plan = StepPlan(cfg.steps, cfg.train_budget_s)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, plan.total, plan.warm))
    rng = np.random.default_rng(cfg.seed)
    batches = iter(Batches(train_seqs, cfg.batch_tokens, rng))
    t_train = time.perf_counter()
    run: dict[str, float] = {}
    step = 0
    while step < plan.total:
        step += 1
        batch = [t.to(cfg.device) for t in batch_tensors(next(batches))]
        loss, stats = batch_loss(net, batch, rng, two_pass=cfg.two_pass, passes=cfg.passes)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        after_step(cfg, plan, step, stats, run, t_train, log, lambda: teacher_forced_acceptance(net, val_seqs))
    t_fit = time.perf_counter() - t_train
    return {k: v.detach().cpu().numpy() for k, v in net.p.items()}, t_fit, step
