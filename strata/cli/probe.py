"""`strata probe [engine flags] [--json]`: the start-up capability probe, printed in full.

Opens the pack (and the MTP draft: --mtp FILE|DIR, else nextn tensors in the pack, else a shipped
draft made for the pack, with the --spec the engine would default to: strata.mtp.defaults.plan_mtp
decides for both), builds the
native kernel table for the chosen backend (--device; minus --no-native types) and shows, for
every tensor role x type, whether each path that uses it (decode / verify / draft) runs on a
native kernel, the generic dequantize+matmul path, or cannot run; then the batch-MTP decision
per slot, and for a hybrid model which slots keep a rollback copy of their recurrent state
(strata/engine/checkpoints.py: exact for --state-checkpoints N; for auto, estimated from the free
memory less the pack's weights, which the engine measures once they are loaded). Exit 0, or 2
when some tensor cannot run at all (the engine would refuse the pack).
"""

from __future__ import annotations

import argparse
import json
import math

from strata.backend.kernel_table import resolve_backend, table_for_backend
from strata.engine.checkpoints import CheckpointPlan, checkpoint_budget, plan_checkpoints
from strata.engine.options import EngineOptions, add_engine_arguments
from strata.gguf.row_source import HOST_ROW_TENSORS
from strata.host_memory import available_host_bytes
from strata.kernels.probe import run_probe, tensor_map


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, serving=False)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _free_device_bytes(backend: str) -> int | None:
    if backend != "cuda":
        return None
    try:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    except Exception:  # no device at all: the table already says cuda is not built
        return None


def _weights_estimate(pack, backend: str) -> int:
    """What the pack's weights take once loaded, roughly: the CPU backend dequantizes them to
    float32, the GPU keeps quantized blocks (about their size in the file). Tables read by rows
    on the host (the n-gram table) take neither."""
    loaded = [t for name, t in pack.tensors.items() if not name.startswith(HOST_ROW_TENSORS)]
    if backend == "cpu":
        return sum(4 * math.prod(t.shape) for t in loaded)
    return sum(int(t.nbytes) for t in loaded)


def checkpoint_plan(pack, opts: EngineOptions, backend: str) -> CheckpointPlan | None:
    """The engine's decision of rollback copies (EngineCore._plan_checkpoints), without loading:
    None for a model without a recurrent state."""
    from strata.model.archs import HYBRID_ARCHS

    if pack.metadata.get("general.architecture") not in HYBRID_ARCHS:
        return None
    from strata.model.recurrent_state import REPLAY_TOKENS, recurrent_shape
    from strata.model.recurrent_state import HybridCache

    cfg = pack.model_config()
    shape = recurrent_shape(cfg)
    replay = max(REPLAY_TOKENS, opts.spec + 1)
    # what a model adds beside the DeltaNet states (qwen4exp's n-gram conv history), as the engine counts it
    extra = {cp: cfg.hybrid.extra_state_bytes(cfg.n_embd, replay, cp) for cp in (False, True)}
    free = _free_device_bytes(backend) if backend == "cuda" else available_host_bytes()
    after_weights = None if free is None else free - _weights_estimate(pack, backend)
    one_copy = HybridCache.state_bytes(shape, replay, False) + extra[False]
    budget = checkpoint_budget(after_weights, backend, opts.parallel, one_copy)
    rollback = HybridCache.checkpoint_bytes(shape, replay) + extra[True] - extra[False]
    return plan_checkpoints(opts.state_checkpoints, opts.parallel, rollback, budget)


def open_model(opts: EngineOptions):
    """(pack, draft source or None, options with the MTP defaults, backend name) as the engine
    opens them: the backend is the one the engine takes for this pack's architecture."""
    from strata.engine.core import device_for_pack
    from strata.mtp.defaults import plan_mtp
    from strata.pack.loader import open_pack

    pack_arg = opts.pack
    if pack_arg is None and opts.native is None:
        from strata.defaults import default_model_path

        pack_arg = str(default_model_path())
    pack = open_pack(pack=pack_arg, native=opts.native, ple_gguf=opts.ple_gguf)
    try:
        backend = resolve_backend(device_for_pack(opts.device, pack, log=lambda line: None))
        plan = plan_mtp(opts, pack, backend)  # the engine core's own decision (strata.engine.core)
        return pack, plan.find_draft(pack), plan.opts, backend
    except BaseException:
        pack.close()
        raise


def run(args: argparse.Namespace) -> int:
    opts = EngineOptions.from_namespace(args)
    pack, draft, opts, backend = open_model(opts)
    table = table_for_backend(backend, opts.no_native_types())
    try:
        checkpoints = checkpoint_plan(pack, opts, backend)
        rep = run_probe(tensor_map(pack.tensors), tensor_map(draft.tensors) if draft else None, backend, table,
                        parallel=opts.parallel, spec=opts.spec, batch_mtp=opts.batch_mtp, free_bytes=_free_device_bytes(backend),
                        checkpoints=checkpoints.count if checkpoints else None)
    finally:
        pack.close()
    state_line = checkpoints.line() if checkpoints else None
    if args.json:
        out = rep.to_json()
        out["pack"] = pack.label
        out["draft"] = draft.label if draft else None
        out["unavailable"] = table.unavailable
        if checkpoints is not None:
            out["state_checkpoints"] = {"slots": checkpoints.count, "bytes_per_slot": checkpoints.per_slot,
                                        "budget_bytes": checkpoints.budget, "asked": checkpoints.asked}
            out["lines"] = [state_line, *out["lines"]] if state_line else out["lines"]
        print(json.dumps(out, indent=1))
    else:
        print(f"pack {pack.label}; draft: {draft.label if draft else 'none'}; backend {backend}; "
              f"{rep.parallel} slot(s), --spec {rep.spec}")
        for b, why in table.unavailable.items():
            print(f"{b}: {why}")
        print(rep.format_table())
        for note in rep.notes:
            print(f"note: {note}")
        lines = ([state_line] if state_line else []) + rep.startup_lines()
        if not rep.batch_mtp_requested:
            lines.append("strata probe: batch-MTP not requested (--batch-mtp)")
        for line in lines:
            print(line)
    return 0 if rep.can_run else 2
