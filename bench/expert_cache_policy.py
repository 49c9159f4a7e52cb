"""Hit rates of the expert cache's policies on synthetic routing traces (a table; no device).

    python bench/expert_cache_policy.py [--layers 48] [--experts 512] [--used 10] [--tokens 1500]
                                        [--warmup 500] [--batch 1] [--seed 0]

The model shape is the report's (48 layers x 512 experts, 10 routed per token). Each trace gives,
per token and layer, the routed experts; a window holds one token of each of `--batch` sequences
(the trace cut into that many parts, decoded side by side: one resolution per layer per window,
as the engine's decode windows). The first `--warmup` windows
fill the pool and are not counted; the hit rate is hits / experts looked up over the rest.

Traces:
- uniform: every expert equally likely (what synthetic packs' routing looks like);
- zipf s: per layer, expert of popularity rank r drawn with weight r^-s (ranks permuted per layer);
- mixed: zipf with s spread over [0.4, 1.4] across layers (some layers flat, some skewed);
- temporal: zipf 0.8 popularity plus reuse: each routed expert repeats one of the previous token's
  with probability REUSE_NEXT, else one of tokens t-2..t-8 with probability REUSE_RECENT; the
  measured reuse (next token, within 8) is printed with the table (published traces: ~45% / ~80%).

Policies (strata/experts/policy.py): lru; frequency (frequency-weighted LRU) at several half-lives
in windows; `global` pools are one pool over all layers (the engine's choice), `per-layer` one
pool of the same share per layer. The last two rows start from nothing, counting the first COLD
windows: an empty pool, or one seeded (`+profile`) from the warm-up part's counts (a profile
recorded on other text of the same model), as an engine starting with --expert-profile.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.experts.cache import ExpertCache, GroupSpec, PoolSpec
from strata.experts.policy import DEFAULT_HALF_LIFE

REUSE_NEXT = 0.36
REUSE_RECENT = 0.38
COLD = 50  # windows measured from a cold start (empty, or seeded by a profile)


def _zipf_weights(n: int, s: float, rng: np.random.Generator) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w[rng.permutation(n)] / w.sum()


def _draw(logw: np.ndarray, k: int, rng: np.random.Generator, t: int) -> np.ndarray:
    """(t, k) distinct experts per row, drawn without replacement by weight (Gumbel top-k)."""
    g = logw[None, :] + rng.gumbel(size=(t, logw.size))
    return np.argpartition(-g, k - 1, axis=1)[:, :k]


def trace_independent(layers: int, n: int, k: int, t: int, s_of_layer, rng) -> np.ndarray:
    out = np.empty((t, layers, k), np.int64)
    for layer in range(layers):
        s = s_of_layer(layer)
        logw = np.zeros(n) if s == 0 else np.log(_zipf_weights(n, s, rng))
        out[:, layer] = _draw(logw, k, rng, t)
    return out


def trace_temporal(layers: int, n: int, k: int, t: int, rng) -> np.ndarray:
    out = np.empty((t, layers, k), np.int64)
    for layer in range(layers):
        logw = np.log(_zipf_weights(n, 0.8, rng))
        base = _draw(logw, k, rng, t)
        for i in range(t):
            chosen: list[int] = []
            for j in range(k):
                u = rng.random()
                pick = None
                if i > 0 and u < REUSE_NEXT:
                    pool = [e for e in out[i - 1, layer] if e not in chosen]
                    pick = pool[rng.integers(len(pool))] if pool else None
                elif i > 1 and u < REUSE_NEXT + REUSE_RECENT:
                    recent = set(out[max(0, i - 8):i - 1, layer].reshape(-1).tolist()) - set(chosen)
                    pick = sorted(recent)[rng.integers(len(recent))] if recent else None
                if pick is None:
                    pick = next(int(e) for e in np.concatenate([base[i], rng.permutation(n)]) if e not in chosen)
                chosen.append(int(pick))
            out[i, layer] = chosen
    return out


def reuse(trace: np.ndarray) -> tuple[float, float]:
    """Share of a token's experts used by the previous token, and by any of the previous 8."""
    t, layers, k = trace.shape
    nxt = within = total = 0
    for layer in range(layers):
        sets = [set(r.tolist()) for r in trace[:, layer]]
        for i in range(8, t):
            recent = set().union(*sets[i - 8:i])
            for e in sets[i]:
                total += 1
                nxt += e in sets[i - 1]
                within += e in recent
    return nxt / total, within / total


