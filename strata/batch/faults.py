"""Fault injection for the tests: STRATA_FAULT_INJECT="point@slot,point@slot,...".

Each point fires where the scheduler reaches it for that slot, so the failure paths run for real
(the same code a real failure takes). Unset, every check is one test of an empty set.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterable

from strata.errors import StrataError

FAULT_ENV = "STRATA_FAULT_INJECT"

# point -> (what it does, where it fires)
POINTS: dict[str, tuple[str, str]] = {
    "mtp-admit": ("raise", "the slot's MTP admission"),
    "mtp-draft": ("raise", "the slot's MTP drafting"),
    "mtp-fused": ("raise", "a fused window's drafting (strata/mtp/fused_window.py)"),
    "kv-grow": ("out-of-memory", "the growth of the slot's KV cache before a window"),
    "gpu-trap": ("device", "the window: the device traps for real (a sticky CUDA error)"),
    "admit-raise": ("raise", "admission: starting a request in the slot"),
    "plan-raise": ("raise", "planning a window the slot is busy in (outside any request's part of it)"),
    "window-raise": ("raise", "the window's forward, after the caches advanced, when the slot is in it"),
    "hang": ("block", "the window's forward when the slot is in it, until release() (the watchdog's case)"),
}

_RAISES = {"raise": RuntimeError, "out-of-memory": MemoryError}


class FaultInjector:
    """The points of a spec (default: $STRATA_FAULT_INJECT); see POINTS."""

    def __init__(self, spec: str | None = None):
        spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
        self.points: set[tuple[str, int]] = set()
        self._released = threading.Event()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            where, _, slot = part.partition("@")
            if where not in POINTS or not slot.isdigit():
                # a misspelt point would make a fault test pass without any fault
                raise StrataError(f"{FAULT_ENV}: {part!r} is not POINT@SLOT with POINT one of {', '.join(POINTS)}")
            self.points.add((where, int(slot)))

    def check(self, where: str, slot: int, backend: Any = None) -> None:
        if not self.points or (where, slot) not in self.points:
            return
        what = POINTS[where][0]
        if what == "device":
            backend.inject_fault(where)
        elif what == "block":
            self._released.wait()
        else:
            raise _RAISES[what](f"injected fault at {where} for slot {slot}")

    def check_slots(self, where: str, slots: Iterable[int], backend: Any = None) -> None:
        """check() for every slot of a window."""
        if self.points:
            for slot in slots:
                self.check(where, slot, backend)

    def release(self) -> None:
        """Let blocked windows go on; blocking points pass from now on (tests end a hang)."""
        self._released.set()
