"""`strata mtp train --pack P --out DRAFT ...`: train an MTP draft for a pack that has none.

Training runs on PyTorch (the optional `train` extra) or, without it, on the xp trainer
(numpy on the CPU, CuPy with --device cuda); serving a trained draft needs neither.
"""

from __future__ import annotations

import argparse

from strata.engine.options import _positive_int as _positive


def _minutes(value: str) -> float:
    """argparse type: a positive number of minutes."""
    try:
        m = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got {value!r}") from None
    if not m > 0:
        raise argparse.ArgumentTypeError(f"expected a number of minutes > 0, got {value!r}")
    return m


DEFAULT_VOCAB = 16384  # tokens in a draft vocabulary (`strata mtp vocab`): the shipped draft's size


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="mtp_command", metavar="train|vocab")
    t = sub.add_parser("train", help="self-distil a draft (docs/MTP.md format) from the target pack")
    t.add_argument("--pack", default=None, help="target pack (default: the bundled SmolLM2-135M-Instruct)")
    t.add_argument("--out", required=True, help="draft GGUF to write (load it with --mtp)")
    t.add_argument("--steps", type=_positive, default=300, help="optimizer steps (default 300)")
    t.add_argument("--data", nargs="+", action="extend", default=[], metavar="FILE",
                   help="train on these text files (prefilled) instead of text the target writes itself")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the draft trains; with cuda the target also collects its data on the CUDA backend")
    t.add_argument("--trainer", choices=("auto", "torch", "xp"), default="auto",
                   help="torch (PyTorch autograd), xp (hand-written backward on numpy / CuPy, no PyTorch), "
                        "auto: torch if installed, else xp")
    t.add_argument("--prompts", type=_positive, default=200, help="built-in prompts the target answers (no --data)")
    t.add_argument("--answers", type=_positive, default=1,
                   help="answers the target writes per built-in prompt; the extra ones are sampled (default 1)")
    t.add_argument("--self-prompts", type=_positive, default=None, metavar="N",
                   help="also answer (greedily) N requests the target writes itself from its chat template's "
                        "user turn: varied prompts without a dataset")
    t.add_argument("--max-new", type=_positive, default=128, help="tokens the target writes per prompt")
    t.add_argument("--slots", type=_positive, default=None,
                   help="sequences generated together per window (default 64 with --device cuda, else 16)")
    t.add_argument("--batch-tokens", type=_positive, default=2048, help="tokens per training step")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, cosine decay)")
    t.add_argument("--train-minutes", type=_minutes, default=None,
                   help="train about this long: as many steps as fit, up to --steps (fitted after 20 steps)")
    t.add_argument("--eval-every", type=_positive, default=50, help="steps between held-out acceptance checks")
    t.add_argument("--data-minutes", type=_minutes, default=None, help="stop generating training text after this long")
    t.add_argument("--one-pass", action="store_true", help="train draft position 1 only (cheaper, weaker at --spec >= 2)")
    t.add_argument("--passes", type=_positive, default=2,
                   help="draft positions trained by unrolling the draft on its own outputs (default 2)")
    t.add_argument("--init", default=None, metavar="DRAFT",
                   help="continue training this draft GGUF instead of starting from the target's last layer")
    t.add_argument("--no-measure", action="store_true", help="skip the final acceptance check with the engine")
    t.add_argument("--data-cache", default=None, metavar="PREFIX",
                   help="keep collected data in PREFIX.train.npz / PREFIX.val.npz and reuse it when present")
    t.add_argument("--held-out-per-kind", type=_positive, default=None,
                   help="held-out prompts per kind for acceptance while training (default: all)")
    t.add_argument("--draft-vocab", type=_positive, default=None, metavar="N",
                   help="also store the N tokens the target wrote most as the draft's vocabulary (mtp.vocab): "
                        "the CPU then computes the draft's head on those only")
    t.add_argument("--seed", type=int, default=0)

    v = sub.add_parser("vocab", help="give a draft a vocabulary: the tokens its target writes most (mtp.vocab)")
    v.add_argument("--draft", required=True, help="the draft GGUF to copy")
    v.add_argument("--out", required=True, help="the copy to write, with mtp.vocab")
    v.add_argument("--pack", default=None, help="the draft's target (default: the bundled SmolLM2-135M-Instruct)")
    v.add_argument("--size", type=_positive, default=DEFAULT_VOCAB, help=f"tokens to keep (default {DEFAULT_VOCAB})")
    v.add_argument("--prompts", type=_positive, default=200, help="built-in prompts the target answers for the count")
    v.add_argument("--self-prompts", type=_positive, default=200, metavar="N",
                   help="requests the target writes itself and answers for the count (default 200)")
    v.add_argument("--max-new", type=_positive, default=128, help="tokens the target writes per answer")
    v.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the backend the target writes on")
    v.add_argument("--slots", type=_positive, default=None, help="answers written together per window")
    v.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from strata.errors import StrataError

    if args.mtp_command == "vocab":
        from strata.mtp.train.pipeline import vocab_from_answers

        vocab_from_answers(args.draft, args.out, args.size, pack=args.pack, device=args.device,
                           prompts=args.prompts, self_prompts=args.self_prompts, max_new=args.max_new,
                           slots=args.slots, seed=args.seed, log=lambda line: print(line, flush=True))
        return 0
    if args.mtp_command != "train":
        raise StrataError("strata mtp: expected a subcommand: train or vocab")
    if args.self_prompts and args.data:
        raise StrataError("strata mtp train: --self-prompts and --data exclude each other "
                          "(--self-prompts makes text for the target to write; --data gives the text)")
    from strata.mtp.train.config import TrainConfig
    from strata.mtp.train.pipeline import train

    minutes = lambda m: m * 60 if m else None  # noqa: E731
    cfg = TrainConfig(pack=args.pack, out=args.out, steps=args.steps, data=list(args.data), device=args.device,
                      prompts=args.prompts, answers=args.answers, self_prompts=args.self_prompts or 0,
                      max_new=args.max_new, slots=args.slots,
                      batch_tokens=args.batch_tokens, lr=args.lr, two_pass=not args.one_pass, passes=args.passes,
                      init=args.init, measure=not args.no_measure, seed=args.seed, data_cache=args.data_cache,
                      held_out_per_kind=args.held_out_per_kind, data_budget_s=minutes(args.data_minutes),
                      train_budget_s=minutes(args.train_minutes), engine=args.trainer,
                      eval_every=args.eval_every, draft_vocab=args.draft_vocab or 0)
    train(cfg, log=lambda line: print(line, flush=True))
    return 0
