"""An exclusive lock on a file, held across processes (two `strata` commands fetching the same
model at once: the second waits, then finds the file there)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
    import msvcrt


@contextlib.contextmanager
def file_lock(path: Path, on_wait: Callable[[], None] = lambda: None) -> Iterator[None]:
    with open(path, "a+b") as f:
        if fcntl is not None:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                on_wait()
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        else:
            waited = False
            while True:
                try:
                    f.seek(0)
                    msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
                    break
                except OSError:
                    if not waited:
                        on_wait()
                        waited = True
                    time.sleep(0.5)
        yield  # closing the file releases the lock
