"""`strata mtp train`: self-distil an MTP draft for a pack that ships without one.

Steps: load the target with Strata's own engine; collect its tokens/hiddens/logits (text it
writes itself from varied prompts, or text given with --data); initialise the draft block
from the target's last layer; train it against the target's next-next-token distribution
(shared embedding and head frozen); export GGUF; measure acceptance with the real engine.

Two trainers compute the same thing: PyTorch autograd (`engine="torch"`, the optional `train`
extra; imported here only) and xp_net.py's hand-written backward on numpy or CuPy arrays
(`engine="xp"`: no PyTorch needed; `--device cuda` then trains on CuPy). `engine="auto"` takes
torch when it is installed, else xp. With `--device cuda` the target collects its data on
Strata's CUDA backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from strata.errors import StrataError
from strata.gguf.out_path import out_file
from strata.mtp.draft import VOCAB_TENSOR
from strata.mtp.train.collect import Sequence, answer_modes, generate, prefill_text
from strata.mtp.train.export import write_draft
from strata.mtp.train.prompts import HELD_OUT, held_out, training_prompts
from strata.mtp.train.xp_net import PASS_WEIGHT  # loss weight of pass j: PASS_WEIGHT ** (j-1)


@dataclass
class TrainConfig:
    pack: str | None
    out: str
    steps: int = 300
    data: list[str] = field(default_factory=list)
    device: str = "cpu"  # cpu or cuda: where the draft trains, and the backend the target collects data on
    prompts: int = 200
    answers: int = 1  # answers the target writes per prompt (the extra ones sampled)
    self_prompts: int = 0  # requests the target writes itself (self_prompts.py), answered greedily
    draft_vocab: int = 0  # > 0: store the tokens the target wrote most as the draft's vocabulary (vocab.py)
    train_budget_s: float | None = None  # train about this long: the step count is fitted (StepPlan)
    max_new: int = 160
    slots: int | None = None  # sequences generated together per window (None: 64 on cuda, 16 on the CPU)
    batch_tokens: int = 2048
    lr: float = 1e-3
    two_pass: bool = True
    passes: int = 2  # draft positions trained by unrolling (1: position 1 only; two_pass=False forces 1)
    init: str | None = None  # start from this draft GGUF's weights instead of the target's last layer
    data_budget_s: float | None = None
    eval_every: int = 50
    measure: bool = True  # acceptance with the real engine at the end
    held_out_per_kind: int | None = None  # held-out prompts per kind (None: all of them)
    note: str | None = None  # appended to the draft's strata-mtp.training metadata
    data_cache: str | None = None  # .npz prefix: reuse collected data if present, else save it there
    seed: int = 0
    engine: str = "auto"  # torch (autograd), xp (xp_net.py: numpy / CuPy, no PyTorch) or auto (torch if installed)


ENGINES = ("auto", "torch", "xp")


def _torch():
    try:
        import torch
    except ImportError:
        raise StrataError("strata mtp train needs PyTorch for --trainer torch: pip install 'strata[train]' "
                          "(torch is not installed; --trainer xp trains without it)") from None
    return torch


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_engine(engine: str) -> str:
    """torch or xp: `auto` is torch when PyTorch is importable, else xp."""
    if engine not in ENGINES:
        raise StrataError(f"--trainer {engine}: expected one of {', '.join(ENGINES)}")
    if engine == "auto":
        return "torch" if _has_torch() else "xp"
    return engine


def _cupy():
    """CuPy with a CUDA device, for the xp trainer on --device cuda."""
    try:
        import cupy
    except ImportError:
        raise StrataError("--device cuda: the xp trainer needs CuPy (pip install 'strata[gpu]'); cupy is not "
                          "installed") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        raise StrataError(f"--device cuda: CuPy sees no CUDA device ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if n < 1:
        raise StrataError("--device cuda: CuPy sees no CUDA device")
    return cupy


def _slots(cfg: TrainConfig) -> int:
    return cfg.slots if cfg.slots else (64 if cfg.device == "cuda" else 16)


def _target_device(cfg: TrainConfig, engine: str) -> str:
    """Strata backend for the target: cuda with --device cuda (the torch trainer without CuPy: cpu)."""
    if cfg.device != "cuda":
        return "cpu"
    if engine == "xp":
        return "cuda"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cpu"
    return "cuda"


def load_target(pack: str | None, log: Callable[[str], None], device: str = "cpu"):
    from strata.engine.core import EngineCore
    from strata.engine.options import parse_engine_args

    args = ["--device", device] + (["--pack", str(pack)] if pack else [])
    return EngineCore.load(parse_engine_args(args, serving=False), log=lambda s: None)


def frozen_tables(core) -> tuple[np.ndarray, np.ndarray]:
    """The target's embedding and output head (vocab, E) float32 on the host, from the pack (either
    backend); one array when the head is tied to the embedding."""
    from strata.backend.cpu import dequantize_source

    m = core.model
    if isinstance(m.embd, np.ndarray) and m.embd.dtype == np.float32:  # the CPU backend's dequantized table
        embed = m.embd
    else:
        embed = np.ascontiguousarray(dequantize_source(m.embd_source), np.float32)
    if m.output_source is m.embd_source:
        return embed, embed
    return embed, np.ascontiguousarray(dequantize_source(m.output_source), np.float32)


def initial_weights(core) -> dict[str, np.ndarray]:
    """The target's last block (dequantized) + eh_proj that passes hnorm(h) through.

    With eh_proj = [0.1 I | I] the draft starts as "the last layer applied to the hidden
    state, nudged by the next token's embedding": a working model from step 0.
    """
    from strata.backend.cpu import dequantize_source

    cfg = core.cfg
    last = f"blk.{cfg.n_layer - 1}."
    roles = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    if cfg.traits.qk_norm:
        roles += ["attn_q_norm", "attn_k_norm"]
    if cfg.traits.moe or core.pack.tensors.get(last + "ffn_gate.weight") is None:
        raise StrataError(f"strata mtp train: {cfg.arch} packs with routed experts are not supported yet "
                          f"(the draft block is a dense FFN initialised from the last layer)")
    w = {r: dequantize_source(core.pack.tensors[last + r + ".weight"]).astype(np.float32) for r in roles}
    E = cfg.n_embd
    eye = np.eye(E, dtype=np.float32)
    w_out = np.asarray(core.backend.to_host(core.model.output_norm), np.float32)
    w["eh_proj"] = np.concatenate([0.1 * eye, eye], axis=1)  # (E, 2E): [embedding part | hidden part]
    w["enorm"] = np.ones(E, np.float32)
    w["hnorm"] = _unnorm_gain(core, w_out)
    w["output_norm"] = w_out.copy()
    return w


def draft_weights(path: str) -> dict[str, np.ndarray]:
    """role -> float32 array of an existing draft GGUF (dequantized), to continue training it."""
    from strata.backend.cpu import dequantize_source
    from strata.gguf.reader import GGUFFile

    if not Path(path).is_file():
        raise StrataError(f"--init {path}: no such file")
    f = GGUFFile(path)
    try:
        if "mtp.eh_proj.weight" not in f.tensors:
            raise StrataError(f"--init {path}: not an MTP draft (mtp.eh_proj.weight is missing)")
        return {name.removeprefix("mtp.").removeprefix("blk.").removesuffix(".weight"):
                dequantize_source(t).astype(np.float32) for name, t in f.tensors.items()
                if name != VOCAB_TENSOR}  # a vocabulary is no weight: --draft-vocab makes a new one
    finally:
        f.close()


def _unnorm_gain(core, w_out: np.ndarray) -> np.ndarray:
    """hnorm gain that maps rmsnorm(h) back to the scale of the residual stream it came from.

    h = rmsnorm(r) * w_out, so r ~ rmsnorm(h) * rms(h) * rms(r) / w_out. The last layer's
    weights expect r's scale; feeding them unit-RMS inputs would make the block's own updates
    swamp its input. rms(r) and rms(h) come from one short forward of the target.
    """
    from strata.model.transformer import Span

    m, b = core.model, core.backend
    toks = np.asarray(core.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4, add_special=True))
    cache = m.new_cache(len(toks), "f16")
    span = Span(cache, 0, len(toks))
    cache.ensure(len(toks))
    x = b.embed(m.embd, toks)
    x, y = m.run_blocks(x, [span])
    x = x + y
    r = np.asarray(b.to_host(x), np.float64)
    h = np.asarray(b.to_host(b.rms_norm(x, m.output_norm, core.cfg.rms_eps)), np.float64)
    rms = lambda a: float(np.sqrt((a * a).mean(-1)).mean())  # noqa: E731
    floor = 0.05 * float(np.abs(w_out).mean())  # tiny output-norm gains would blow up
    safe = np.where(np.abs(w_out) < floor, np.copysign(floor, w_out + 1e-30), w_out)
    return (rms(h) * rms(r) / safe).astype(np.float32)


def collect_data(core, cfg: TrainConfig, log) -> tuple[list[Sequence], list[Sequence]]:
    eog = set(getattr(core.tokenizer, "eog_ids", set()) or set())
    t0 = time.perf_counter()
    held = [(k, _chat(core, t)) for k, t in held_out(per_kind=cfg.held_out_per_kind)]
    if cfg.data:
        texts = []
        for f in cfg.data:
            p = Path(f)
            if not p.is_file():
                raise StrataError(f"--data {f}: no such file")
            texts.append(core.tokenizer.encode(p.read_text(encoding="utf-8", errors="replace"), add_special=True))
        train = prefill_text(core.model, texts, log=log)
    else:
        base = [(k, _chat(core, t)) for k, t in training_prompts(cfg.prompts)]
        # --answers N: N - 1 more answers to every prompt, all sampled (the first set alternates)
        work = list(zip(base * cfg.answers, answer_modes(len(base) * cfg.answers, 2, len(base))))
        budget = cfg.data_budget_s
        own = _self_prompts(core, cfg, log)
        if own:  # answered greedily: every request is new, and greedy text is what acceptance measures
            work = _interleave([(p, True) for p in own], work)
            budget = None if budget is None else max(budget - (time.perf_counter() - t0), 1.0)
        train = generate(core.model, [p for p, _ in work], slots=_slots(cfg), max_new=cfg.max_new, eog=eog,
                         seed=cfg.seed, log=log, time_budget_s=budget, greedy=[g for _, g in work])
    # held-out prompts: greedy answers, teacher-forced acceptance while training
    val = generate(core.model, held, slots=_slots(cfg), max_new=min(cfg.max_new, 96), sample_every=0, eog=eog,
                   log=log, seed=cfg.seed + 1)
    n = sum(int((s.top_ids[:, 0] >= 0).sum()) for s in train)
    log(f"strata mtp train: data: {len(train)} sequences, {n} target rows for training, "
        f"{len(val)} held-out answers ({time.perf_counter() - t0:.0f} s)")
    if not train:
        raise StrataError("strata mtp train: no training text (is --data empty?)")
    return train, val


SELF_KIND = "self"  # answers to requests the target wrote itself
SELF_PROMPT_SHARE = 0.25  # of --data-minutes, at most, for writing the requests


def _self_prompts(core, cfg: TrainConfig, log) -> list[tuple[str, list[int]]]:
    if not cfg.self_prompts:
        return []
    from strata.mtp.train.self_prompts import write_prompts

    budget = None if cfg.data_budget_s is None else cfg.data_budget_s * SELF_PROMPT_SHARE
    texts = write_prompts(core.model, core.tokenizer, core.chat, cfg.self_prompts, slots=_slots(cfg),
                          seed=cfg.seed + 7, time_budget_s=budget, log=log,
                          exclude=[t for texts in HELD_OUT.values() for t in texts])
    return [(SELF_KIND, _chat(core, t)) for t in texts]


def _interleave(a: list, b: list) -> list:
    """a and b merged in proportion, so any prefix (a time budget's cut) holds both; a first."""
    if not a or not b:
        return a + b
    order = sorted([(i / len(a), 0, i) for i in range(len(a))] + [(j / len(b), 1, j) for j in range(len(b))])
    return [(a, b)[w][i] for _, w, i in order]


def _data(core, cfg: TrainConfig, log) -> tuple[list[Sequence], list[Sequence]]:
    from strata.mtp.train.collect import load_sequences, save_sequences

    if cfg.data_cache:
        tr, va = Path(cfg.data_cache + ".train.npz"), Path(cfg.data_cache + ".val.npz")
        if tr.is_file() and va.is_file():
            train_seqs, val_seqs = load_sequences(tr), load_sequences(va)
            log(f"strata mtp train: data: {len(train_seqs)} sequences from {tr}, {len(val_seqs)} held-out from {va}")
            return train_seqs, val_seqs
    train_seqs, val_seqs = collect_data(core, cfg, log)
    if cfg.data_cache:
        save_sequences(tr, train_seqs)
        save_sequences(va, val_seqs)
    return train_seqs, val_seqs


def _chat(core, text: str) -> list[int]:
    return core.tokenizer.encode(core.chat.render([{"role": "user", "content": text}]), add_special=True)


class Batches:
    """Length-bucketed batches of about `batch_tokens` tokens (little padding), reshuffled per epoch.

    Batches are torch tensors (`tensors`), or with `numpy=True` host numpy arrays (`arrays`, what
    the xp trainer moves to its device)."""

    def __init__(self, seqs: list[Sequence], batch_tokens: int, rng: np.random.Generator, numpy: bool = False):
        self.seqs = sorted(seqs, key=lambda s: len(s.tokens))
        self.rng = rng
        self.numpy = numpy
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
                seqs = [self.seqs[i] for i in self.groups[g]]
                yield self.arrays(seqs) if self.numpy else self.tensors(seqs)

    @staticmethod
    def tensors(seqs: list[Sequence]):
        import torch

        return tuple(torch.from_numpy(a) for a in Batches.arrays(seqs))

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
    import torch

    with torch.no_grad():
        flat = g.detach().reshape(-1, g.shape[-1])
        pick = torch.from_numpy(rng.choice(flat.shape[0], size=min(rows, flat.shape[0]), replace=False)).to(g.device)
        top = (flat[pick] @ net.head.T).topk(8, dim=-1).indices.unique()
    top = top.cpu().numpy()
    return rng.choice(top, size=min(n, len(top)), replace=False) if len(top) else top


def batch_loss(net, batch, rng: np.random.Generator, n_neg: int = 1024, two_pass: bool = True, passes: int = 2):
    """Pass j's row r is entry x_{r+j} (cache index r+j-1), drafted j-th; its target is row r+j."""
    import torch

    from strata.mtp.train.net import candidate_loss

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
    import torch

    hit, tries = np.zeros(passes, np.int64), np.zeros(passes, np.int64)
    with torch.no_grad():
        for s in seqs:
            device = net.head.device  # --device cuda: the batch goes where the net is
            tokens, hidden, top_ids, _ = (t.to(device) for t in Batches.tensors([s]))
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


def _acceptance_line(acc: list[float]) -> str:
    names = ["pos1"] + [f"pos{j + 1}|pos1..{j}" if j > 1 else "pos2|pos1" for j in range(1, len(acc))]
    return ", ".join(f"{n} {a:.3f}" for n, a in zip(names, acc))


def _progress(log, step: int, steps: int, run: dict[str, float], t_train: float) -> None:
    el = time.perf_counter() - t_train
    log(f"strata mtp train: step {step}/{steps}: " + ", ".join(f"{k} {v:.3f}" for k, v in run.items())
        + f" ({el:.0f} s, {el / step:.2f} s/step)")


def _acceptance_log(log, step: int, acc: list[float]) -> None:
    log(f"strata mtp train: step {step}: held-out acceptance (teacher-forced, greedy) {_acceptance_line(acc)}")


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
            log(f"strata mtp train: {per_step:.3f} s/step: {self.total} steps fit the "
                f"{self.budget_s:.0f} s training budget")


def _after_step(cfg: TrainConfig, plan: StepPlan, step: int, stats: dict[str, float], run: dict[str, float],
                t_train: float, log, held_out: Callable[[], list[float]]) -> None:
    """Both trainers' bookkeeping after an optimizer step: running stats, the step budget,
    progress every 10 steps, held-out acceptance every eval_every steps and at the end."""
    for k, v in stats.items():
        run[k] = 0.9 * run.get(k, v) + 0.1 * v
    plan.after(step, time.perf_counter() - t_train, log)
    if step % 10 == 0 or step == plan.total:
        _progress(log, step, plan.total, run, t_train)
    if step % cfg.eval_every == 0 or step == plan.total:
        _acceptance_log(log, step, held_out())


def _fit_torch(cfg: TrainConfig, dims, weights, embed, head, train_seqs, val_seqs, log):
    """AdamW + the cosine schedule with PyTorch autograd -> (role -> float32 weights, seconds)."""
    torch = _torch()
    from strata.mtp.train.net import DraftNet
    from strata.mtp.train.xp_net import lr_factor

    net = DraftNet(dims, weights, embed, head).to(cfg.device)
    net.embed, net.head = net.embed.to(cfg.device), net.head.to(cfg.device)
    _acceptance_log(log, 0, teacher_forced_acceptance(net, val_seqs))

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
        batch = [t.to(cfg.device) for t in next(batches)]
        loss, stats = batch_loss(net, batch, rng, two_pass=cfg.two_pass, passes=cfg.passes)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        _after_step(cfg, plan, step, stats, run, t_train, log, lambda: teacher_forced_acceptance(net, val_seqs))
    t_fit = time.perf_counter() - t_train
    return {k: v.detach().cpu().numpy() for k, v in net.p.items()}, t_fit, step


def xp_acceptance(net, seqs: list[Sequence], passes: int = 3) -> list[float]:
    """teacher_forced_acceptance for the xp trainer (xp_net.acceptance on each held-out answer)."""
    from strata.mtp.train.xp_net import acceptance

    return acceptance(net, (Batches.arrays([s]) for s in seqs), passes)


def _fit_xp(cfg: TrainConfig, xp, dims, weights, embed, head, train_seqs, val_seqs, log):
    """The same training on xp arrays (numpy or CuPy), hand-written backward -> (weights, seconds)."""
    from strata.mtp.train import xp_net

    net = xp_net.XpDraft(dims, weights, embed, head, xp=xp)
    _acceptance_log(log, 0, xp_acceptance(net, val_seqs))
    opt = xp_net.AdamW(net.p, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0, xp=xp)
    plan = StepPlan(cfg.steps, cfg.train_budget_s)
    rng = np.random.default_rng(cfg.seed)
    batches = iter(Batches(train_seqs, cfg.batch_tokens, rng, numpy=True))
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
        _after_step(cfg, plan, step, stats, run, t_train, log, lambda: xp_acceptance(net, val_seqs))
    t_fit = time.perf_counter() - t_train
    return net.host_weights(), t_fit, step


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> Path:
    from strata.mtp.train.dims import dims_of

    engine = resolve_engine(cfg.engine)
    if cfg.device not in ("cpu", "cuda"):
        raise StrataError(f"--device {cfg.device}: expected cpu or cuda")
    out_file(cfg.out, "--out")  # a bad --out fails now, not after the data and the training
    if engine == "torch":
        torch = _torch()
        torch.manual_seed(cfg.seed)
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise StrataError("--device cuda: PyTorch sees no CUDA device")
        xp = None
    else:
        xp = _cupy() if cfg.device == "cuda" else np
    t_start = time.perf_counter()
    start_weights = draft_weights(cfg.init) if cfg.init else None  # a bad --init fails before any work
    target_device = _target_device(cfg, engine)
    core = load_target(cfg.pack, log, target_device)
    mc = core.cfg
    log(f"strata mtp train: target {mc.name} ({mc.arch}, {mc.n_layer} layers, n_embd {mc.n_embd}, vocab {core.model.n_vocab})")
    log(f"strata mtp train: trainer {engine} ({'PyTorch' if engine == 'torch' else xp.__name__} on {cfg.device}), "
        f"target on the {target_device} backend")
    train_seqs, val_seqs = _data(core, cfg, log)
    t_data = time.perf_counter() - t_start

    dims = dims_of(mc)
    embed, head = frozen_tables(core)
    weights = start_weights or initial_weights(core)
    if engine == "torch":
        weights, t_fit, steps = _fit_torch(cfg, dims, weights, embed, head, train_seqs, val_seqs, log)
    else:
        weights, t_fit, steps = _fit_xp(cfg, xp, dims, weights, embed, head, train_seqs, val_seqs, log)

    how = (f"self-distilled: {len(train_seqs)} sequences ({'--data' if cfg.data else 'target-generated'}), "
           f"{steps} steps of ~{cfg.batch_tokens} tokens, data {t_data:.0f} s, training {t_fit:.0f} s"
           + (f"; {cfg.note}" if cfg.note else ""))
    vocab, extra = None, {"training": how}
    if cfg.draft_vocab:
        from strata.mtp.train.vocab import answer_token_counts, choose_vocab, coverage

        counts = answer_token_counts(train_seqs, core.model.n_vocab)
        vocab = choose_vocab(counts, cfg.draft_vocab, getattr(core.tokenizer, "eog_ids", ()) or ())
        extra["vocabulary"] = (f"the {vocab.size} tokens the target wrote most in the training text "
                               f"({100 * coverage(counts, vocab):.1f}% of it)")
        log(f"strata mtp train: draft vocabulary: {extra['vocabulary']}")
    from strata.mtp.defaults import target_fingerprint

    try:
        out = write_draft(cfg.out, weights, target_arch=mc.arch, n_embd=mc.n_embd,
                          name=f"{mc.name} MTP draft", extra_metadata=extra, vocab=vocab,
                          target_fingerprint=target_fingerprint(core.pack))
    except OSError as e:  # the disk filled or the folder went away while training
        raise StrataError(f"--out {cfg.out}: cannot write the draft: {e.strerror}") from None
    log(f"strata mtp train: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {how}")
    if cfg.measure:
        from strata.mtp.train.measure import load_core, run_prompts

        eng = load_core(cfg.pack, str(out), 3, device=target_device)
        prompts = [_chat(eng, t) for _, t in held_out(per_kind=1)]
        acc = run_prompts(eng, prompts, 48)
        per = ", ".join(f"{r:.2f}" for r in acc.per_pos())
        log(f"strata mtp train: engine check (--spec 3, greedy, {len(prompts)} held-out prompts): acceptance "
            f"{acc.rate:.3f}, per position [{per}], {acc.tokens_per_window:.2f} tokens per window")
    return out
