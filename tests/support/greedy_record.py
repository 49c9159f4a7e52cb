"""The greedy tokens of every architecture Strata loads, in every decoding mode, as a record.

A later change to the model, batch or engine code must keep these tokens bit-equal: the record
(tests/data/greedy_record_<device>.json, written by bench/record_greedy.py) is taken from the code
as it is, and tests/test_greedy_record.py runs the same cases again and compares.

Each case is a pack (a tiny synthetic pack of one architecture, the seed-moe preset with its MTP
draft, or the test model with its shipped draft), two fixed prompts (token id lists) and the modes
it is run in: plain (one slot, one request at a time), the same with top_logprobs=2 (its per-step
margins between the top-1 and top-2 logits decide how far a comparison is meaningful), both
prompts batched in two slots, and, where the pack has a draft, --spec 2 with and without
--batch-mtp (two slots, both prompts at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1
MAX_TOKENS = 16
SPEC = 2
VOCAB = 4096  # the session-wide synthetic packs' vocabulary (tests/support/engines.SHARED_VOCAB)

# token ids below VOCAB, fixed: the tiny packs share the test model's first VOCAB tokens
SYNTH_PROMPTS = ([1, 504, 2821, 314, 1115, 30, 1826, 3012, 42, 260, 3777],
                 [2, 17, 999, 4095, 1234, 2345, 3456, 60, 61, 62, 1000, 2000, 3000, 7, 8])
# the test model's prompts are rendered through its chat template when the record is written and
# stored as ids in the record (the comparison never tokenizes)
MODEL_TEXTS = ("Name three rivers in Europe.", "Write a Python function that reverses a list.")

SYNTH_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen4exp")
# their tiny packs carry a nextn (MTP) layer: a draft
DRAFTED_ARCHS = ("qwen35", "qwen35moe", "qwen3next", "qwen4exp")


@dataclass(frozen=True)
class Case:
    name: str
    pack: str  # "tiny:<arch>", "seed-moe" or "model" (the test model)
    drafted: bool  # run the --spec modes
    devices: tuple[str, ...] = ("cpu", "cuda")  # where it is recorded and compared


# qwen4exp runs on the numpy ops of the backend seam only: its CUDA kernels (indexer selection,
# n-gram gather, stream mixes) are not written, so it has no CUDA record yet
CPU_ONLY_ARCHS = ("qwen4exp",)
CASES = ([Case(f"tiny-{a}", f"tiny:{a}", a in DRAFTED_ARCHS, ("cpu",) if a in CPU_ONLY_ARCHS else ("cpu", "cuda"))
          for a in SYNTH_ARCHS]
         + [Case("seed-moe", "seed-moe", True), Case("model", "model", True)])

PLAIN_MODES = ("plain", "logprobs")
BATCHED_MODES = ("parallel2", "spec2", "spec2_batch_mtp")
# mode -> (engine flags, both prompts submitted at once)
MODE_FLAGS: dict[str, tuple[list[str], bool]] = {
    "plain": (["--parallel", "1"], False),
    "logprobs": (["--parallel", "1"], False),
    "parallel2": (["--parallel", "2"], True),
    "spec2": (["--parallel", "2", "--spec", str(SPEC)], True),
    "spec2_batch_mtp": (["--parallel", "2", "--spec", str(SPEC), "--batch-mtp"], True),
}

# How far apart the two best logits must be for their order to be a fact of the model rather than
# of the arithmetic. Another BLAS kernel (OPENBLAS_CORETYPE), thread count or window shape adds a
# float32 sum of n terms in another order, which moves it by ~eps32 * sqrt(n) of its magnitude;
# each layer, and the final norm and output head, adds its own such error to what reaches the
# logits (linearly, at worst), at the logits' scale L (the largest |logit| of the recorded plain
# sequences). So one logit moves by ~NOISE_PER_STAGE * (n_layer + 2) * eps32 * sqrt(n_embd) * L,
# and a margin, the difference of two logits, by up to twice that.
# Measured (bench/record_greedy.py --logits-out, --compare) between the default kernels
# (SkylakeX here), OPENBLAS_CORETYPE=Haswell and =Prescott, each at 1 and 2 threads: the largest
# change of any logit was 5.2e-4 on the tiny packs and 1.2e-2 on the test model, at most 13.7
# units of (n_layer + 2) * eps32 * sqrt(n_embd) * L (tiny llama, Prescott; 3.2 on the test model);
# the largest change of a recorded margin was 3.5e-4 and 4.1e-3, at most 8.2 units (tiny qwen3moe;
# 1.1 on the test model). 1 and 2 threads of the default kernels gave the same bits, and every
# configuration gave the recorded tokens. 2 * 24 units per stage leave a factor 6 over the worst
# margin change seen and 1.75 over two worst-case logits moving apart.
EPS32 = float(2.0 ** -23)
NOISE_PER_STAGE = 24.0


def margin_threshold(n_layer: int, n_embd: int, logit_absmax: float) -> float:
    return 2.0 * NOISE_PER_STAGE * (n_layer + 2) * EPS32 * math.sqrt(n_embd) * logit_absmax


# ------------------------------------------------------------------ packs
def pack_spec(case: Case):
    """The SynthSpec of a synthetic case: the same specs (and seed 0) as the session-wide packs
    of tests/support/engines.py (shared_tiny, shared_seed_moe), so the test reuses those."""
    from dataclasses import replace

    from strata.pack.presets import PRESETS, TINY

    if case.pack == "seed-moe":
        return replace(PRESETS["seed-moe"], vocab=VOCAB)
    return replace(TINY[case.pack.split(":", 1)[1]], vocab=VOCAB)


def case_arch(case: Case) -> str:
    return "llama" if case.pack == "model" else pack_spec(case).arch  # the test model is SmolLM2 (llama)


def build_pack(case: Case, root: Path) -> Path | None:
    """Write a synthetic case's pack under root (None for the test model)."""
    from strata.pack.synth import synth_pack

    if case.pack == "model":
        return None
    out = root / case.name
    mtp = out / "mtp" if case.pack == "seed-moe" else None
    synth_pack(pack_spec(case), out, mtp_dir=mtp, force=True, progress=lambda *a, **k: None)
    return out


