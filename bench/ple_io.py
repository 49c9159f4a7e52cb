"""The n-gram table's row reads in each --ple-io mode (strata/gguf/row_source.py): rows/s and MB/s.

A synthetic table file: one GGUF tensor of IQ4_NL rows of 160 values (90 bytes, the real table's
rows), --size-gib of them (default 2). A window of B tokens reads 16 random rows a token (the
hash spreads a token's rows over the whole table), B in 1, 4, 64. Each cell runs windows for
about --seconds and reports rows/s, MB/s of row bytes, and microseconds per window.

States:
  cold  the file's pages dropped from the page cache before the cell (posix_fadvise DONTNEED on a
        file nobody maps; Linux), and the source opened afresh
  warm  the whole file read once beforehand (every page in the page cache)
ram has no state (its load copies the table into memory: that load, from a cold page cache, is
timed and printed; then every B);
direct with O_DIRECT skips the page cache, so its warm run differs from its cold one only by
what the disk or the host under a virtual disk caches.

    python bench/ple_io.py [--size-gib 2] [--dir DIR] [--seconds 1.5] [--keep]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.gguf.reader import GGUFFile  # noqa: E402
from strata.gguf.row_source import HostTables  # noqa: E402
from strata.units import size_text  # noqa: E402
from strata.gguf.writer import GGUFWriter  # noqa: E402
from strata.kernels.ggml_types import BY_NAME  # noqa: E402

TABLE = "per_layer_token_embd.weight"
ROW_VALUES, ROWS_PER_TOKEN = 160, 16
BATCHES = (1, 4, 64)
CHUNK = 64 << 20


def write_table(path: Path, size: int) -> Path:
    iq4 = BY_NAME["IQ4_NL"]
    row_bytes = iq4.nbytes(ROW_VALUES)
    rows = size // row_bytes
    total = rows * row_bytes
    rng = np.random.default_rng(0)

    def chunks():
        done = 0
        while done < total:
            n = min(CHUNK, total - done)
            yield np.frombuffer(rng.bytes(n), np.uint8)
            done += n

    w = GGUFWriter(path)
    w.add_metadata("general.architecture", "qwen4exp")
    w.add_tensor(TABLE, iq4.id, (ROW_VALUES, rows), chunks)
    return w.write()


def drop_cache(path: Path) -> bool:
    """The file's pages out of the page cache (False where the OS cannot be asked)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def read_whole(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass


def run_cell(src, n_rows: int, batch: int, seconds: float, seed: int) -> tuple[float, float, float]:
    """(rows/s, MB/s, us per window) over windows of `batch` tokens until `seconds` pass."""
    rng = np.random.default_rng(seed)
    rows = windows = 0
    t0 = time.perf_counter()
    while True:
        idx = rng.integers(0, n_rows, batch * ROWS_PER_TOKEN)
        src.rows(idx)
        rows, windows = rows + idx.size, windows + 1
        dt = time.perf_counter() - t0
        if (dt >= seconds and windows >= 3) or windows >= 200_000:
            break
    return rows / dt, rows * src.row_bytes / dt / 1e6, dt / windows * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="where the table file is written (default: the temp folder)")
    ap.add_argument("--seconds", type=float, default=1.5, help="per cell")
    ap.add_argument("--keep", action="store_true", help="keep the table file")
    args = ap.parse_args()
    folder = Path(args.dir or tempfile.gettempdir())
    path = folder / f"ple-io-bench-{os.getpid()}.gguf"
    t0 = time.perf_counter()
    write_table(path, int(args.size_gib * (1 << 30)))
    print(f"table: {path} ({size_text(path.stat().st_size)}), written in {time.perf_counter() - t0:.1f} s")
    try:
        bench(path, args.seconds)
    finally:
        if not args.keep:
            path.unlink()


def open_source(path: Path, mode: str):
    f = GGUFFile(path)  # opened afresh: a map made before a drop would keep its pages
    t0 = time.perf_counter()
    src = HostTables(mode).open(f.tensors[TABLE], BY_NAME["IQ4_NL"].nbytes(ROW_VALUES), "n-gram table")
    return f, src, time.perf_counter() - t0


def bench(path: Path, seconds: float) -> None:
    results = []
    for mode, state in (("mmap", "cold"), ("mmap", "warm"), ("direct", "cold"), ("direct", "warm")):
        for batch in BATCHES:
            if state == "cold" and not drop_cache(path):
                continue
            if state == "warm":
                read_whole(path)
            f, src, _ = open_source(path, mode)
            if batch == BATCHES[0] and state == "cold":
                print(f"{mode}: {src.where}")
            results.append((mode, state, batch, *run_cell(src, src.n_rows, batch, seconds, seed=batch)))
            del src
            f.close()
    cold = drop_cache(path)  # ram: one load (from disk where the cache could be dropped), every B after it
    f, src, load = open_source(path, "ram")
    size = path.stat().st_size
    print(f"ram: {src.where}: {size / load / 1e9:.2f} GB/s{' from a cold page cache' if cold else ''}")
    for batch in BATCHES:
        results.append(("ram", "-", batch, *run_cell(src, src.n_rows, batch, seconds, seed=batch)))
    print("\n| mode | state | B | rows/s | MB/s | us/window |\n|---|---|---:|---:|---:|---:|")
    for mode, state, batch, rate, mbs, us in results:
        print(f"| {mode} | {state} | {batch} | {rate:,.0f} | {mbs:.1f} | {us:,.1f} |")


if __name__ == "__main__":
    main()
