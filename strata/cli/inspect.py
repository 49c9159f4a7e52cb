"""`strata inspect PACK [--json]`: a pack's tensors grouped by role and type, its metadata (the
common keys, then every key of its architecture's own table that the pack sets: strata/model/
archs/), and whether the engine would load it.

The check is the engine's own load check (Pack.model_config: the metadata key table and every
tensor the architecture reads; then the tokenizer and the chat template as the engine builds
them), run after the summary is printed: a pack the engine refuses
still gets its listing, then the engine's one line (on stderr, `strata: ...`) and exit code 2.
A file the GGUF reader cannot open at all gets that one line alone."""

from __future__ import annotations

import argparse
import json
import sys

from strata.errors import StrataError
from strata.model.archs import ARCHS
from strata.pack.loader import open_pack
from strata.pack.summary import group_by_role, group_by_type, metadata_summary, printable

MIB = 2**20
SHOWN_ENTRIES = 8  # an array key's values printed before "... (N entries)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pack", nargs="?", help="pack directory or GGUF file")
    parser.add_argument("--native", help="main shard (relative to PACK when PACK is a directory)")
    parser.add_argument("--ple-gguf", action="append", default=[], help="extra shard joining the namespace")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--tensors", action="store_true", help="also list every tensor")
    parser.add_argument("--no-check", action="store_true",
                        help="list only, without the engine's load check (for a shard or a draft GGUF, "
                             "no model by itself)")


def _check(pack) -> tuple[str | None, StrataError | None]:
    """(the check's ok line, None) when the engine would load the pack, else (None, its refusal)."""
    from strata.pack.weight_check import check_weights
    from strata.text.chat_template import ChatTemplate
    from strata.text.tokenizer import Tokenizer

    try:
        cfg = pack.model_config()  # what EngineCore.load runs before it builds a model,
        check_weights(pack)  # (NaN / Inf in weights: sampled, strata/pack/weight_check.py)
        Tokenizer.from_metadata(pack.metadata)  # in its order
        ChatTemplate.from_metadata(pack.metadata)  # (a template that breaks its limits fails here)
    except StrataError as e:
        return None, e
    return (f"check: ok (the engine would load it: {cfg.arch}, {cfg.n_layer} layers, "
            f"{len(pack.tensors)} tensors, {pack.total_bytes / MIB:.1f} MiB)"), None


def arch_keys(metadata) -> dict:
    """key name (without the arch prefix) -> value, for each key of the architecture's own table
    (ArchSpec.keys) the pack sets, in the table's order; arrays as lists."""
    arch = metadata.get("general.architecture")
    spec = ARCHS.get(arch) if isinstance(arch, str) else None
    out = {}
    for key in spec.keys if spec is not None else ():
        value = metadata.get(key.full_name(arch))
        if value is not None:
            value = value.tolist() if hasattr(value, "tolist") else value
            out[key.name] = [printable(v) for v in value] if isinstance(value, list) else printable(value)
    return out


def _key_text(value) -> str:
    if not isinstance(value, list) or len(value) <= SHOWN_ENTRIES:
        return str(value)
    return "[" + ", ".join(str(v) for v in value[:SHOWN_ENTRIES]) + f", ...] ({len(value)} entries)"


def _report(pack) -> dict:
    infos = list(pack.tensors.values())
    return {
        "files": [str(f.path) for f in pack.files],
        "gguf_versions": [f.version for f in pack.files],
        "metadata": metadata_summary(pack.metadata),
        "arch_keys": arch_keys(pack.metadata),
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
    own = arch_keys(pack.metadata)
    if own:
        print(f"\n{pack.metadata['general.architecture']} keys")
        width = max(len(k) for k in own)
        for key, value in own.items():
            print(f"  {key:<{width}}  {_key_text(value)}")
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
    try:
        ok, refusal = (None, None) if args.no_check else _check(pack)
        if args.json:
            report = _report(pack)
            report["check"] = (None if args.no_check else {"ok": True} if refusal is None
                               else {"ok": False, "problem": refusal.message})
            print(json.dumps(report, indent=1))
        else:
            _print_text(pack, args.tensors)
            if ok is not None:
                print(f"\n{ok}")
    finally:
        pack.close()
    if refusal is not None:
        sys.stdout.flush()  # the listing first, then the engine's line, in a log that takes both
        raise refusal
    return 0
