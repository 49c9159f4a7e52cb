"""The torch-free draft trainer (strata/mtp/train/xp_net.py) computes what the PyTorch one does.

With tiny random dims (n_embd 32, 4 query heads over 2 KV heads, head_dim 8, vocab 97, T 12,
B 2; both RoPE pair conventions, with and without q/k norm, partial RoPE in the pair
convention) the xp forward outputs, the batch loss (negatives drawn from the same rng) and every
weight's gradient equal net.py's DraftNet/candidate_loss and PyTorch autograd: to 1e-10 in
float64 and 1e-4 in float32 (relative to each tensor's largest value). One xp AdamW step (with
the trainer's clip and schedule) equals torch.optim.AdamW's. Those tests need PyTorch and skip
without it; the rest run on numpy alone: a finite-difference gradient check, a few xp steps
lowering the loss on a fixed batch, and `strata mtp train` on a tiny pack with torch hidden.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from strata.mtp.train import xp_net
from strata.mtp.train.collect import Sequence
from strata.mtp.train.dims import Dims

E, H, HKV, D, V, FF = 32, 4, 2, 8, 97, 48
B, T, K = 2, 12, 5
CASES = [(True, False), (True, True), (False, False), (False, True)]  # (rope_neox, qk_norm)


def _model(neox: bool, qk: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    # the pair convention with a partial rotation (rope_dim 6 of 8): dims past rope_dim pass through
    dims = Dims(E, H, HKV, D, 10000.0, D if neox else 6, 1.0, neox, 1e-5)
    n = lambda *s: rng.standard_normal(s)  # noqa: E731
    w = {"enorm": 1 + 0.1 * n(E), "hnorm": 1 + 0.1 * n(E), "eh_proj": n(E, 2 * E) / np.sqrt(2 * E),
         "attn_norm": 1 + 0.1 * n(E), "attn_q": n(H * D, E) / np.sqrt(E), "attn_k": n(HKV * D, E) / np.sqrt(E),
         "attn_v": n(HKV * D, E) / np.sqrt(E), "attn_output": n(E, H * D) / np.sqrt(H * D),
         "ffn_norm": 1 + 0.1 * n(E), "ffn_gate": n(FF, E) / np.sqrt(E), "ffn_up": n(FF, E) / np.sqrt(E),
         "ffn_down": n(E, FF) / np.sqrt(FF), "output_norm": 1 + 0.1 * n(E)}
    if qk:
        w["attn_q_norm"], w["attn_k_norm"] = 1 + 0.1 * n(D), 1 + 0.1 * n(D)
    w = {k: v.astype(np.float32) for k, v in w.items()}
    embed, head = n(V, E) * 0.5, n(V, E) * 0.5
    tokens = rng.integers(0, V, (B, T + 1))
    hidden = n(B, T, E)
    top_ids = np.stack([rng.permutation(V)[:K] for _ in range(B * T)]).reshape(B, T, K)
    top_ids[0, :3] = -1  # prompt rows: no target
    top_lg = -np.sort(-3 * n(B, T, K), axis=-1)
    return dims, w, embed, head, (tokens, hidden, top_ids, top_lg)


def _torch_net(torch, dims, w, embed, head, dtype):
    from strata.mtp.train.net import DraftNet

    net = DraftNet(dims, w, embed, head)
    if dtype == np.float64:
        net = net.double()
    net.embed, net.head = torch.from_numpy(embed.astype(dtype)), torch.from_numpy(head.astype(dtype))
    return net


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
@pytest.mark.parametrize("neox,qk", CASES)
def test_forward_loss_and_gradients_equal_torch(neox, qk, dtype, tol):
    torch = pytest.importorskip("torch")
    from strata.mtp.train.fit_torch import batch_loss

    dims, w, embed, head, batch = _model(neox, qk)
    batch = tuple(a.astype(dtype) if a.dtype.kind == "f" else a for a in batch)
    for passes in (1, 2, 3):
        net = _torch_net(torch, dims, w, embed, head, dtype)
        tb = tuple(torch.from_numpy(a) for a in batch)
        want_outs = [o.detach().numpy() for o in net.unrolled(tb[0], tb[1], passes)]
        rng_t = np.random.default_rng(7)
        loss_t, stats_t = batch_loss(net, tb, rng_t, n_neg=40, passes=passes)  # 40 of 97 ids: repeats a row's top-K
        loss_t.backward()

        xnet = xp_net.XpDraft(dims, w, embed, head, dtype=dtype)
        outs = xnet.unrolled(batch[0], batch[1], passes)
        assert len(outs) == len(want_outs) == passes
        for j, (o, want) in enumerate(zip(outs, want_outs), start=1):
            assert o.dtype == dtype and o.shape == want.shape
            assert _rel(o, want) < tol, f"pass {j} output"
        rng_x = np.random.default_rng(7)
        loss_x, stats_x, grads = xp_net.batch_loss(xnet, batch, rng_x, n_neg=40, passes=passes)
        assert rng_x.integers(1 << 30) == rng_t.integers(1 << 30)  # the same draws (pool, uniform, mined)
        assert abs(loss_x - float(loss_t.detach())) < tol * abs(loss_x)
        assert stats_x.keys() == stats_t.keys()
        for k in stats_x:  # torch counts agreement in float32
            assert abs(stats_x[k] - stats_t[k]) < (tol * abs(stats_x[k]) if k.startswith("loss") else 1e-6), k
        assert grads.keys() == {k for k, _ in net.p.items()}
        for k, g in grads.items():
            assert g.dtype == dtype
            err = _rel(g, net.p[k].grad.numpy())
            assert err < tol, f"passes {passes}: gradient of {k}: relative error {err:.1e}"


def test_candidate_loss_and_its_gradient_equal_torch():
    torch = pytest.importorskip("torch")
    from strata.mtp.train.net import candidate_loss

    rng = np.random.default_rng(3)
    n = 30
    g = rng.standard_normal((n, E))
    head = rng.standard_normal((V, E))
    ids = np.stack([rng.permutation(V)[:K] for _ in range(n)])
    lg = -np.sort(-2 * rng.standard_normal((n, K)), axis=-1)
    neg = np.unique(np.concatenate([ids[:4].ravel(), rng.integers(0, V, 20)]))  # many repeat a top-K id
    net = xp_net.XpDraft(Dims(E, H, HKV, D, 1e4, D, 1.0, True, 1e-5), {}, head, head, dtype=np.float64)
    loss, agree, dg = xp_net.candidate_loss(net, g, ids, lg, neg)

    class Head:
        pass

    tnet = Head()
    tnet.head = torch.from_numpy(head)
    gt = torch.from_numpy(g).requires_grad_()
    lt, at = candidate_loss(tnet, gt, torch.from_numpy(ids), torch.from_numpy(lg), torch.from_numpy(neg))
    lt.backward()
    assert abs(float(loss) - float(lt.detach())) < 1e-12 * abs(float(loss))
    assert float(agree) == pytest.approx(float(at))
    assert _rel(dg, gt.grad.numpy()) < 1e-12


def test_adamw_step_with_clip_and_schedule_equals_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    shapes = {"a": (6, 5), "b": (5,), "c": (3, 4)}
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    tp = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in p0.values()]
    opt = torch.optim.AdamW(tp, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.98))
    steps, warm = 10, 2
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: xp_net.lr_factor(s, steps, warm))
    xp_params = {k: v.copy() for k, v in p0.items()}
    xopt = xp_net.AdamW(xp_params, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    for step in range(1, 5):
        scale = 3.0 if step % 2 else 0.01  # global norm above 1 (clipped) and below (not)
        grads = {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
        for t, g in zip(tp, grads.values()):
            t.grad = torch.from_numpy(g.copy())
        norm_t = float(torch.nn.utils.clip_grad_norm_(tp, 1.0))
        opt.step()
        sched.step()
        norm_x = float(xp_net.clip_grad_norm(grads, 1.0))
        xopt.step(grads, 1e-2 * xp_net.lr_factor(step - 1, steps, warm))
        assert norm_x == pytest.approx(norm_t, rel=1e-6)
        for t, (k, v) in zip(tp, xp_params.items()):
            assert v.dtype == np.float32
            assert np.abs(v - t.detach().numpy()).max() < 1e-6, f"step {step}, {k}"
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * xp_net.lr_factor(step, steps, warm))


def test_acceptance_equals_torch_teacher_forced():
    torch = pytest.importorskip("torch")
    from strata.mtp.train.fit import xp_acceptance
    from strata.mtp.train.fit_torch import teacher_forced_acceptance

    dims, w, embed, _, _ = _model(True, True)
    rng = np.random.default_rng(5)
    seqs = []
    for n in (9, 14, 3):
        toks = rng.integers(0, V, n)
        ids = np.full((n - 1, 16), -1, np.int32)
        ids[2:] = rng.integers(0, V, (n - 3, 16))  # rows 0-1: the prompt
        seqs.append(Sequence(toks.astype(np.int32), rng.standard_normal((n - 1, E)).astype(np.float16), ids,
                             np.zeros((n - 1, 16), np.float32)))
    # a tied head (embed) makes some argmaxes equal the next token: non-zero acceptance
    for s in seqs:
        s.top_ids[2:, 0] = s.tokens[3:]
    net = _torch_net(torch, dims, w, embed, embed, np.float64)  # float64: no argmax near-tie flips
    want = teacher_forced_acceptance(net, seqs)
    got = xp_acceptance(xp_net.XpDraft(dims, w, embed, embed, dtype=np.float64), seqs)
    assert got == want


def test_gradients_match_finite_differences_without_torch():
    """float64 central differences of the whole batch loss (fixed negatives) for a few weights."""
    dims, w, embed, head, batch = _model(False, True, seed=2)
    net = xp_net.XpDraft(dims, w, embed, head, dtype=np.float64)
    neg_rng = lambda: np.random.default_rng(11)  # noqa: E731  same negatives every call
    loss0, _, grads = xp_net.batch_loss(net, batch, neg_rng(), n_neg=40, passes=2)
    pick = np.random.default_rng(0)
    for k in ("eh_proj", "hnorm", "attn_q", "attn_k", "attn_v", "attn_k_norm", "ffn_up", "output_norm"):
        for _ in range(2):
            i = tuple(int(pick.integers(s)) for s in net.p[k].shape)
            old = net.p[k][i]
            net.p[k][i] = old + 1e-5
            up = xp_net.batch_loss(net, batch, neg_rng(), n_neg=40, passes=2)[0]
            net.p[k][i] = old - 1e-5
            down = xp_net.batch_loss(net, batch, neg_rng(), n_neg=40, passes=2)[0]
            net.p[k][i] = old
            fd = (up - down) / 2e-5
            assert abs(fd - grads[k][i]) < 1e-6 + 1e-5 * abs(fd), f"{k}{i}: {fd} vs {grads[k][i]}"


def test_xp_steps_lower_the_loss_on_a_fixed_batch():
    dims, w, embed, head, batch = _model(True, False, seed=4)
    batch = tuple(a.astype(np.float32) if a.dtype.kind == "f" else a for a in batch)
    net = xp_net.XpDraft(dims, w, embed, head)
    opt = xp_net.AdamW(net.p)
    losses = []
    for step in range(30):
        loss, stats, grads = xp_net.batch_loss(net, batch, np.random.default_rng(0), n_neg=40, passes=2)
        losses.append(loss)
        xp_net.clip_grad_norm(grads, 1.0)
        opt.step(grads, 3e-2)
    assert all(g.dtype == np.float32 for g in grads.values())
    assert losses[-1] < 0.5 * losses[0], losses
    assert stats["agree1"] > 0.5


def _tiny_pack(tmp_path):
    from strata.pack.presets import TINY
    from strata.pack.synth import synth_pack

    synth_pack(TINY["qwen3"], tmp_path, progress=lambda *a: None)
    return tmp_path / "model.gguf"


def _cli(args: list[str], hide: tuple[str, ...] = ("torch",)) -> subprocess.CompletedProcess:
    code = ("import sys\nfor m in %r: sys.modules[m] = None\n"
            "from strata.cli.main import main\nsys.exit(main(%r))" % (hide, ["mtp", "train", *args]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_cli_trains_with_the_xp_trainer_without_torch(tmp_path):
    pack = _tiny_pack(tmp_path)
    out = tmp_path / "draft.gguf"
    common = ["--pack", str(pack), "--steps", "3", "--prompts", "4", "--max-new", "8", "--slots", "4",
              "--batch-tokens", "256", "--held-out-per-kind", "1", "--no-measure"]
    proc = _cli(common + ["--out", str(out)])  # --trainer auto: xp, since torch cannot be imported
    assert proc.returncode == 0, proc.stderr + proc.stdout
    lines = proc.stdout.splitlines()
    assert "strata mtp train: trainer xp (numpy on cpu), target on the cpu backend" in lines
    assert any(ln.startswith("strata mtp train: step 3/3: loss1 ") and "agree2" in ln for ln in lines)
    assert any(ln.startswith("strata mtp train: step 3: held-out acceptance (teacher-forced, greedy) pos1 ")
               and "pos3|pos1..2" in ln for ln in lines)
    from strata.gguf.reader import GGUFFile

    f = GGUFFile(out)
    assert "mtp.blk.attn_k_norm.weight" in f.tensors and f.metadata["general.architecture"] == "strata-mtp"
    f.close()

    # asking for what is not there is one clear line each
    proc = _cli(common + ["--out", str(tmp_path / "x.gguf"), "--trainer", "torch"])
    assert proc.returncode == 2 and proc.stderr.strip().startswith("strata: strata mtp train needs PyTorch")
    proc = _cli(common + ["--out", str(tmp_path / "x.gguf"), "--trainer", "xp", "--device", "cuda"],
                hide=("torch", "cupy"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("strata: --device cuda: the xp trainer needs CuPy (pip install 'strata[gpu]'); "
                                   "cupy is not installed")
    proc = _cli(common + ["--out", str(tmp_path / "x.gguf"), "--self-prompts", "8", "--data", str(pack)])
    assert proc.returncode == 2 and not (tmp_path / "x.gguf").exists()
    assert proc.stderr.strip() == ("strata: strata mtp train: --self-prompts and --data exclude each other "
                                   "(--self-prompts makes text for the target to write; --data gives the text)")
    proc = _cli(common + ["--out", str(tmp_path / "x.gguf"), "--self-prompts", "0"])
    assert proc.returncode == 2 and "--self-prompts" in proc.stderr and "Traceback" not in proc.stderr


def test_step_plan_fits_the_budget_after_twenty_steps():
    from strata.mtp.train.fit import StepPlan

    logs = []
    plan = StepPlan(1000, 10.0)
    plan.after(10, 1.5, logs.append)  # the first 10 steps compiled kernels: not counted
    plan.after(19, 2.4, logs.append)  # not fitted before step 20
    assert plan.total == 1000
    plan.after(20, 2.5, logs.append)  # 0.1 s/step since step 10, 7.5 s left: 75 more steps
    assert plan.total == 95 and "95 steps fit" in logs[-1]
    roomy = StepPlan(50, 1000.0)
    roomy.after(20, 2.0, logs.append)  # the budget allows more than --steps: --steps stays the cap
    assert roomy.total == 50
    none = StepPlan(300, None)
    none.after(20, 50.0, logs.append)
    assert none.total == 300


def test_more_answers_per_prompt_are_sampled(tmp_path):
    """--answers: the first answer to each prompt follows sample_every (greedy here), the extra
    ones are sampled, each from its own random stream."""
    from strata.mtp.train.collect import generate
    from strata.mtp.train.data import load_target

    core = load_target(str(_tiny_pack(tmp_path)), lambda s: None, "cpu")
    prompts = [("chat", core.tokenizer.encode(t, add_special=True)) for t in ("Hello there", "Tell me a story")]
    once = generate(core.model, prompts, slots=4, max_new=6, sample_every=0, log=lambda s: None)
    twice = generate(core.model, prompts * 2, slots=4, max_new=6, sample_every=0, sampled_from=2, log=lambda s: None)
    answers = {(s.kind, tuple(s.tokens)) for s in twice}
    for s in once:  # the greedy answers come out again
        assert ("chat", tuple(s.tokens)) in answers
    assert len(answers) == 4  # the sampled ones differ from the greedy ones (random weights: flat logits)
