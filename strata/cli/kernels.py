"""`strata kernels [--pack PACK] [--json]`: the native kernel table, one row per GGML type.

Columns: type, id, block (weights), bytes (per block), then per backend: `native 1..N` (a native
quantized mat-vec taking 1..N activation columns per launch), `generic` (dequantize + matmul),
or `not built` (CUDA: CuPy or a GPU is absent; the reason is printed below the table).

With a pack (--pack, or --native / --ple-gguf for its shards): only the types its tensors use,
each with the tensor roles that use it (`blk.*.ffn_down_exps`: the layer number as `*`), so a
pack's new tensors show which kernel serves them; `strata probe` says how each path runs them.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from strata.backend.kernel_table import add_cuda_rows
from strata.kernels.native_table import cpu_table
from strata.kernels.probe import role_of

BACKENDS = ("cpu", "cuda")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pack", help="only the types this pack (directory or GGUF file) uses, with their roles")
    parser.add_argument("--native", help="the pack's main shard (relative to --pack when that is a directory)")
    parser.add_argument("--ple-gguf", action="append", default=[], help="extra shard joining the pack's namespace")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _format(rows: list[dict], header: tuple[str, ...]) -> str:
    cells = [[str(r[h]) if h != "roles" else ", ".join(r[h]) for h in header] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*c).rstrip() for c in [list(header)] + cells)


def pack_roles(args: argparse.Namespace) -> tuple[str, dict[str, list[str]]]:
    """(the pack's label, type name -> the sorted roles of its tensors of that type)."""
    from strata.pack.loader import open_pack

    pack = open_pack(pack=args.pack, native=args.native, ple_gguf=args.ple_gguf or None)
    try:
        roles: dict[str, set[str]] = defaultdict(set)
        for name, info in pack.tensors.items():
            roles[info.type.name].add(role_of(name))
        return pack.label, {t: sorted(r) for t, r in roles.items()}
    finally:
        pack.close()


def run(args: argparse.Namespace) -> int:
    table = cpu_table()
    add_cuda_rows(table)  # never raises: an absent CuPy/GPU marks cuda "not built"
    rows = table.rows(BACKENDS)
    header = ("type", "id", "block", "bytes") + BACKENDS
    label = None
    if args.pack is not None or args.native is not None:
        label, roles = pack_roles(args)
        rows = [{**r, "roles": roles[r["type"]]} for r in rows if r["type"] in roles]
        header += ("roles",)
    if args.json:
        out = {"rows": rows, "unavailable": table.unavailable,
               "impls": {f"{k.backend}:{k.type_name}": k.impl_name for k in table.kernels()}}
        if label is not None:
            out["pack"] = label
        print(json.dumps(out, indent=1))
        return 0
    if label is not None:
        print(f"pack {label}: the {len(rows)} types its tensors use")
    print(_format(rows, header))
    for backend, why in table.unavailable.items():
        print(f"{backend}: {why}")
    return 0
