"""`strata generate [engine flags] --prompt TEXT ...`: one completion, streamed to stdout."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from strata.engine.options import EngineOptions, add_engine_arguments, bounded
from strata.protocol import KNOB_DEFAULTS, KNOBS, FinishEvent, GenerationRequest, SamplingParams
from strata.errors import EXIT_DEVICE_LOST
from strata.text.tokenizer import refuse_lone_surrogates


def _seed(value: str) -> int | None:
    """argparse type: -1 means random (None), as in llama.cpp; else a seed numpy takes."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if n == -1:
        return None
    if not 0 <= n < 2 ** 64:
        raise argparse.ArgumentTypeError(f"expected -1 (random) or a number in [0, 2**64), got {value!r}")
    return n


def _flag_knobs() -> dict:
    return {name: k for name, k in KNOBS.items() if k.flag_help is not None}


def add_arguments(p) -> None:
    add_engine_arguments(p, serving=False)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    g.add_argument("--system", default=None, help="a system message")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    # the ranges of the HTTP API's fields of the same names (strata.sampling.bounds)
    g.add_argument("--max-tokens", type=bounded("max_tokens"), default=128,
                   help="tokens to generate at most (>= 1) (default: 128)")
    for name, k in _flag_knobs().items():  # the sampling knobs with a flag (strata/protocol.py, KNOBS)
        default = KNOB_DEFAULTS[name] if k.flag_default is None else k.flag_default
        g.add_argument("--" + name.replace("_", "-"), type=bounded(name), default=default,
                       help=f"{k.flag_help} (default: {default:g})")
    g.add_argument("--seed", type=_seed, default=None, help="sampling seed in [0, 2**64); -1: random (as llama.cpp)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def run(args) -> int:
    from strata.engine.core import EngineCore
    from strata.errors import StrataError

    opts = EngineOptions.from_namespace(args)
    for flag, text in (("--prompt", args.prompt), ("--system", args.system), *(("--stop", s) for s in args.stop)):
        if text:
            refuse_lone_surrogates(text, flag)  # (before the model loads: a typo costs no load)
    t0 = time.perf_counter()
    core = EngineCore.load(opts)
    t_load = time.perf_counter() - t0
    if args.raw:
        prompt_ids = core.tokenizer.encode(args.prompt, add_special=True)
    else:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        msgs.append({"role": "user", "content": args.prompt})
        prompt_ids = core.tokenizer.encode(core.chat.render(msgs), add_special=True)
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.seed, stop=list(args.stop),
                            **{name: getattr(args, name) for name in _flag_knobs()})
    handle = core.submit(GenerationRequest(prompt_ids, params))
    t1 = time.perf_counter()
    core.scheduler.run_until_idle()  # the CLI drives windows on its own thread
    ids, text, t_first = [], [], None
    while True:
        ev = handle.events.get()
        if isinstance(ev, FinishEvent):
            break
        if t_first is None:
            t_first = time.perf_counter()
        ids.append(ev.token_id)
        text.append(ev.text)
        if not args.json:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    text.append(ev.text_tail)
    t2 = time.perf_counter()
    if ev.reason == "error" and ev.code == "device_lost":
        # the GPU can run nothing more: the line, then out without CuPy's finalizers (which would
        # fail on the lost context)
        print(f"strata: {ev.error}", file=sys.stderr, flush=True)
        os._exit(EXIT_DEVICE_LOST)
    if ev.reason == "error":
        raise StrataError(ev.error or "generation failed")
    if args.json:
        m = core.metrics()
        out = {
            "prompt_token_ids": prompt_ids,
            "completion_token_ids": ids,
            "text": "".join(text),
            "finish_reason": ev.reason,
            "usage": {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens},
            "timings": {"load_s": round(t_load, 3), "total_s": round(t2 - t1, 3),
                        "tokens_per_s": round(len(ids) / (t2 - t1), 2) if ids else 0.0},
        }
        slot = m["slots"][0]
        if core.draft is not None:
            out["mtp"] = {"windows": slot["mtp_windows"], "drafted": slot["mtp_drafted"],
                          "accepted": slot["mtp_accepted"]}
        print(json.dumps(out))
    else:
        sys.stdout.write(ev.text_tail + "\n")
    return 0