def run(trace: np.ndarray, n: int, share: float, policy: str, args: dict, partition: str, warmup: int,
        batch: int, start: str, measure: int | None) -> float:
    """Hit rate over `measure` windows (None: all) after the warm-up part; start: "warm" (the
    warm-up windows run first, uncounted), "cold" (an empty pool) or "profile" (the pool and
    counts seeded from the warm-up part's counts)."""
    t, layers, k = trace.shape
    per_layer = partition == "per-layer"
    slots = max(1, int(share * n)) if per_layer else max(1, int(share * n * layers))
    pools = [PoolSpec(slots, 1)] * (layers if per_layer else 1)
    groups = [GroupSpec(f"blk.{i}.", n, i if per_layer else 0) for i in range(layers)]
    cache = ExpertCache(pools, groups, policy, args)
    # a window holds one token of each of `batch` sequences: the trace cut into `batch` parts, side by side
    windows = trace.reshape(batch, t // batch, layers, k).transpose(1, 0, 2, 3)
    w0 = warmup // batch
    if start == "profile":
        head = windows[:w0].reshape(-1, layers, k)
        counts = [np.bincount(head[:, i].reshape(-1), minlength=n) / len(head) for i in range(layers)]
        cache.preload(lambda gi: counts[gi] * batch)  # tokens per window
    end = windows.shape[0] if measure is None else min(windows.shape[0], w0 + measure)
    for wi in range(0 if start == "warm" else w0, end):
        if wi == w0:
            cache.stats.lookups = cache.stats.hits = 0
        cache.begin_window()
        for layer in range(layers):
            cache.resolve(layer, windows[wi, :, layer])
    return cache.stats.hit_rate() or 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--used", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1500, help="measured tokens (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--batch", type=int, default=1, help="tokens per window (independent sequences)")
    ap.add_argument("--shares", default="0.25,0.5,0.75")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    L, X, K, T = a.layers, a.experts, a.used, a.tokens + a.warmup
    T -= T % a.batch
    mixed_s = rng.permutation(np.linspace(0.4, 1.4, L))
    traces = {
        "uniform": trace_independent(L, X, K, T, lambda i: 0.0, rng),
        "zipf 0.8": trace_independent(L, X, K, T, lambda i: 0.8, rng),
        "zipf 1.1": trace_independent(L, X, K, T, lambda i: 1.1, rng),
        "mixed 0.4-1.4": trace_independent(L, X, K, T, lambda i: float(mixed_s[i]), rng),
        "temporal": trace_temporal(L, X, K, T, rng),
    }
    nxt, within = reuse(traces["temporal"])
    print(f"{L} layers x {X} experts, {K} routed per token, {a.batch} token(s) per window, "
          f"{a.warmup} warm-up + {a.tokens} measured tokens; temporal trace: {nxt:.0%} of a token's experts "
          f"reused from the previous token, {within:.0%} within 8")
    shares = [float(s) for s in a.shares.split(",")]
    h = DEFAULT_HALF_LIFE
    freq = [(f"frequency h={x:g}", {"half_life": x}, "global", "warm", None) for x in (8, 16, 32, 64, 256)]
    rows = [("lru", {}, "global", "warm", None), *freq, ("lru", {}, "per-layer", "warm", None),
            (f"frequency h={h:g}", {"half_life": h}, "per-layer", "warm", None),
            (f"frequency h={h:g}, cold start, first {COLD} windows", {"half_life": h}, "global", "cold", COLD),
            (f"frequency h={h:g} +profile, first {COLD} windows", {"half_life": h}, "global", "profile", COLD)]
    head = "| trace | policy | pools | " + " | ".join(f"{s:.0%}" for s in shares) + " |"
    print(head)
    print("|" + "---|" * (3 + len(shares)))
    t0 = time.perf_counter()
    for name, trace in traces.items():
        for label, args, partition, start, measure in rows:
            rates = [run(trace, X, s, "lru" if label == "lru" else "frequency", args, partition, a.warmup,
                         a.batch, start, measure) for s in shares]
            print(f"| {name} | {label} | {partition} | " + " | ".join(f"{r:.1%}" for r in rates) + " |", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
