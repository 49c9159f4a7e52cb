"""`strata inspect PACK [--json]`: a pack's tensors grouped by role and type, and its metadata."""

from __future__ import annotations

import argparse
import json

from strata.errors import StrataError
from strata.pack.loader import open_pack
from strata.pack.summary import group_by_role, group_by_type, metadata_summary

MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pack", nargs="?", help="pack directory or GGUF file")
    parser.add_argument("--native", help="main shard (relative to PACK when PACK is a directory)")
    parser.add_argument("--ple-gguf", action="append", default=[], help="extra shard joining the namespace")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--tensors", action="store_true", help="also list every tensor")


def _report(pack) -> dict:
    infos = list(pack.tensors.values())
    return {
        "files": [str(f.path) for f in pack.files],
        "gguf_versions": [f.version for f in pack.files],
        "metadata": metadata_summary(pack.metadata),
        "total_bytes": pack.total_bytes,
        "tensor_count": len(infos),
        "roles": [g.as_dict() for g in group_by_role(infos)],
        "types": group_by_type(infos),
        "tensors": [
            {
                "name": t.name,
                "type": t.type.name,
                "shape": list(t.shape),
                "offset": t.offset,
                "bytes": t.nbytes,
                "file": str(t.path),
            }
            for t in infos
        ],
    }


def _print_text(pack, show_tensors: bool) -> None:
    infos = list(pack.tensors.values())
    print(f"pack {pack.label}")
    for f in pack.files:
        print(f"  file  {f.path}  (GGUF v{f.version}, {len(f.tensors)} tensors)")
    print("\nmetadata")
    for key, value in metadata_summary(pack.metadata).items():
        print(f"  {key:<20} {value}")
    groups = group_by_role(infos)
    width = max((len(g.role) for g in groups), default=10)
    print(f"\ntensors by role ({len(infos)} tensors, {pack.total_bytes / MIB:.1f} MiB)")
    for g in groups:
        print(f"  {g.role:<{width}}  {g.count:>4} tensors  {g.shape_text():<18} {g.type_text():<28} {g.nbytes / MIB:9.1f} MiB")
    print("\nby type")
    for r in group_by_type(infos):
        print(f"  {r['type']:<8} {r['tensors']:>5} tensors  {r['bytes'] / MIB:9.1f} MiB  {r['bits_per_weight']:6.3f} bits/weight")
    if show_tensors:
        print("\ntensors")
        for t in infos:
            print(f"  {t.name:<40} {t.type.name:<8} {str(list(t.shape)):<22} {t.nbytes:>12} @ {t.offset}")


def run(args: argparse.Namespace) -> int:
    if args.pack is None and args.native is None:
        # (open_pack's own line names --pack, the engine's flag; inspect takes the pack as its argument)
        raise StrataError("strata inspect: name the pack to inspect: strata inspect DIR|FILE.gguf "
                          "(or --native FILE for a pack's main shard)")
    pack = open_pack(pack=args.pack, native=args.native, ple_gguf=args.ple_gguf or None)
    if args.json:
        print(json.dumps(_report(pack), indent=1))
    else:
        _print_text(pack, args.tensors)
    return 0
