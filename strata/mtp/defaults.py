"""The drafts shipped with Strata, and the MTP defaults of a pack one of them was made for.

A shipped draft (strata/mtp/data/*.gguf, made by `strata mtp train`, docs/MTP.md) records its
target's fingerprint (FINGERPRINT_KEY): a sha256 over the target's vocabulary and its tensor
names, types and shapes, all read from the GGUF header. A pack whose fingerprint matches is that
model whatever its path (the bundled SmolLM2-135M-Instruct Q4_1 by default, or the same file
given with --pack). For such a pack with no --mtp named, the engine uses the draft when --spec
K > 0, and by default on a backend where `DEFAULT_SPEC` says it measured faster (the GPU and,
with the draft's narrowed head, the CPU). `plan_mtp` decides this once for the engine core and
`strata probe` alike.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.gguf.reader import GGUFFile
from strata.mtp.draft import NEXTN, find_draft

DEFAULT_DRAFT_FILE = "smollm2-135m-instruct.mtp.gguf"
DATA_DIR = Path(__file__).parent / "data"
FINGERPRINT_KEY = "strata-mtp.target_fingerprint"  # "sha256:<hex>" of target_fingerprint()
FINGERPRINT_VERSION = b"strata target fingerprint v1\n"


def default_draft_path() -> Path | None:
    """Path of the shipped draft for the default model, or None if this build lacks it."""
    path = DATA_DIR / DEFAULT_DRAFT_FILE
    return path if path.is_file() else None


def target_fingerprint(pack: Any) -> str:
    """The fingerprint "sha256:<hex>" over a pack's vocabulary tokens (tokenizer.ggml.tokens) and each tensor's
    name, GGML type and shape, in name order: what a draft's weights depend on, from the header
    alone (no tensor data is read; ~10 ms for a 49k-token vocabulary). Another quantization of
    the same model is another fingerprint: its hidden states, which a draft reads, differ."""
    h = hashlib.sha256(FINGERPRINT_VERSION)
    tokens = pack.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, (list, tuple)):  # not a vocabulary (a broken pack: refused later, in one line)
        tokens = []
    h.update(struct.pack("<Q", len(tokens)))
    for tok in tokens:  # length-prefixed, so no token text can imitate a boundary
        raw = str(tok).encode("utf-8", "surrogateescape")
        h.update(struct.pack("<Q", len(raw)) + raw)
    for name in sorted(pack.tensors):
        t = pack.tensors[name]
        raw = name.encode("utf-8", "surrogateescape")
        h.update(struct.pack(f"<QQI{len(t.shape)}Q", len(raw), len(t.shape), t.ggml_type, *t.shape) + raw)
    return "sha256:" + h.hexdigest()


@functools.lru_cache(maxsize=None)
def _shipped_fingerprints(data_dir: Path) -> dict[str, Path]:
    """fingerprint -> shipped draft (read from each draft's header once per process)."""
    found: dict[str, Path] = {}
    for path in sorted(data_dir.glob("*.gguf")):
        with GGUFFile(path) as f:
            fp = f.metadata.get(FINGERPRINT_KEY)
        if isinstance(fp, str):
            found.setdefault(fp, path)
    return found


def shipped_draft_for(pack: Any, data_dir: Path = DATA_DIR) -> Path | None:
    """The shipped draft made for this pack (same fingerprint), or None."""
    drafts = _shipped_fingerprints(data_dir)
    return drafts.get(target_fingerprint(pack)) if drafts else None


# MTP for the default model on a backend only where it measures faster than plain decoding.
# GPU (H200, the shipped draft, bench/bench_mtp.py --device cuda, 128-token answers): --spec 1 at
# min-p 0 gives 1.31x plain decoding at one slot (--spec 2-3 within noise of it, and worse
# for batch-MTP at 4 slots: 1.0x vs 1.13x). CPU (2-core machine): 1.05-1.12x at
# --spec 1 when the machine is quiet, since the draft's head is narrowed to its vocabulary there
# (0.92-0.99x with the full head; a 2-row verification window still costs ~1.5 steps); loaded by
# other work (one BLAS thread) 0.94-1.05x, 0.98-1.02x in CPU time: no loss to turn it off for,
# and the gain where the machine is quiet. Without --batch-mtp MTP runs
# only while one slot is busy, so concurrent clients keep plain batching unless they ask for
# batch-MTP. Numbers and method: docs/MTP.md.
DEFAULT_SPEC: dict[str, tuple[int, float]] = {"cuda": (1, 0.0), "cpu": (1, 0.0)}


def default_spec(backend: str, given_flags: tuple[str, ...],
                 table: dict[str, tuple[int, float]] | None = None) -> tuple[int, float | None] | None:
    """(--spec, --spec-min-p) to run the default model with on this backend when the user named
    neither --spec nor --mtp, or None (leave MTP as asked). A --spec-min-p the user gave is kept
    (None in the pair). table: DEFAULT_SPEC unless given."""
    table = DEFAULT_SPEC if table is None else table
    if "--spec" in given_flags or "--mtp" in given_flags or backend not in table:
        return None
    spec, min_p = table[backend]
    return spec, (None if "--spec-min-p" in given_flags else min_p)


@dataclass
class MtpPlan:
    """What the engine does about MTP for a pack, decided before any draft is loaded."""

    opts: Any  # EngineOptions, with --spec / --spec-min-p set by DEFAULT_SPEC where it applies
    mtp: str | None  # the draft file to load: --mtp, else the shipped draft for this pack when --spec > 0
    auto: bool  # MTP turned on by DEFAULT_SPEC, not by the user (seeded sampled requests do not draft)
    shipped: Path | None  # the shipped draft made for this pack, if any

    def find_draft(self, pack: Any):
        """The DraftSource to use (strata.mtp.draft.find_draft), labelled (its messages too) as the
        shipped draft when it is one (not as an --mtp the user never gave)."""
        shipped = self.shipped is not None and self.opts.mtp is None
        return find_draft(self.mtp, pack, f"shipped draft {self.shipped.name}" if shipped else None)

    def note(self, backend: str) -> str | None:
        """The start-up line that says MTP is on by default, or None."""
        if not self.auto:
            return None
        o = self.opts
        return (f"strata mtp: on {backend}, MTP on with the shipped draft, except for sampled requests with a seed "
                f"(--spec {o.spec} --spec-min-p {o.spec_min_p}; --spec K drafts for those too, --spec 0 turns it "
                f"off): {self.shipped.name} was made for this pack (same vocabulary and tensors)")


def plan_mtp(opts: Any, pack: Any, backend: str, table: dict[str, tuple[int, float]] | None = None) -> MtpPlan:
    """The one decision of MTP defaults, for the engine core and `strata probe`: --mtp named wins;
    else nextn tensors in the pack (find_draft takes them, mtp None); else a shipped draft whose
    fingerprint matches the pack, loaded when --spec > 0 and turned on where DEFAULT_SPEC says."""
    if opts.mtp is not None or any(NEXTN.match(name) for name in pack.tensors):
        return MtpPlan(opts, opts.mtp, False, None)
    if opts.spec == 0 and "--spec" in opts.given_flags:  # MTP off by name: no fingerprint needed
        return MtpPlan(opts, None, False, None)
    shipped = shipped_draft_for(pack)
    if shipped is None:
        return MtpPlan(opts, None, False, None)
    auto = default_spec(backend, opts.given_flags, table)
    if auto is not None:
        spec, min_p = auto
        opts = dataclasses.replace(opts, spec=spec, spec_min_p=opts.spec_min_p if min_p is None else min_p)
    return MtpPlan(opts, str(shipped) if opts.spec > 0 else None, auto is not None, shipped)
