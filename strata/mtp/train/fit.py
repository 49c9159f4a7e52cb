"""Fitting the draft: the step plan and bookkeeping both trainers share, and the xp trainer's
loop (xp_net.py on numpy or CuPy; the PyTorch loop is fit_torch.py, imported only with torch).

Both loops: AdamW with a warm-up and cosine decay (xp_net.lr_factor), gradients clipped to norm
1, running stats, held-out acceptance every eval_every steps. Log lines are bare ("step ..."):
the command names itself in front.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from strata.mtp.train import xp_net
from strata.mtp.train.collect import Sequence
from strata.mtp.train.config import TrainConfig
from strata.mtp.train.data import Batches


def _warm_up_steps(steps: int) -> int:
    return max(1, min(20, steps // 10))


class StepPlan:
    """How many optimizer steps to run: cfg.steps, or with a time budget as many as fit in it
    (at most cfg.steps), fitted once at step FIT_AFTER from the speed of the steps since
    FROM (the first ones compile kernels on a GPU). The cosine schedule follows the fitted
    count, so the learning rate still decays to its floor."""

    FROM, FIT_AFTER = 10, 20

    def __init__(self, steps: int, budget_s: float | None):
        self.total = steps
        self.budget_s = budget_s
        self.warm = _warm_up_steps(steps)
        self._t_from = 0.0

    def after(self, step: int, elapsed_s: float, log) -> None:
        if step == self.FROM:
            self._t_from = elapsed_s
        if self.budget_s is None or step != self.FIT_AFTER or step >= self.total:
            return
        per_step = max(1e-9, (elapsed_s - self._t_from) / (self.FIT_AFTER - self.FROM))
        fit = step + int(max(0.0, self.budget_s - elapsed_s) / per_step)
        if fit < self.total:
            self.total = max(step, fit)
            log(f"{per_step:.3f} s/step: {self.total} steps fit the {self.budget_s:.0f} s training budget")


def _acceptance_line(acc: list[float]) -> str:
    names = ["pos1"] + [f"pos{j + 1}|pos1..{j}" if j > 1 else "pos2|pos1" for j in range(1, len(acc))]
    return ", ".join(f"{n} {a:.3f}" for n, a in zip(names, acc))


def acceptance_log(log, step: int, acc: list[float]) -> None:
    log(f"step {step}: held-out acceptance (teacher-forced, greedy) {_acceptance_line(acc)}")


def _progress(log, step: int, steps: int, run: dict[str, float], t_train: float) -> None:
    el = time.perf_counter() - t_train
    log(f"step {step}/{steps}: " + ", ".join(f"{k} {v:.3f}" for k, v in run.items())
        + f" ({el:.0f} s, {el / step:.2f} s/step)")


def after_step(cfg: TrainConfig, plan: StepPlan, step: int, stats: dict[str, float], run: dict[str, float],
               t_train: float, log, held_out: Callable[[], list[float]]) -> None:
    """Both trainers' bookkeeping after an optimizer step: running stats, the step budget,
    progress every 10 steps, held-out acceptance every eval_every steps and at the end."""
    for k, v in stats.items():
        run[k] = 0.9 * run.get(k, v) + 0.1 * v
    plan.after(step, time.perf_counter() - t_train, log)
    if step % 10 == 0 or step == plan.total:
        _progress(log, step, plan.total, run, t_train)
    if step % cfg.eval_every == 0 or step == plan.total:
        acceptance_log(log, step, held_out())


def xp_acceptance(net, seqs: list[Sequence], passes: int = 3) -> list[float]:
    """Teacher-forced greedy acceptance for the xp trainer (xp_net.acceptance on each held-out answer)."""
    return xp_net.acceptance(net, (Batches.arrays([s]) for s in seqs), passes)


def fit_xp(cfg: TrainConfig, xp, dims, weights, embed, head, train_seqs, val_seqs, log):
    """The training on xp arrays (numpy or CuPy), hand-written backward -> (weights, seconds, steps)."""
    net = xp_net.XpDraft(dims, weights, embed, head, xp=xp)
    acceptance_log(log, 0, xp_acceptance(net, val_seqs))
    opt = xp_net.AdamW(net.p, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0, xp=xp)
    plan = StepPlan(cfg.steps, cfg.train_budget_s)
    rng = np.random.default_rng(cfg.seed)
    batches = iter(Batches(train_seqs, cfg.batch_tokens, rng))
    passes = cfg.passes if cfg.two_pass else 1
    t_train = time.perf_counter()
    run: dict[str, float] = {}
    step = 0
    while step < plan.total:
        step += 1
        batch = tuple(xp.asarray(a) for a in next(batches))
        _, stats, grads = xp_net.batch_loss(net, batch, rng, passes=passes)
        xp_net.clip_grad_norm(grads, 1.0, xp)
        opt.step(grads, cfg.lr * xp_net.lr_factor(step - 1, plan.total, plan.warm))
        after_step(cfg, plan, step, stats, run, t_train, log, lambda: xp_acceptance(net, val_seqs))
    t_fit = time.perf_counter() - t_train
    return net.host_weights(), t_fit, step
