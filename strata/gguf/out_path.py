"""Where a command writes its output, checked before any work: a typo in --out is one line
naming the flag at once, not a traceback after an hour of training or half a pack on disk."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from strata.errors import StrataError
from strata.units import size_text

# left free beside what is written: a disk filled to its last byte breaks everything else on it
DISK_RESERVE = 256 << 20


def out_file(path: str | Path, flag: str) -> Path:
    """A file to be (re)written: not a folder or a device, in a folder that exists (made if
    needed) and takes new files."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise StrataError(f"{flag} {path}: {e.strerror}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise StrataError(f"{flag} {path}: is a folder; give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        raise StrataError(f"{flag} {path}: not a regular file (a device, FIFO or socket); give a file name")
    out_dir(p.parent, flag, shown=str(path))
    return p


def out_dir(path: str | Path, flag: str, shown: str | None = None) -> Path:
    """A folder to write into: made if missing, and a file can be created in it."""
    d = Path(path)
    shown = shown or str(path)
    if d.exists() and not d.is_dir():
        raise StrataError(f"{flag} {shown}: {d} exists and is not a folder")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StrataError(f"{flag} {shown}: cannot create the folder {d}: {e.strerror}") from None
    try:
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        raise StrataError(f"{flag} {shown}: cannot write in {d}: {e.strerror}") from None
    return d


def check_room(flag: str, folder: str | Path, nbytes: int) -> None:
    """Refuse before writing nbytes into folder when its disk has not that much free."""
    free = shutil.disk_usage(folder).free
    if nbytes > free - DISK_RESERVE:
        raise StrataError(f"{flag} {folder}: the output would take {size_text(nbytes)} and its disk has {size_text(free)} "
                          f"free, {size_text(DISK_RESERVE)} of which is kept free; make room or write it elsewhere")


