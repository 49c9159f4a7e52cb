"""Acceptance of a draft measured by the real engine (no PyTorch): what `--mtp` will see.

Runs greedy requests through EngineCore with the draft and reads the slot counters
(windows, drafted, accepted per draft position) that `strata generate --json` and the
metrics endpoint report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from strata.engine.core import EngineCore
from strata.engine.options import parse_engine_args
from strata.model.transformer import Span
from strata.protocol import GenerationRequest, SamplingParams


@dataclass
class Acceptance:
    windows: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    decode_windows: int = 0  # every window after the prompts' prefill, drafting or not
    decode_tokens: int = 0  # tokens those windows emitted (the prefill window emits each prompt's first)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_decode_window(self) -> float:
        """Tokens per window over all decode windows (with --spec-min-p some windows do not draft)."""
        return self.decode_tokens / self.decode_windows if self.decode_windows else 0.0

    @property
    def tokens_per_window(self) -> float:
        """Mean tokens a verifying window emits: accepted drafts + the target's own token."""
        return 1.0 + self.accepted / self.windows if self.windows else 1.0

    def per_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]


def chat_ids(core, text: str) -> list[int]:
    return core.tokenizer.encode(core.chat.render([{"role": "user", "content": text}]), add_special=True)


def run_prompts(core, prompts: list[list[int]], max_tokens: int, params: SamplingParams | None = None,
                concurrent: int = 1) -> Acceptance:
    """Greedy generation of every prompt, `concurrent` at a time (one window serves them all)."""
    before = [dict(s) for s in core.metrics()["slots"]]
    windows0 = core.scheduler.windows
    out = Acceptance()
    t0 = time.perf_counter()
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0)
    groups = [prompts[i : i + concurrent] for i in range(0, len(prompts), concurrent)]
    for group in groups:
        handles = [core.submit(GenerationRequest(list(p), params)) for p in group]
        core.scheduler.run_until_idle()
        for h in handles:
            ids = h.collect()[0]
            out.outputs.append(ids)
            out.tokens += len(ids)
    out.seconds = time.perf_counter() - t0
    # one prefill window per prompt group (prompts here are far shorter than a prefill chunk)
    out.decode_windows = core.scheduler.windows - windows0 - len(groups)
    out.decode_tokens = out.tokens - sum(1 for o in out.outputs if o)
    for b, s in zip(before, core.metrics()["slots"]):
        out.windows += s["mtp_windows"] - b["mtp_windows"]
        out.drafted += s["mtp_drafted"] - b["mtp_drafted"]
        out.accepted += s["mtp_accepted"] - b["mtp_accepted"]
        for j, (d, a) in enumerate(zip(s["mtp_drafted_per_pos"], s["mtp_accepted_per_pos"])):
            d0 = b["mtp_drafted_per_pos"][j] if j < len(b["mtp_drafted_per_pos"]) else 0
            a0 = b["mtp_accepted_per_pos"][j] if j < len(b["mtp_accepted_per_pos"]) else 0
            while len(out.drafted_per_pos) <= j:
                out.drafted_per_pos.append(0)
                out.accepted_per_pos.append(0)
            out.drafted_per_pos[j] += d - d0
            out.accepted_per_pos[j] += a - a0
    return out


def load_core(pack: str | None, draft: str | None, spec: int, *, min_p: float = 0.0, parallel: int = 1,
              batch_mtp: bool = False, device: str = "cpu", log=lambda s: None):
    args = ["--device", device, "--parallel", str(parallel), "--max-context", "2048"]
    if pack:
        args += ["--pack", str(pack)]
    if draft and spec > 0:
        args += ["--mtp", str(draft), "--spec", str(spec), "--spec-min-p", str(min_p)]
    if batch_mtp:
        args.append("--batch-mtp")
    return EngineCore.load(parse_engine_args(args, serving=False), log=log)


def divergence(core, prompt: list[int], want: list[int], got: list[int]) -> tuple[int, float] | None:
    """Where two greedy outputs first differ and the target's own logit gap there (plain forward).

    A gap of ~1e-3 means a near-tie that batched and one-row forwards round differently (the
    verifier kept the target's argmax of its window); a large gap would be a real bug.
    """
    i = next((j for j in range(min(len(want), len(got))) if want[j] != got[j]), None)
    if i is None:
        return None
    m = core.model
    seq = list(prompt) + list(want[:i])
    h = m.forward(np.asarray(seq), [Span(m.new_cache(len(seq) + 1, "f16"), 0, len(seq))])
    lg = core.backend.to_host(m.logits(h[-1:]))[0]
    return i, float(lg[want[i]] - lg[got[i]])
