"""`strata mtp train` and `strata mtp vocab`: the stages of the train/ package run in order.

`train`: self-distil an MTP draft for a pack that ships without one. Load the target with
Strata's own engine; collect its tokens/hiddens/logits (text it writes itself from varied
prompts, or text given with --data: data.py); initialise the draft block from the target's last
layer (weights.py); train it against the target's next-next-token distribution, shared embedding
and head frozen (fit.py, fit_torch.py); export GGUF (export.py); measure acceptance with the real
engine (measure.py).

Two trainers compute the same thing: PyTorch autograd (`engine="torch"`, the optional `train`
extra) and xp_net.py's hand-written backward on numpy or CuPy arrays (`engine="xp"`: no PyTorch
needed; `--device cuda` then trains on CuPy). `engine="auto"` takes torch when it is installed,
else xp (runtimes.py). With `--device cuda` the target collects its data on Strata's CUDA backend.

`vocab_from_answers`: the target answers prompts (built-in and its own requests) and the tokens it
wrote most become a copy of a draft's vocabulary (vocab.py).

The stages log bare lines; each command puts its own name in front (`_tagged`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np

from strata.errors import StrataError
from strata.gguf.out_path import out_file
from strata.gguf.reader import GGUFFile
from strata.mtp.defaults import target_fingerprint
from strata.mtp.train.config import TrainConfig
from strata.mtp.train.data import cached_data, collect_data, load_target
from strata.mtp.train.dims import dims_of
from strata.mtp.train.export import write_draft
from strata.mtp.train.fit import fit_xp
from strata.mtp.train.measure import chat_ids, load_core, run_prompts
from strata.mtp.train.prompts import held_out
from strata.mtp.train.runtimes import cupy_module, resolve_engine, target_device, torch_module
from strata.mtp.train.vocab import answer_token_counts, choose_vocab, coverage, with_vocab
from strata.mtp.train.weights import draft_weights, frozen_tables, initial_weights


def _tagged(log: Callable[[str], None], command: str) -> Callable[[str], None]:
    """The stages' bare lines as this command's lines."""
    return lambda line: log(f"{command}: {line}")


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> Path:
    log = _tagged(log, "strata mtp train")
    engine = resolve_engine(cfg.engine)
    if cfg.device not in ("cpu", "cuda"):
        raise StrataError(f"--device {cfg.device}: expected cpu or cuda")
    out_file(cfg.out, "--out")  # a bad --out fails now, not after the data and the training
    if engine == "torch":
        torch = torch_module()
        torch.manual_seed(cfg.seed)
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise StrataError("--device cuda: PyTorch sees no CUDA device")
        xp = None
    else:
        xp = cupy_module() if cfg.device == "cuda" else np
    t_start = time.perf_counter()
    start_weights = draft_weights(cfg.init) if cfg.init else None  # a bad --init fails before any work
    backend = target_device(cfg.device, engine)
    core = load_target(cfg.pack, log, backend)
    mc = core.cfg
    log(f"target {mc.name} ({mc.arch}, {mc.n_layer} layers, n_embd {mc.n_embd}, vocab {core.model.n_vocab})")
    log(f"trainer {engine} ({'PyTorch' if engine == 'torch' else xp.__name__} on {cfg.device}), "
        f"target on the {backend} backend")
    train_seqs, val_seqs = cached_data(core, cfg, log)
    t_data = time.perf_counter() - t_start

    dims = dims_of(mc)
    embed, head = frozen_tables(core)
    weights = start_weights or initial_weights(core)
    if engine == "torch":
        from strata.mtp.train.fit_torch import fit_torch  # imports torch: only on this path

        weights, t_fit, steps = fit_torch(cfg, dims, weights, embed, head, train_seqs, val_seqs, log)
    else:
        weights, t_fit, steps = fit_xp(cfg, xp, dims, weights, embed, head, train_seqs, val_seqs, log)

    how = (f"self-distilled: {len(train_seqs)} sequences ({'--data' if cfg.data else 'target-generated'}), "
           f"{steps} steps of ~{cfg.batch_tokens} tokens, data {t_data:.0f} s, training {t_fit:.0f} s"
           + (f"; {cfg.note}" if cfg.note else ""))
    vocab, extra = None, {"training": how}
    if cfg.draft_vocab:
        counts = answer_token_counts(train_seqs, core.model.n_vocab)
        vocab = choose_vocab(counts, cfg.draft_vocab, core.tokenizer.eog_ids)
        extra["vocabulary"] = (f"the {vocab.size} tokens the target wrote most in the training text "
                               f"({100 * coverage(counts, vocab):.1f}% of it)")
        log(f"draft vocabulary: {extra['vocabulary']}")
    try:
        out = write_draft(cfg.out, weights, target_arch=mc.arch, n_embd=mc.n_embd,
                          name=f"{mc.name} MTP draft", extra_metadata=extra, vocab=vocab,
                          target_fingerprint=target_fingerprint(core.pack))
    except OSError as e:  # the disk filled or the folder went away while training
        raise StrataError(f"--out {cfg.out}: cannot write the draft: {e.strerror}") from None
    log(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {how}")
    if cfg.measure:
        eng = load_core(cfg.pack, str(out), 3, device=backend)
        prompts = [chat_ids(eng, t) for _, t in held_out(per_kind=1)]
        acc = run_prompts(eng, prompts, 48)
        per = ", ".join(f"{r:.2f}" for r in acc.per_pos())
        log(f"engine check (--spec 3, greedy, {len(prompts)} held-out prompts): acceptance "
            f"{acc.rate:.3f}, per position [{per}], {acc.tokens_per_window:.2f} tokens per window")
    return out


def vocab_from_answers(draft: str, out: str, size: int, *, pack: str | None = None, device: str = "cpu",
                       prompts: int = 200, self_prompts: int = 200, max_new: int = 128, slots: int | None = None,
                       seed: int = 0, log: Callable[[str], None] = print) -> Path:
    """`strata mtp vocab`: a copy of `draft` at `out` whose vocabulary is the `size` tokens the
    target wrote most answering `prompts` built-in prompts and `self_prompts` requests of its own."""
    log = _tagged(log, "strata mtp vocab")
    GGUFFile(draft).close()  # a missing or broken draft fails before any work
    out_file(out, "--out")  # and so does a bad --out
    core = load_target(pack, log, device)
    cfg = TrainConfig(pack=pack, out=out, device=device, prompts=prompts, self_prompts=self_prompts,
                      max_new=max_new, slots=slots, seed=seed, held_out_per_kind=1)
    seqs, _ = collect_data(core, cfg, log)
    counts = answer_token_counts(seqs, core.model.n_vocab)
    ids = choose_vocab(counts, size, core.tokenizer.eog_ids)
    how = (f"the {ids.size} tokens the target wrote most in {len(seqs)} answers ({int(counts.sum())} tokens, "
           f"{int((counts > 0).sum())} distinct; {100 * coverage(counts, ids):.1f}% covered), the rest by lowest id")
    written = with_vocab(draft, ids, out, note=how, target_fingerprint=target_fingerprint(core.pack))
    log(f"wrote {written}: {how}")
    return written
