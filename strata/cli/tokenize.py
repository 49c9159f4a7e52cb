"""`strata tokenize [--pack P] [--native F] [--ple-gguf F] TEXT [--json] [--no-special] [--add-special]`: token ids of TEXT.

Only the pack's metadata is read (no weights are touched), so this is quick even for big
models. Without --pack the bundled SmolLM2-135M-Instruct is used. TEXT '-' reads stdin.
"""

from __future__ import annotations

import argparse
import json
import sys

from strata.defaults import default_model_path
from strata.engine.options import add_pack_arguments
from strata.pack.loader import open_pack
from strata.text.tokenizer import Tokenizer, refuse_lone_surrogates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pack_arguments(parser)  # only the model's files: no engine runs, so no other engine flag means anything
    parser.add_argument("text", metavar="TEXT", help="text to tokenize ('-' reads standard input)")
    parser.add_argument("--json", action="store_true", help='print {"ids": [...]}')
    parser.add_argument("--no-special", action="store_true",
                        help="treat special-token text such as <|im_start|> as plain text")
    parser.add_argument("--add-special", action="store_true",
                        help="add BOS/EOS as the vocabulary asks (add_bos_token / add_eos_token)")


def load_tokenizer(pack: str | None, native: str | None, ple_gguf) -> Tokenizer:
    if pack is None and native is None:
        pack = str(default_model_path())
    opened = open_pack(pack=pack, native=native, ple_gguf=ple_gguf)
    try:
        return Tokenizer.from_metadata(opened.metadata)
    finally:
        opened.close()


def run(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    refuse_lone_surrogates(text, "standard input" if args.text == "-" else "the text to tokenize")
    tokenizer = load_tokenizer(args.pack, args.native, args.ple_gguf)
    ids = tokenizer.encode(text, add_special=args.add_special, parse_special=not args.no_special)
    print(json.dumps({"ids": ids}) if args.json else " ".join(map(str, ids)))
    return 0
