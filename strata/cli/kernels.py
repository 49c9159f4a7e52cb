"""`strata kernels [--json]`: the native kernel table, one row per GGML type.

Columns: type, id, block (weights), bytes (per block), then per backend: `native 1..N` (a native
quantized mat-vec taking 1..N activation columns per launch), `generic` (dequantize + matmul),
or `not built` (CUDA: CuPy or a GPU is absent; the reason is printed below the table).
"""

from __future__ import annotations

import argparse
import json

from strata.backend.kernel_table import add_cuda_rows
from strata.kernels.native_table import cpu_table

BACKENDS = ("cpu", "cuda")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _format(rows: list[dict]) -> str:
    header = ("type", "id", "block", "bytes") + BACKENDS
    cells = [[str(r[h]) for h in header] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*c) for c in cells])


def run(args: argparse.Namespace) -> int:
    table = cpu_table()
    add_cuda_rows(table)  # never raises: an absent CuPy/GPU marks cuda "not built"
    rows = table.rows(BACKENDS)
    if args.json:
        print(json.dumps({"rows": rows, "unavailable": table.unavailable,
                          "impls": {f"{k.backend}:{k.type_name}": k.impl_name for k in table.kernels()}},
                         indent=1))
        return 0
    print(_format(rows))
    for backend, why in table.unavailable.items():
        print(f"{backend}: {why}")
    return 0
