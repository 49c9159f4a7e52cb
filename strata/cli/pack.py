"""`strata pack synth ...`: write synthetic packs (random valid blocks, real tokenizer)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from strata.errors import StrataError
from strata.kernels.ggml_types import BY_NAME
from strata.model.layers.delta_net import INPUT_FORMS
from strata.pack.presets import PRESETS, ROLE_ALIASES, ROLE_TENSORS, SUPPORTED_ARCHS, TINY
from strata.pack.synth import synth_pack
from strata.pack.synth_plan import with_delta_net_input

# flag dest -> SynthSpec field it overrides
SIZE_FLAGS = {
    "layers": "n_layer",
    "n_embd": "n_embd",
    "n_ff": "n_ff",
    "n_expert": "n_expert",
    "n_expert_used": "n_expert_used",
    "expert_ff": "expert_ff",
    "heads": "n_head",
    "kv_heads": "n_head_kv",
    "head_dim": "head_dim",
    "vocab": "vocab",
    "context": "context",
    "ssm_state": "ssm_state",
    "ssm_groups": "ssm_groups",
    "ssm_heads": "ssm_heads",
    "shexp_ff": "shexp_ff",
    "attn_interval": "attn_interval",
    "nextn": "nextn",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="pack_command", metavar="{synth}")
    sub.required = True
    s = sub.add_parser("synth", help="write a synthetic pack")
    s.add_argument("--out", required=True, help="directory to write the pack into")
    s.add_argument("--preset", choices=sorted(PRESETS), help="shapes and types (default: a tiny model of --arch)")
    s.add_argument("--arch", choices=SUPPORTED_ARCHS, help="architecture (default: the preset's, else llama)")
    s.add_argument("--type", action="append", default=[], metavar="ROLE=TYPE",
                   help=f"type per role, TYPE or T1/T2 alternating by layer; roles: {', '.join([*ROLE_ALIASES, *ROLE_TENSORS])}")
    s.add_argument("--mtp", metavar="DIR", help="also write a matching MTP draft as DIR/mtp.gguf")
    s.add_argument("--shards", type=int, default=1, help="split into NAME-0000i-of-0000N.gguf files")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--name", default="model", help="file name stem (default: model)")
    s.add_argument("--force", action="store_true", help="replace other .gguf files in --out")
    s.add_argument("--tied-output", action=argparse.BooleanOptionalAction, default=None,
                   help="share the embedding as output head (no output.weight)")
    s.add_argument("--delta-net-input", choices=INPUT_FORMS,
                   help="the hybrid archs' DeltaNet input projection: split (attn_qkv + attn_gate, the default) "
                        "or fused (one ssm_in, as earlier llama.cpp converters wrote qwen3next)")
    for dest in SIZE_FLAGS:
        s.add_argument("--" + dest.replace("_", "-"), dest=dest, type=int)


def parse_type_flags(values: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        role, sep, type_text = item.partition("=")
        role = role.strip()
        if not sep or not type_text.strip():
            raise StrataError(f"--type {item}: expected ROLE=TYPE (e.g. attn=Q4_K or ffn_down_exps=Q2_0/IQ4_NL)")
        for name in type_text.split("/"):
            if name.strip().upper() not in BY_NAME:
                raise StrataError(f"--type {item}: unknown type {name.strip()} (known: {', '.join(BY_NAME)})")
        roles = ROLE_ALIASES.get(role, (role,))
        for r in roles:
            if r not in ROLE_TENSORS:
                raise StrataError(f"--type {item}: unknown role {role} (roles: {', '.join([*ROLE_ALIASES, *ROLE_TENSORS])})")
            out[r] = type_text.strip().upper()
    return out


def build_spec(args: argparse.Namespace):
    if args.preset:
        spec = PRESETS[args.preset]
        if args.arch and args.arch != spec.arch:
            spec = replace(spec, arch=args.arch)
    else:
        spec = TINY[args.arch or "llama"]
    sizes = {field: getattr(args, dest) for dest, field in SIZE_FLAGS.items() if getattr(args, dest) is not None}
    spec = replace(spec, **sizes)
    if args.tied_output is not None:
        spec = replace(spec, tied_output=args.tied_output)
    if args.delta_net_input is not None:
        spec = with_delta_net_input(spec, args.delta_net_input)
    return spec.with_types(parse_type_flags(args.type))


def run(args: argparse.Namespace) -> int:
    spec = build_spec(args)
    synth_pack(spec, args.out, name=args.name, shards=args.shards, seed=args.seed,
               mtp_dir=args.mtp, force=args.force, progress=lambda line: print(line, flush=True))
    return 0
