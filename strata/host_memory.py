"""How much memory the host can give this process now (the CPU backend's free memory, what
`strata probe` plans with, the n-gram table's RAM copy)."""

from __future__ import annotations

import os


def available_host_bytes() -> int | None:
    """Memory the host can give this process now; None where it cannot be told."""
    try:  # Linux: MemAvailable counts the page cache the kernel gives back on demand
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if os.name == "nt":
        import ctypes

        class _Status(ctypes.Structure):  # MEMORYSTATUSEX
            _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong)] + \
                       [(n, ctypes.c_ulonglong) for n in ("total", "avail", "page_total", "page_avail",
                                                          "virtual_total", "virtual_avail", "extended")]

        s = _Status()
        s.length = ctypes.sizeof(_Status)
        return int(s.avail) if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(s)) else None
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None
