"""The engine core: loads a pack, builds the model, probes capabilities, runs the scheduler.

Front ends (the HTTP API, `strata generate`) talk to it through strata.protocol.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
import time
from typing import Any, Callable

import numpy as np

from strata.backend.select import device_for_model, make_backend
from strata.batch.scheduler import Scheduler, SchedulerConfig, fused_drafts_default
from strata.engine.checkpoints import CheckpointPlan, checkpoint_budget, plan_checkpoints
from strata.engine.context_room import check_one_slot_fits, past_training_warning
from strata.engine.expert_room import auto_room
from strata.engine.options import EngineOptions
from strata.protocol import GenerationRequest, RequestHandle
from strata.errors import OutOfMemory, StrataError
from strata.experts.budget import CachePlan, expert_tensors, plan_cache
from strata.experts.profile import read_profile, write_profile
from strata.gguf.row_source import HostTables
from strata.sampling.logit_adjust import bans_everything
from strata.model.archs import ARCHS
from strata.model.build import build_model
from strata.model.config import ModelConfig
from strata.mtp.draft import DraftModel
from strata.mtp.proposer import DraftProposer
from strata.pack.weight_check import check_weights

MiB = 1024 * 1024


def log_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ContextOverflow(StrataError):
    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(
            f"the prompt has {n_prompt_tokens} tokens but the context holds {n_ctx} "
            f"(at least one more is needed to generate)"
        )
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


def _progress(log: Callable[[str], None], what: str) -> Callable[[int, int], None]:
    """Progress for long loads: a live bar on a terminal, one line at the end otherwise."""
    tty = sys.stderr.isatty()
    t0 = time.perf_counter()

    def report(done: int, total: int) -> None:
        if tty:
            bar = "#" * (30 * done // total)
            print(f"\r{what} [{bar:<30}] {done}/{total}", end="", file=sys.stderr, flush=True)
            if done == total:
                print(file=sys.stderr)
        if done == total:
            log(f"strata: {what}: {total}/{total} done in {time.perf_counter() - t0:.1f} s")

    return report


def _check_room(backend: Any, tensors, what: str, plan: CachePlan | None = None, hint: str = "") -> None:
    """Refuse, before loading anything, a pack whose weights cannot fit what the device has free
    (a lower bound of theirs against free memory: never a false refusal). With an expert cache
    `plan`, its tensors count as the pool's slots (their blocks stay where the backend's pool
    reads them: no memory of their own on the device)."""
    tensors, pool = list(tensors), plan.pool_bytes if plan is not None else 0
    need = backend.weight_bytes(tensors, mapped=plan.tensors) if plan is not None else backend.weight_bytes(tensors)
    free = backend.free_bytes()
    if need is not None and free is not None and need + pool > free:
        raise OutOfMemory(f"{what} does not fit on {backend.name}: its weights take at least "
                          f"{(need + pool) / MiB:.0f} MiB there, {free / MiB:.0f} MiB is free "
                          f"({_room_hint(backend)}{hint})")


def _room_hint(backend: Any) -> str:
    return "a smaller pack" if backend.name == "cpu" else "a smaller pack, or --device cpu"


def device_for_pack(device: str, pack: Any, log: Callable[[str], None]) -> str:
    """--device for this pack's architecture (ArchSpec.devices: the backends it runs on)."""
    arch = pack.metadata.get("general.architecture")
    spec = ARCHS.get(arch) if isinstance(arch, str) else None
    return device if spec is None else device_for_model(device, arch, spec.devices, log)


@contextlib.contextmanager
def _load_errors(backend: Any, what: str):
    """Running out of memory while making `what` (a pack's weights, a draft's, the slots' KV
    caches) is the user's line, not a traceback."""
    try:
        yield
    except OutOfMemory as e:
        raise OutOfMemory(f"{what}: {e.message} ({_room_hint(backend)})") from None
    except Exception as e:
        if not backend.is_out_of_memory(e):
            raise
        backend.release_cached_memory()
        raise OutOfMemory(f"{what}: out of memory on {backend.name} "
                          f"({type(e).__name__}: {e}; {_room_hint(backend)})") from None


SEED_LIMIT = 2**64  # seeds are 64-bit unsigned (numpy's SeedSequence refuses negatives)


