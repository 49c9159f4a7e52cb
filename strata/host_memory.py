"""How much host memory a process could still take: the CPU backend's free memory, what `strata
probe` plans with, the n-gram table's RAM copy (strata/gguf/row_source.py).

Linux: MemAvailable, which counts the page cache the kernel gives back on demand (free pages,
SC_AVPHYS_PAGES, leave it out: a machine that has read a few GiB of files shows little "free"
memory with plenty to give). Windows: GlobalMemoryStatusEx's ullAvailPhys (the same notion).
Other POSIX systems: free pages. None where nothing says (the room checks are then skipped).
"""

from __future__ import annotations

import ctypes
import os
import sys


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _MemoryStatusEx(ctypes.Structure):
    _fields_ = [("dwLength", ctypes.c_uint32), ("dwMemoryLoad", ctypes.c_uint32),
                ("ullTotalPhys", ctypes.c_uint64), ("ullAvailPhys", ctypes.c_uint64),
                ("ullTotalPageFile", ctypes.c_uint64), ("ullAvailPageFile", ctypes.c_uint64),
                ("ullTotalVirtual", ctypes.c_uint64), ("ullAvailVirtual", ctypes.c_uint64),
                ("ullAvailExtendedVirtual", ctypes.c_uint64)]


def _windows_available() -> int | None:
    status = _MemoryStatusEx()
    status.dwLength = ctypes.sizeof(status)
    try:
        ok = ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None
    return int(status.ullAvailPhys) if ok else None


def _free_pages() -> int | None:
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def available_host_bytes() -> int | None:
    """Host memory available to a new allocation now, in bytes (None: unknown)."""
    if sys.platform == "win32":
        return _windows_available()
    found = _meminfo_available()
    return found if found is not None else _free_pages()
