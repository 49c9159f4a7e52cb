"""What the render limits cost: a chat template rendered by plain jinja (as transformers
configures it) and by ChatTemplate (under its limits), on long and short conversations.

    python bench/bench_chat_template.py [--pack FILE] [--template FILE.j2] [--repeat 5]

Prints the best of N for each conversation size; both renders must give the same text.
"""

from __future__ import annotations

import argparse
import time

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.defaults import default_model_path
from strata.gguf.reader import GGUFFile
from strata.text import chat_template as ct

# (turns, characters a turn): ~1 MB in long turns, ~1 MB in short ones, a chat, one question
SIZES = ((1000, 1000), (10000, 100), (200, 40), (4, 50))


def plain_render(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = ct._tojson
    env.globals.update(raise_exception=ct._raise_exception, strftime_now=ct._strftime_now)
    template = env.from_string(source)
    return lambda messages: template.render(messages=ct.normalize_messages(messages), tools=None,
                                            add_generation_prompt=True, bos_token="", eos_token="")


def conversation(turns: int, chars: int) -> list[dict]:
    body = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    return [{"role": ("user", "assistant")[i % 2], "content": f"{i} {body}"} for i in range(turns)]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", default=None, help="GGUF file whose template to use (default: the bundled SmolLM2)")
    ap.add_argument("--template", default=None, help="a Jinja file to use instead")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.template:
        with open(args.template, encoding="utf-8") as f:
            source = f.read()
    else:
        with GGUFFile(args.pack or default_model_path()) as f:
            source = str(f.metadata[ct.TEMPLATE_KEY])
    plain, limited = plain_render(source), ct.ChatTemplate(source)
    for turns, chars in SIZES:
        messages = conversation(turns, chars)
        text = limited.render(messages)
        assert text == plain(messages), "the limits changed the text"
        t_plain = best(lambda: plain(messages), args.repeat)
        t_limited = best(lambda: limited.render(messages), args.repeat)
        print(f"{turns:6d} turns x {chars:5d} chars ({len(text) / 1e6:5.2f} MB out): plain {t_plain * 1e3:8.2f} ms, "
              f"limited {t_limited * 1e3:8.2f} ms ({t_limited / t_plain:.2f}x)")


if __name__ == "__main__":
    main()