def check_request(req: GenerationRequest, vocab: int) -> None:
    """Refuse, with the field named, what would otherwise fail inside a window: a seed outside
    [0, 2**64), a prompt token id outside the vocabulary (vocab 0: not known, not checked)."""
    seed = req.params.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or not 0 <= seed < SEED_LIMIT):
        raise StrataError(f"seed must be a whole number in [0, 2**64), not {seed!r}")
    ids = req.prompt_ids
    if vocab > 0 and (min(ids) < 0 or max(ids) >= vocab):  # (min/max: one pass in C, not a Python loop)
        at, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
        raise StrataError(f"prompt token id {bad} at position {at} is outside the vocabulary [0, {vocab})")
    p = req.params
    bad_bias = [t for t in p.logit_bias if vocab > 0 and not 0 <= t < vocab]
    if bad_bias:
        raise StrataError(f"logit_bias: token id {bad_bias[0]} is outside the vocabulary [0, {vocab})")
    nothing_left = bans_everything(p.logit_bias, vocab)
    if nothing_left:
        raise StrataError(nothing_left)
    if not p.repetition_penalty > 0:
        raise StrataError(f"repetition_penalty must be > 0, not {p.repetition_penalty!r}")
    if p.min_tokens < 0 or p.repeat_last_n < -1:
        raise StrataError("min_tokens must be >= 0 and repeat_last_n >= -1")


def resolve_options(opts: EngineOptions, pack: Any, backend_name: str, log: Callable[[str], None]) -> Any:
    """The options as the engine runs them: the MTP defaults (the draft to load and --spec)
    decided as `strata probe` decides them, for a pack a shipped draft was made for (found by its
    fingerprint whatever its path), said once. -> strata.mtp.defaults.MtpPlan (its .opts)."""
    from strata.mtp.defaults import plan_mtp

    plan = plan_mtp(opts, pack, backend_name)
    note = plan.note(backend_name)
    if note is not None:
        log(note)
    return plan


