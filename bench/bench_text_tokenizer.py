"""Tokenizer speed on the test model (SmolLM2, 49k byte-level BPE vocabulary).

    python bench/bench_text_tokenizer.py [--pack FILE] [--repeat 5]

Prints the best of N for: reading the metadata, building the Tokenizer, building the
parse_special=False twin, encoding ~100 KiB of text, decoding it, and streaming it.
"""

from __future__ import annotations

import argparse
import time

from strata.defaults import default_model_path
from strata.gguf.reader import GGUFFile
from strata.text.stream import StreamDecoder
from strata.text.tokenizer import Tokenizer

SAMPLE = (
    "The quick brown fox jumps over the lazy dog. 1234567890 for (i = 0; i < n; ++i) {}\n"
    "日本語のテキストです。中文测试。 emoji: 😀🎉👍🏽 🇫🇷  Ünïcödé text.\n"
) * 800


def best(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return min(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", default=None, help="GGUF file (default: the bundled SmolLM2)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    path = args.pack or default_model_path()

    def read():
        with GGUFFile(path) as f:
            return dict(f.metadata)

    rows = []
    t, md = best(read, args.repeat)
    rows.append(("read metadata", t, ""))
    t, tok = best(lambda: Tokenizer.from_metadata(md), args.repeat)
    rows.append(("build Tokenizer", t, f"{tok.vocab_size} tokens"))
    t, _ = best(lambda: Tokenizer.from_metadata(md)._plain(), args.repeat)
    rows.append(("build + plain twin", t, "first parse_special=False call"))
    t, ids = best(lambda: tok.encode(SAMPLE), args.repeat)
    rows.append(("encode", t, f"{len(SAMPLE.encode()) / 2**20 / t:.1f} MiB/s, {len(ids) / t / 1e3:.0f} k tok/s"))
    t, _ = best(lambda: tok.decode(ids), args.repeat)
    rows.append(("decode", t, f"{len(ids) / t / 1e6:.2f} M tok/s"))
    t, _ = best(lambda: StreamDecoder(tok).feed_many(ids), args.repeat)
    rows.append(("stream decode", t, f"{len(ids) / t / 1e6:.2f} M tok/s"))

    print(f"{'step':<22} {'ms':>9}  note")
    for name, seconds, note in rows:
        print(f"{name:<22} {seconds * 1e3:9.2f}  {note}")


if __name__ == "__main__":
    main()
