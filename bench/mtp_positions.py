"""Why are draft positions 2-3 weak? Conditional acceptance per position, three ways.

    python bench/mtp_positions.py [--draft D] [--val PREFIX.val.npz] [--max-seqs N] [--torch]

On held-out greedy answers (the val set `strata mtp train --data-cache` saves: tokens, the
target's hiddens), at every answer position M:
1. engine: the real DraftModel is caught up on the true hiddens h_0..h_{M-1} and then chains
   3 steps with step_last exactly as DraftProposer does (its own normed output fed back as h),
   then rolls its cache back; draft j is compared with the greedy continuation x_{M+j};
2. torch (with --torch): the training network (strata/mtp/train/net.py) with the same
   (dequantized Q8_0) weights, teacher-forced pass 1 and pass 2 — the numbers training reports;
   plus an unrolled pass 3 (pass 2's outputs fed back once more) that training never optimised.

Reported: P(d1 ok), P(d2 ok | d1 ok), P(d3 ok | d1, d2 ok). bench_mtp's "per position" column is
the unconditional P(d1..dj all ok) over drafting windows, i.e. the running product of these.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.mtp.defaults import default_draft_path  # noqa: E402
from strata.mtp.train.collect import load_sequences  # noqa: E402
from strata.mtp.train.measure import load_core  # noqa: E402


def answer_start(s) -> int:
    """First row whose next-token top-K was computed (the prompt's last token predicts the answer)."""
    rows = np.nonzero(s.top_ids[:, 0] >= 0)[0]
    return int(rows[0]) if len(rows) else len(s.tokens)


def engine_chain(core, seqs, k: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """hits[j], tries[j]: draft j+1 correct given drafts 1..j correct (greedy text: x_{M+j} is the target's argmax)."""
    d = core.scheduler.proposer.draft if hasattr(core.scheduler, "proposer") else None
    if d is None:
        from strata.mtp.draft import DraftModel, find_draft

        d = DraftModel(core.backend, core.cfg, find_draft(core.args.mtp, core.pack), core.model)
    hits, tries = np.zeros(k, int), np.zeros(k, int)
    for s in seqs:
        toks, hid = s.tokens.astype(np.int64), s.hidden.astype(np.float32)
        a = answer_start(s)
        cache = d.new_cache(len(toks) + k + 2, "f16")
        if a > 1:
            d.step(cache, toks[1:a], hid[: a - 1])  # entries x_1..x_{a-1} from true hiddens
        for m in range(a, len(toks) - 1):
            g, rows = d.step_last([(cache, toks[m : m + 1], hid[m - 1 : m])])  # entry x_m, predicts x_{m+1}
            committed = cache.length
            ok = True
            for j in range(k):
                if m + 1 + j >= len(toks):
                    break
                tok = int(np.argmax(rows[0]))
                tries[j] += 1
                ok = tok == int(toks[m + 1 + j])
                hits[j] += ok
                if not ok or j == k - 1:
                    break
                g, rows = d.step_last([(cache, [tok], g[0:1])])
            cache.truncate(committed)
    return hits, tries


def torch_passes(draft: Path, core, seqs) -> tuple[np.ndarray, np.ndarray]:
    import torch

    from strata.backend.cpu import dequantize_source
    from strata.gguf.reader import GGUFFile
    from strata.mtp.train.net import DraftNet, Dims
    from strata.mtp.train.trainer import Batches

    f = GGUFFile(draft)
    w = {}
    for name, t in f.tensors.items():
        role = name.removeprefix("mtp.").removeprefix("blk.").removesuffix(".weight")
        w[role] = dequantize_source(t).astype(np.float32)
    mc = core.cfg
    dims = Dims(mc.n_embd, mc.n_head, mc.n_head_kv, mc.head_dim, mc.rope_base, mc.rope_dim, mc.rope_scale,
                mc.traits.rope_neox, mc.rms_eps)
    embed = np.asarray(core.backend.to_host(core.model.embd), np.float32)
    net = DraftNet(dims, w, embed, embed)
    hits, tries = np.zeros(3, int), np.zeros(3, int)
    with torch.no_grad():
        for s in seqs:
            tokens, hidden, top_ids, _ = Batches.tensors([s])
            T = hidden.shape[1]
            if T < 4:
                continue
            g1, g2, g3 = net.unrolled(tokens, hidden, 3)
            tgt = top_ids[0, :, 0]
            ok = [None] * 3
            for j, g in enumerate((g1, g2, g3)):
                n = T - 1 - j  # entries j.. predict rows j+1..T-1
                pred = (g[0, :n] @ net.head.T).argmax(-1)
                ok[j] = (pred == tgt[1 + j : 1 + j + n]) & (tgt[1 + j : 1 + j + n] >= 0)
            valid = tgt[1:T] >= 0
            n3 = T - 3
            c1, c2, c3 = ok[0][:n3], ok[1][:n3], ok[2][:n3]
            v = valid[:n3] & (tgt[3:T] >= 0)
            tries[0] += int(v.sum())
            hits[0] += int((c1 & v).sum())
            tries[1] += int((c1 & v).sum())
            hits[1] += int((c1 & c2 & v).sum())
            tries[2] += int((c1 & c2 & v).sum())
            hits[2] += int((c1 & c2 & c3 & v).sum())
    return hits, tries


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=None)
    ap.add_argument("--val", required=True, help="held-out sequences (.val.npz from --data-cache)")
    ap.add_argument("--max-seqs", type=int, default=18)
    ap.add_argument("--torch", action="store_true")
    a = ap.parse_args()
    draft = Path(a.draft or default_draft_path())
    seqs = load_sequences(a.val)[: a.max_seqs]
    core = load_core(None, str(draft), 3)
    print(f"draft {draft}; {len(seqs)} held-out greedy answers")
    fmt = lambda h, t: "  ".join(f"{x / max(y, 1):.3f} ({x}/{y})" for x, y in zip(h, t))  # noqa: E731
    h, t = engine_chain(core, seqs)
    print(f"engine, chained as served:  P(d1), P(d2|d1), P(d3|d1,d2) = {fmt(h, t)}")
    print(f"  unconditional (bench 'per position'): {' '.join(f'{x:.3f}' for x in np.cumprod(h / np.maximum(t, 1)))}")
    if a.torch:
        h, t = torch_passes(draft, core, seqs)
        print(f"torch, teacher-forced passes: P(d1), P(d2|d1), P(d3|d1,d2) = {fmt(h, t)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