class EngineCore:
    """A loaded engine: the model (and its draft), the tokenizer and the running scheduler.

    Made by `EngineCore.load` in the order of the work: the options resolved against the pack
    (`resolve_options`), then `_read_pack`, `_load_model`, `_load_draft`, `_plan_slots` and
    `_build_scheduler`. Every attribute exists once load returns, whatever path it took."""

    def __init__(self, opts: EngineOptions, log: Callable[[str], None], backend: Any, pack: Any,
                 pack_arg: str | None) -> None:  # use EngineCore.load
        self.opts = opts
        self.log = log
        self.backend = backend
        self.pack = pack
        self.pack_arg = pack_arg  # how the pack was named (the model's name when the pack has none)
        self.parallel = opts.parallel
        # set by _read_pack and _load_model
        self.cfg: ModelConfig
        self.tokenizer: Any
        self.chat: Any
        self.model: Any
        self.n_ctx = 0
        self.model_name = ""
        # set by _load_draft and _plan_slots; these stay where the model has no draft or state
        self.draft: DraftModel | None = None
        self.draft_state_bytes = 0  # one slot's draft KV and buffers at full context
        self.checkpoints: CheckpointPlan | None = None
        self._expert_layers: set[str] = set()  # the main model's expert layers (set by _plan_experts)
        # set by _build_scheduler
        self.probe_report: Any = None
        self.scheduler: Scheduler

    def _plan_checkpoints(self, opts: EngineOptions) -> CheckpointPlan | None:
        """A hybrid model's slots that keep a rollback copy of their recurrent state: the first
        --state-checkpoints N, or as many as the memory left after the weights and the draft
        holds (strata/engine/checkpoints.py). None for a model without a recurrent state."""
        if self.cfg.hybrid is None:
            return None
        model = self.model
        # verification windows of 1 + --spec tokens can be cut back inside: their replay rows
        model.replay_tokens = max(model.replay_tokens, opts.spec + 1)
        budget = checkpoint_budget(self.backend.free_bytes(), self.backend.name, opts.parallel,
                                   model.state_bytes(checkpoint=False))
        return plan_checkpoints(opts.state_checkpoints, opts.parallel, model.checkpoint_bytes(), budget)

    def _recurrent_state_lines(self, log: Callable[[str], None]) -> None:
        """A hybrid model's sequences each keep a recurrent state (two copies and the inputs that
        replay accepted drafts with a checkpoint, one copy without): said once, before the caches
        exist, with one more line naming the slots without a checkpoint."""
        model, plan = self.model, self.checkpoints
        h = self.cfg.hybrid
        kinds = [(plan.count, model.state_bytes(), "two copies of the state + replay inputs for windows of up "
                                                   f"to {model.replay_tokens} tokens"),
                 (plan.parallel - plan.count, model.state_bytes(checkpoint=False), "one copy: no rollback")]
        sizes = ", ".join(f"{n_bytes / MiB:.1f} MiB per slot x {n} ({what})" for n, n_bytes, what in kinds if n)
        # a pack of an earlier converter (one fused ssm_in per layer) is told apart in the line
        fused = sum(layer.mixer.input_form == "fused" for layer in model.recurrent_layers)
        form = f" (input projection from the fused ssm_in in {fused})" if fused else ""
        log(f"strata: recurrent state: {h.n_recurrent} Gated DeltaNet layers{form}, {sizes}; "
            f"{model.n_attention} attention layers keep a KV cache")
        pieces = model.state_line(checkpoint=plan.count > 0)
        if pieces is not None:
            log(f"strata: sequence state: {pieces}")
        lacking = plan.line()
        if lacking is not None:
            log(lacking)

    @classmethod
    def load(cls, opts: EngineOptions, log: Callable[[str], None] = log_stderr) -> "EngineCore":
        from strata.defaults import default_model_path
        from strata.pack.loader import open_pack

        for w in opts.warnings():
            log(w)
        pack_arg = opts.pack
        if pack_arg is None and opts.native is None:
            pack_arg = str(default_model_path())
        pack = open_pack(pack=pack_arg, native=opts.native, ple_gguf=opts.ple_gguf)
        try:
            device = device_for_pack(opts.device, pack, log)
            backend = make_backend(device, no_native=opts.no_native_types(), threads=opts.threads, log=log)
        except BaseException:
            pack.close()
            raise
        plan = resolve_options(opts, pack, backend.name, log)
        self = cls(plan.opts, log, backend, pack, pack_arg)
        self._read_pack()
        src = plan.find_draft(pack)  # (before the weights: a draft file it refuses costs no load)
        self._plan_experts(src)  # (refuses a pack whose weights do not fit, the pool counted)
        self._load_model()
        src = self._load_draft(src)
        self._plan_slots(src)
        self._build_scheduler(src, plain_for_seeded=plan.auto)
        return self

    def _read_pack(self) -> None:
        """The pack's config, weights check, tokenizer and chat template."""
        from strata.text.chat_template import ChatTemplate
        from strata.text.tokenizer import Tokenizer

        pack, md = self.pack, self.pack.metadata
        self.cfg = cfg = pack.model_config()  # the metadata key table and every tensor shape, checked once
        check_weights(pack)  # NaN / Inf in float weights and block scales (sampled: strata/pack/weight_check.py)
        self.log(f"strata: pack {pack.label}: {cfg.arch}, {cfg.n_layer} layers, "
                 f"{len(pack.tensors)} tensors, {pack.total_bytes / MiB:.1f} MiB")
        self.tokenizer = Tokenizer.from_metadata(md)
        self.chat = ChatTemplate.from_metadata(md)

    def _plan_experts(self, src: Any) -> None:
        """The expert cache, before any expert loads: the main model's expert tensors (a draft's
        stay resident) as pools of slots for --expert-cache (auto: strata/engine/expert_room.py),
        seeded by --expert-profile; said in one line where a pool is built. The pack is refused
        here when its weights, the pool counted, cannot fit. The profile is read (and held to the
        model) only where a pool is built."""
        opts, backend, log, pack = self.opts, self.backend, self.log, self.pack
        if opts.expert_profile_out:
            atexit.register(self.write_expert_profile, opts.expert_profile_out)
        draft = set(src.tensors) if src is not None else set()
        main = [t for n, t in pack.tensors.items() if n not in draft]
        tensors = expert_tensors(main, backend.expert_bytes)
        self._expert_layers = {t.group for t in tensors}
        request = opts.expert_cache_request()
        room = None
        # what loads: the main stack, and the draft's tensors when MTP is on (a pack's nextn layer
        # with --spec 0 stays in the file). auto leaves the draft room; the refusal counts the main
        # stack alone, since a draft that does not fit only turns MTP off (_load_draft)
        loads = main + (list(src.tensors.values()) if src is not None and opts.spec > 0 else [])
        if request.kind == "auto" and backend.expert_pool is not None and tensors:
            n_ctx = min(opts.max_context or self.cfg.n_ctx_train, 1 << 30)
            room = auto_room(backend, self.cfg, opts, n_ctx, loads, draft=len(loads) > len(main),
                             pooled={t.name for t in tensors})
        plan = plan_cache(tensors, request, auto_bytes=room.budget if room is not None else None)
        if plan is not None and backend.expert_pool is None:
            log(f"strata: warning: --expert-cache {opts.expert_cache}: the {backend.name} backend has no expert pool "
                f"yet; every expert loads resident")
            plan = None
        pool_would_help = tensors and backend.expert_pool is not None and plan is None and request.kind != "auto"
        hint = ", or --expert-cache auto" if pool_would_help else ""
        _check_room(backend, main, f"pack {pack.label}", plan, hint)
        rates = self._expert_rates(tensors, plan)
        if plan is None:
            return
        backend.configure_experts(plan, opts.expert_policy, {}, rates)
        tier = backend.expert_pool
        log(plan.line(tier.slots, tier.blocks, room.words() if room is not None else ""))

    def _expert_rates(self, tensors: list, plan: CachePlan | None) -> Callable[[str], Any]:
        """--expert-profile read and held to the model whether or not a pool is built (so a config
        behaves alike on every machine): its rates(layer), or none. A profile only steers which
        experts a pool starts with, so one that cannot be read, or is another model's, is a
        warning and the pool starts empty, never a refusal."""
        path, log = self.opts.expert_profile, self.log
        none: Callable[[str], Any] = lambda name: None  # noqa: E731
        if not path or not tensors:
            return none
        try:
            profile = read_profile(path)
            profile.check_model(path, {t.group: t.n_expert for t in tensors})
        except StrataError as e:
            log(f"strata: warning: {e.message}; --expert-profile is not used")
            return none
        if plan is None:
            log(f"strata: experts: every expert is resident; --expert-profile {path} steers nothing")
        return profile.rates

    def write_expert_profile(self, path: str) -> bool:
        """The routing counts seen since load, as an --expert-profile file (False where the backend
        does not count its routing, or nothing was routed yet: a profile of nothing steers nothing,
        and the file is left as it was)."""
        seen = self.backend.expert_counts()
        if seen is None:
            return False
        counts, tokens = seen
        main = {k: v for k, v in counts.items() if k in self._expert_layers} or counts
        if not main:
            return False
        write_profile(path, max(tokens[k] for k in main), main)
        return True

    def _load_model(self) -> None:
        """The main model's weights on the device; the context size and the model's name."""
        backend, cfg, opts, log, pack = self.backend, self.cfg, self.opts, self.log, self.pack
        line = backend.start_line()  # the CPU's: its BLAS thread count and why
        if line is not None:  # (once the pack and the draft are accepted: a refusal stays one line)
            log(line)
        get = lambda name: pack.tensors.get(name)  # noqa: E731
        tables = HostTables(opts.ple_io, say=log)  # the n-gram table's rows, read as --ple-io says
        with _load_errors(backend, f"pack {pack.label}"):
            self.model = build_model(backend, cfg, get,
                                     progress=_progress(log, f"loading {cfg.n_layer} layers on {backend.name}"),
                                     tables=tables)
        for line in tables.lines():
            log(line)
        if not tables.opened and "--ple-io" in opts.given_flags:
            log(f"strata: warning: --ple-io {opts.ple_io} has no effect: pack {pack.label} has no n-gram table")
        self.n_ctx = min(opts.max_context or cfg.n_ctx_train, 1 << 30)
        warning = past_training_warning(opts.max_context, cfg.n_ctx_train, cfg.arch, pack.metadata)
        if warning is not None:
            log(warning)
        self.model_name = opts.alias or str(pack.metadata.get("general.name") or self.pack_arg)

    def _load_draft(self, src: Any) -> Any:
        """The MTP draft's weights when --spec asks for one and a source was found. Out of memory
        is not a refusal: the model serves without it (MTP off, said once). -> the draft's
        source, None when no draft runs."""
        backend, log = self.backend, self.log
        if self.opts.spec > 0 and src is None:
            log("strata mtp: --spec given but no draft (no --mtp, no nextn tensors in the pack, and no shipped "
                "draft made for it); MTP is off")
        if src is None:
            return None
        if self.opts.spec <= 0:
            log(f"strata mtp: draft found ({src.label}) but --spec is 0; MTP is off")
            return src
        mark, missed = backend.upload_mark(), None
        try:
            with _load_errors(backend, f"draft {src.label}"):
                self.draft = DraftModel(backend, self.cfg, src, self.model)
        except OutOfMemory as e:
            missed = e.message
        if missed is not None:  # (out of the except clause: its traceback held the partial draft)
            backend.drop_uploads_since(mark)
            gc.collect()  # the exceptions' frames form cycles that still hold its arrays
            backend.release_cached_memory()
            log(f"strata mtp: {missed}; MTP is off")
            return None
        return src

    def _plan_slots(self, src: Any) -> None:
        """The slots' rollback copies (after the weights and the draft: what is left) and the
        draft's state per slot, said once."""
        opts, log = self.opts, self.log
        self.checkpoints = self._plan_checkpoints(opts)
        if self.draft is not None:
            self.draft_state_bytes = self.draft.state_bytes(self.n_ctx, opts.kv)
            for i in range(opts.parallel):
                if self.checkpoints is None or self.checkpoints.has(i):  # (the others never draft)
                    log(f"strata mtp: slot {i}: shared draft weights ({src.nbytes / MiB:.1f} MiB, {src.label}), "
                        f"{self.draft_state_bytes / MiB:.1f} MiB of private state and buffers at full context")
        if self.checkpoints is not None:
            self._recurrent_state_lines(log)

    def _build_scheduler(self, src: Any, plain_for_seeded: bool) -> None:
        """The probe's per-slot verdicts, the proposer, and the scheduler with its slots' caches."""
        opts, log, draft, backend = self.opts, self.log, self.draft, self.backend
        slot_caps = self._probe(self.pack, src, log)
        if draft is not None and opts.batch_mtp and any(on for on, _ in slot_caps):
            log(f"strata verify: batch windows of up to {opts.parallel} sequences (layers [0, {self.cfg.n_layer}))")
        proposer = None
        if draft is not None:
            proposer = DraftProposer(draft, max_ctx=self.n_ctx, kv_kind=opts.kv, chunk=opts.prefill_chunk(),
                                     min_p=opts.spec_min_p)
        fused = fused_drafts_default(backend) and self.model.graphable
        if draft is not None and opts.spec == 1 and fused:
            log("strata mtp: fused drafting on (a greedy verification window drafts the next one; "
                "STRATA_MTP_FUSED=0 turns it off)")
        with _load_errors(backend, f"the KV caches of {opts.parallel} slot(s)"):
            self.scheduler = Scheduler(
                self.model, self.tokenizer,
                SchedulerConfig(parallel=opts.parallel, max_ctx=self.n_ctx, kv_kind=opts.kv,
                                prefill_chunk=opts.prefill_chunk(), spec=opts.spec if draft else 0,
                                spec_min_p=opts.spec_min_p, batch_mtp=opts.batch_mtp,
                                fused_drafts=fused, plain_for_seeded=plain_for_seeded,
                                prefix_cache_bytes=opts.prefix_cache << 20),
                proposer=proposer, slot_batch_mtp=slot_caps,
                slot_checkpoints=self.checkpoints.flags() if self.checkpoints else None, log=log)
        check_one_slot_fits(opts.max_context, self.n_ctx, self.scheduler.slots[0].cache.bytes_per_position,
                            backend.free_bytes(), backend.name, opts.kv)
        self._say_kv_room(log)

    def _say_kv_room(self, log: Callable[[str], None]) -> None:
        """Said at start-up when every slot at full context would not fit the free memory: the KV
        caches grow as requests need them, and one that finds no room ends that request alone
        (out_of_memory), so this is a sizing note, not a refusal."""
        per = self.scheduler.slots[0].cache.bytes_per_position
        full = self.parallel * self.n_ctx * per
        free = self.backend.free_bytes()
        if free is None or full <= free:
            return
        GiB = 1024 * MiB
        log(f"strata: the KV caches at full context would take {full / GiB:.1f} GiB ({self.parallel} slot(s) x "
            f"{self.n_ctx} tokens, --kv {self.opts.kv}), {free / GiB:.1f} GiB is free: with every slot busy, a request "
            f"past about {free // (self.parallel * per)} tokens may end with out_of_memory (503)")

    def _probe(self, pack: Any, src: Any, log: Callable[[str], None]) -> list[tuple[bool, str | None]]:
        """Per slot: may it verify its own proposal inside a batched window? (the probe decides)"""
        from strata.backend.kernel_table import table_for_backend
        from strata.kernels.probe import run_probe

        table = table_for_backend(self.backend.name, self.opts.no_native_types())
        tensors = {n: (t.ggml_type, tuple(t.shape)) for n, t in pack.tensors.items()
                   if src is None or n not in src.tensors}
        draft_tensors = {n: (t.ggml_type, tuple(t.shape)) for n, t in src.tensors.items()} if src else None
        report = run_probe(tensors, draft_tensors, self.backend.name, table, parallel=self.opts.parallel,
                           spec=self.opts.spec, batch_mtp=self.opts.batch_mtp, n_gpus=1, mtp_state_bytes_per_slot=self.draft_state_bytes,
                           free_bytes=self.backend.free_bytes(),
                           checkpoints=self.checkpoints.count if self.checkpoints else None)
        self.probe_report = report
        if not report.can_run:
            raise StrataError("; ".join(report.startup_lines()) or "the pack cannot run on this backend")
        for line in report.startup_lines():
            log(line)
        return [(sc.batch_mtp, report.fallback_reason_code(sc.slot)) for sc in report.slots]

    # ---- the front-end API ---------------------------------------------------------------------
    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def submit(self, req: GenerationRequest) -> RequestHandle:
        n = len(req.prompt_ids)
        if n == 0:
            raise StrataError("the prompt is empty")
        if n + 1 > self.n_ctx:
            raise ContextOverflow(n, self.n_ctx)
        check_request(req, self.cfg.vocab_size)
        return self.scheduler.submit(req)

    def liveness(self) -> tuple[bool, str | None]:
        """(alive, why not): False when the scheduler's thread is gone or a window has run past
        --watchdog-s (the served engine's /health then answers 503 "unhealthy")."""
        return self.scheduler.liveness(self.opts.watchdog_s)

    def queue_depth(self) -> int:
        return self.scheduler.queue_depth()

    def slots_busy(self) -> int:
        return self.scheduler.slots_busy()

    def slots_info(self) -> list[dict]:
        """Each slot as /slots shows it: busy or not, the request it serves, how far it got, its
        MTP counters (read from the engine's thread without a lock: a snapshot, maybe a window old)."""
        out, experts = [], self.expert_cache()
        for s in self.scheduler.slots:
            h = s.handle
            out.append({"id": s.index, "is_processing": h is not None, "request_id": h.request.request_id if h else None,
                        "n_prompt_tokens": len(s.prompt), "n_decoded": s.n_generated,
                        "n_cached_prompt_tokens": s.cached,
                        "mtp": {"windows": s.counters.windows, "drafted": s.counters.drafted,
                                "accepted": s.counters.accepted},
                        "expert_cache": experts})
        return out

    def expert_cache(self) -> dict | None:
        """The expert cache's counters (the engine's, shared by every slot: a window's tokens share
        its uploads), or None without a pool."""
        return self.backend.expert_cache_stats()

    def metrics(self) -> dict:
        sch = self.scheduler
        return {
            "slots": [
                {"slot": s.index, "busy": s.busy, "batch_mtp": s.batch_mtp, "batch_mtp_reason": s.batch_mtp_reason,
                 "mtp_failed": s.mtp_failed, "mtp_windows": s.counters.windows, "mtp_drafted": s.counters.drafted,
                 "mtp_accepted": s.counters.accepted, "mtp_accepted_per_pos": list(s.counters.accepted_per_pos),
                 "mtp_drafted_per_pos": list(s.counters.drafted_per_pos)}
                for s in sch.slots
            ],
            "batch_mtp_fallbacks": dict(sch.fallbacks),
            "prompt_tokens_cached": sch.cached_tokens,
            "prefix_cache": sch.prefix.stats(),
            "windows": sch.windows,
            "finished": dict(sch.finished),
            "queue_depth": sch.queue_depth(),
            "slots_busy": sch.slots_busy(),
            "expert_cache": self.expert_cache(),
        }
