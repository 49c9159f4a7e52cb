"""What each kernel of a decode window costs the chain: the window's launches replayed as one
CUDA graph, with programmatic dependent launch as the engine captures them, and again with all
the launches of one kernel left out.

  python bench/probes/gpu_chain_profile.py --pack P [--width B] [--context N] [--replays R]

gpu_kernel_profile.py (beside this file) times each launch alone; under PDL a launch's cost in
the chain is not its time alone (the next kernel's blocks start early, small kernels overlap
the tail of big ones). Here the cost of kernel X is the replay time of every launch minus that
of every launch but X's: what the window would save if X's work were free, launch and wait
included, so an upper bound on what fusing X into a neighbour can gain. Leaving launches out
feeds the rest stale buffers (the graph reads what the last eager window wrote), which changes
no timing of these data-independent kernels: the routing still picks valid experts from the
last logits. Also printed: the graph of the weight-streaming launches only (the MMVQ family):
what the window would take if every other kernel were free.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_kernel_profile import graph_time, record_window, relaunch, window_wall  # noqa: E402


def chain_time(cp, launches, keep, replays: int) -> float:
    """Median seconds of one replay of the graph of the launches whose index keep() accepts,
    captured with PDL like the engine's window graphs."""

    def body():
        for i, (_, fn, grid, block, args, kw) in enumerate(launches):
            if keep(i):
                relaunch(fn, grid, block, args, kw)

    return graph_time(cp, body, replays)


def label(name: str) -> str:
    """Kernel family: template arguments and grids dropped, the MMVQ instances kept apart by
    their name's head (mmvq, mmvq_ids, mmvq_ids_pair, mmvf, ...)."""
    return name.split("<")[0]


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", required=True)
    ap.add_argument("--width", type=int, default=1, help="sequences in the window, one token each")
    ap.add_argument("--context", type=int, default=64, help="tokens already in each sequence's cache")
    ap.add_argument("--replays", type=int, default=30)
    a = ap.parse_args()
    window, launches = record_window(a.pack, a.width, a.context)
    names = [label(n) for n, *_ in launches]

    wall = window_wall(cp, window, a.replays)
    full = chain_time(cp, launches, lambda i: True, a.replays)
    counts = collections.Counter(names)
    rows = []
    for n in counts:
        without = chain_time(cp, launches, lambda i, n=n: names[i] != n, a.replays)
        rows.append((n, counts[n], full - without))
    streams = {n for n in counts if n.startswith("mmv")}
    only = chain_time(cp, launches, lambda i: names[i] in streams, a.replays)
    full2 = chain_time(cp, launches, lambda i: True, a.replays)  # drift check
    print(f"pack {a.pack}: window of {a.width} token(s), context {a.context}, {len(launches)} launches")
    print("| kernel | launches | chain us saved without it | us per launch |")
    print("|---|---:|---:|---:|")
    for n, c, dt in sorted(rows, key=lambda r: -r[2]):
        print(f"| {n} | {c} | {dt * 1e6:.1f} | {dt * 1e6 / c:.2f} |")
    print(f"| all launches, one PDL graph (twice: drift) | {len(launches)} | {full * 1e6:.1f} / {full2 * 1e6:.1f} | |")
    print(f"| the weight-streaming launches only ({', '.join(sorted(streams))}) | "
          f"{sum(counts[n] for n in streams)} | {only * 1e6:.1f} | |")
    print(f"| the engine's window (graph replay + copies), wall | | {wall * 1e6:.1f} | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
