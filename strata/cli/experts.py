"""`strata experts profile --pack P --prompts FILE --out FILE`: run prompts through the engine and
write how often each layer's experts were routed to, the file `--expert-profile` reads
(strata/experts/profile.py).

The prompts file holds one prompt per line (blank lines skipped), each sent as a user message
through the pack's chat template (--raw: as plain text), answered greedily for --max-tokens
tokens: a profile counts the routing of prompts and answers alike, as a served engine sees both.
"""

from __future__ import annotations

from pathlib import Path

from strata.engine.options import _positive_int, add_engine_arguments
from strata.errors import StrataError


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="experts_command", metavar="profile", required=True)
    t = sub.add_parser("profile", help="record per-layer expert routing counts (an --expert-profile file)")
    add_engine_arguments(t, serving=False)
    g = t.add_argument_group("profile")
    g.add_argument("--prompts", required=True, metavar="FILE", help="one prompt per line")
    g.add_argument("--out", required=True, metavar="FILE", help="the profile to write")
    g.add_argument("--max-tokens", type=_positive_int, default=64, help="tokens answered per prompt (default: 64)")
    g.add_argument("--raw", action="store_true", help="send each line as plain text, not through the chat template")


def read_prompts(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"--prompts {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise StrataError(f"--prompts {path}: no prompts (one per line)")
    return prompts


def run(args) -> int:
    from strata.engine.core import EngineCore
    from strata.engine.options import EngineOptions
    from strata.gguf.out_path import out_file
    from strata.protocol import GenerationRequest, SamplingParams

    prompts = read_prompts(args.prompts)  # (both checked before the model loads)
    out = out_file(args.out, "--out")
    core = EngineCore.load(EngineOptions.from_namespace(args))
    if core.backend.expert_counts() is None:
        raise StrataError(f"strata experts profile: the {core.backend.name} backend does not count its expert "
                          "routing; run it with --device cpu")
    if not core.cfg.n_expert:
        raise StrataError(f"strata experts profile: {core.pack.label} has no routed experts ({core.cfg.arch})")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    handles = []
    for text in prompts:
        rendered = text if args.raw else core.chat.render([{"role": "user", "content": text}])
        handles.append(core.submit(GenerationRequest(core.tokenizer.encode(rendered, add_special=True), params)))
    core.scheduler.run_until_idle()
    for h in handles:
        _, _, fin = h.collect(timeout=60.0)
        if fin.reason == "error":
            raise StrataError(f"strata experts profile: a prompt failed: {fin.error}")
    core.write_expert_profile(str(out))
    core.stop()
    print(f"strata: expert profile of {len(prompts)} prompts written to {out}")
    return 0