def pack_digest(pack_dir: Path | None) -> str:
    """sha256 over a pack's .gguf files (relative name and bytes), or over the test model's file."""
    import hashlib

    from strata.defaults import default_model_path

    files = [default_model_path()] if pack_dir is None else sorted(pack_dir.rglob("*.gguf"))
    base = None if pack_dir is None else pack_dir
    h = hashlib.sha256()
    for f in files:
        h.update((f.name if base is None else str(f.relative_to(base))).encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------ running
def mode_names(case: Case) -> tuple[str, ...]:
    return PLAIN_MODES + (BATCHED_MODES if case.drafted else BATCHED_MODES[:1])


def pack_args(case: Case, pack_dir: Path | None) -> list[str]:
    if case.pack == "model":
        return []  # the default pack (the test model) and its shipped draft
    args = ["--pack", str(pack_dir)]
    if case.pack == "seed-moe":
        args += ["--mtp", str(pack_dir / "mtp")]
    return args


def _load(args: list[str], device: str):
    from strata.engine.core import EngineCore
    from strata.engine.options import parse_engine_args

    opts = parse_engine_args(args + ["--device", device, "--prefix-cache", "0"], serving=False)
    return EngineCore.load(opts, log=lambda line: None)


def _params(logprobs: bool):
    from strata.protocol import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=logprobs, top_logprobs=2 if logprobs else 0)


def _drain(handle, timeout: float = 300.0):
    from strata.protocol import FinishEvent

    events = []
    while True:
        ev = handle.events.get(timeout=timeout)
        if isinstance(ev, FinishEvent):
            if ev.reason == "error":
                raise RuntimeError(f"request failed: {ev.error}")
            return events
        events.append(ev)


