"""Where fetched models live: the user's cache folder, or $STRATA_CACHE_DIR."""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from pathlib import Path
from typing import Mapping

from strata.errors import StrataError

ENV_CACHE_DIR = "STRATA_CACHE_DIR"
DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def cache_dir(env: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """$STRATA_CACHE_DIR; else %LOCALAPPDATA%\\strata on Windows, $XDG_CACHE_HOME/strata or
    ~/.cache/strata elsewhere (a relative XDG_CACHE_HOME is ignored, as the XDG spec says)."""
    env = os.environ if env is None else env
    override = env.get(ENV_CACHE_DIR)
    if override:
        return Path(override).expanduser()
    if (platform or sys.platform) == "win32":
        base = env.get("LOCALAPPDATA")
        return (Path(base) if base else Path.home() / "AppData" / "Local") / "strata"
    xdg = env.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "strata"
    return Path.home() / ".cache" / "strata"


def models_dir(root: Path | None = None) -> Path:
    return (cache_dir() if root is None else root) / "models"


def downloads_dir(root: Path | None = None) -> Path:
    return (cache_dir() if root is None else root) / "downloads"


def os_reason(e: BaseException) -> str:
    """The OS's words for an error ("Connection refused", "No space left on device")."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def writable_dir(path: Path) -> Path:
    """Create `path` (and its parents) and check that a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        if e.errno in DISK_FULL:
            raise disk_full(path) from None
        raise StrataError(f"the cache folder {path} is not writable: {os_reason(e)} "
                          f"(set {ENV_CACHE_DIR} to a folder you can write)") from None
    return path


def disk_full(path: Path, need: int | None = None) -> StrataError:
    room = f" (the model needs about {need / 2**20:.0f} MiB)" if need else ""
    return StrataError(f"no space left on the device writing {path}{room}; free some space or set "
                       f"{ENV_CACHE_DIR} to another disk")
