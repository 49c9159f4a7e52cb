"""Time opening GGUF files: Strata's reader vs the gguf package's GGUFReader.

    python bench/gguf_open.py [FILE ...]      (default: the bundled test model)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from strata.gguf import GGUFFile


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(paths: list[str]) -> None:
    if not paths:
        from strata.pack.synth import smollm_model_path

        paths = [str(smollm_model_path())]
    try:
        from gguf import GGUFReader
    except ImportError:
        GGUFReader = None
    print(f"{'file':<50} {'strata s':>9} {'gguf pkg s':>11} {'tensors':>8} {'tokens':>7}")
    for p in paths:
        ours = best_of(lambda: GGUFFile(p).close())
        f = GGUFFile(p)
        theirs = float("nan")
        if GGUFReader is not None:
            try:
                theirs = best_of(lambda: GGUFReader(p), repeats=1)
            except Exception:  # e.g. Q2_0, which the package does not know
                pass
        print(f"{Path(p).name:<50} {ours:9.3f} {theirs:11.3f} {len(f.tensors):8d} "
              f"{len(f.metadata.get('tokenizer.ggml.tokens', [])):7d}")


if __name__ == "__main__":
    main(sys.argv[1:])