def run_mode(core, mode: str, prompts) -> tuple[list[list[int]], list[list[float]] | None]:
    """(tokens per prompt, per-step top1-top2 logprob margins per prompt or None) of one mode."""
    from strata.protocol import GenerationRequest

    together = MODE_FLAGS[mode][1]
    logprobs = mode == "logprobs"
    params = _params(logprobs)
    results = []
    if together:
        handles = [core.submit(GenerationRequest(list(p), params)) for p in prompts]
        core.scheduler.run_until_idle()
        results = [_drain(h) for h in handles]
    else:
        for p in prompts:
            h = core.submit(GenerationRequest(list(p), params))
            core.scheduler.run_until_idle()
            results.append(_drain(h))
    tokens = [[ev.token_id for ev in evs] for evs in results]
    if not logprobs:
        return tokens, None
    margins = [[float(ev.top_logprobs[0].logprob - ev.top_logprobs[1].logprob) for ev in evs] for evs in results]
    return tokens, margins


def run_case(case: Case, prompts, pack_dir: Path | None, device: str, modes=None) -> dict:
    """{"tokens": {mode: tokens per prompt}, "margins": per prompt per step} of one case."""
    modes = modes or mode_names(case)
    out: dict = {"tokens": {}}
    cores: dict[str, object] = {}
    try:
        for mode in modes:
            flags = MODE_FLAGS[mode][0]
            key = " ".join(flags)
            if key not in cores:  # plain and logprobs share an engine (no prefix cache: no reuse)
                cores[key] = _load(pack_args(case, pack_dir) + flags, device)
            tokens, margins = run_mode(cores[key], mode, prompts)
            out["tokens"][mode] = tokens
            if margins is not None:
                out["margins"] = margins
    finally:
        for core in cores.values():
            close_engine(core)
    return out


def sequence_logits(core, prompt, tokens):
    """float64 logits (steps, vocab) that predicted each of `tokens` after `prompt`: the whole
    sequence run as one window on a fresh cache of the engine's model (its magnitude sets the
    margin threshold; across BLAS settings, their differences measure the arithmetic's noise)."""
    import numpy as np

    from strata.model.transformer import Span

    model = core.model
    seq = list(prompt) + list(tokens)
    cache = model.new_cache(max(16, len(seq)), "f16")
    hidden = model.forward(np.asarray(seq, dtype=np.int64), [Span(cache, 0, len(seq))])
    rows = np.asarray(model.b.to_host(model.logits(hidden)), dtype=np.float64)
    return rows[len(prompt) - 1: len(seq) - 1]


def load_engine_for(case: Case, pack_dir: Path | None, device: str, flags=("--parallel", "1")):
    return _load(pack_args(case, pack_dir) + list(flags), device)


def close_engine(core) -> None:
    core.stop()


def model_prompts() -> list[list[int]]:
    core = _load(["--parallel", "1"], "cpu")
    try:
        return [core.tokenizer.encode(core.chat.render([{"role": "user", "content": t}]), add_special=True)
                for t in MODEL_TEXTS]
    finally:
        close_engine(core)


# ------------------------------------------------------------------ comparing
@dataclass
class Comparison:
    compared: int  # steps compared, over prompts (the plain run's steps before its first near-tie)
    recorded: int  # steps recorded, over prompts
    mismatches: list[str]


def trusted_steps(margins: list[float], threshold: float) -> int:
    """Steps before the first whose top-1/top-2 margin is under the threshold: there the order
    of the two best tokens is within the arithmetic's noise, and everything after may diverge."""
    for i, m in enumerate(margins):
        if m < threshold:
            return i
    return len(margins)


def compare(recorded: dict, current: dict, threshold: float) -> Comparison:
    """Every mode's current tokens equal its recorded tokens and the current plain tokens, over
    each prompt's trusted steps (from the recorded plain run's margins)."""
    bad: list[str] = []
    compared = total = 0
    plain = current["tokens"]["plain"]
    for i, margins in enumerate(recorded["margins"]):
        n = trusted_steps(margins, threshold)
        total += len(recorded["tokens"]["plain"][i])
        compared += min(n, len(recorded["tokens"]["plain"][i]))
        for mode, rec in recorded["tokens"].items():
            now = current["tokens"][mode][i]
            if now[:n] != rec[i][:n]:
                bad.append(f"prompt {i} mode {mode}: recorded {rec[i][:n]} now {now[:n]} (first {n} steps)")
            if now[:n] != plain[i][:n]:
                bad.append(f"prompt {i} mode {mode}: {now[:n]} differs from plain {plain[i][:n]} (first {n} steps)")
    return Comparison(compared, total, bad)


