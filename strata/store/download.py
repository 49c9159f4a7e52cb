"""Fetch a URL into a `.part` file, resuming what is already there with an HTTP Range request,
then check the file's sha256 (a mismatch deletes it)."""

from __future__ import annotations

import hashlib
import http.client
from pathlib import Path
from urllib.parse import urlsplit

from strata.errors import StrataError
from strata.store.net import HTTPStatus, open_url, url_reason
from strata.store.paths import DISK_FULL, disk_full, os_reason
from strata.store.progress import MiB, Progress

CHUNK = 1 << 20
RESUMES = 5  # a connection cut mid-body is resumed this many times in one call before giving up


class _Cut(Exception):
    """The body stopped before its end (the connection broke or timed out)."""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _write_error(e: OSError, path: Path, need: int | None) -> StrataError:
    if e.errno in DISK_FULL:
        return disk_full(path, need)
    return StrataError(f"cannot write {path}: {os_reason(e)}")


def download(url: str, part: Path, sha256: str, size: int | None = None, progress: Progress | None = None) -> Path:
    """Bring `part` to the whole body of `url` (size: bytes, where known) and check its sha256."""
    progress = progress or Progress()
    state = {"started": False}
    cuts = 0
    done = _size(part)
    while True:
        have = _size(part)
        if size is not None and have > size:  # not the file we want: start over
            part.unlink()
            have = 0
        if size is not None and have == size:  # complete (an earlier run): only the checksum is left
            done = have
            break
        try:
            done = _transfer(url, part, have, size, progress, state)
            break
        except _Cut as e:
            cuts += 1
            if cuts > RESUMES:
                raise StrataError(f"the download of {url} kept breaking off ({e}); the {_size(part) / MiB:.1f} MiB "
                                  f"that came are kept in {part}: run again to resume") from None
            progress.line(f"the connection broke ({e}); resuming at {_size(part) / MiB:.1f} MiB")
    if state["started"]:
        progress.done(done)
    check_sha256(part, sha256, url)
    return part


def _transfer(url: str, part: Path, have: int, size: int | None, progress: Progress, state: dict) -> int:
    try:
        resp = open_url(url, {"Range": f"bytes={have}-"} if have else None)
    except HTTPStatus as e:
        if e.code == 416 and have:  # nothing past what we have: the checksum decides
            return have
        raise
    with resp:
        if have and resp.status != 206:  # the server ignored the Range: the body is the whole file
            have = 0
        length = resp.headers.get("Content-Length", "")
        expect = have + int(length) if length.isdigit() else size
        if not state["started"]:
            state["started"] = True
            progress.start(part.name.removesuffix(".part"), size or expect, have, urlsplit(url).netloc)
        try:
            out = open(part, "ab" if have else "wb", buffering=0)  # unbuffered: what is on disk is what came
        except OSError as e:
            raise _write_error(e, part, size) from None
        done = have
        with out:
            while True:
                try:
                    chunk = resp.read(CHUNK)
                except (OSError, http.client.HTTPException) as e:
                    raise _Cut(url_reason(e)) from None
                if not chunk:
                    break
                view = memoryview(chunk)
                try:
                    while view:
                        view = view[out.write(view):]
                except OSError as e:
                    raise _write_error(e, part, size) from None
                done += len(chunk)
                progress.update(done)
    if expect is not None and done < expect:
        raise _Cut(f"the server closed the connection at {done / MiB:.1f} of {expect / MiB:.1f} MiB")
    return done


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: Path, expected: str, url: str) -> None:
    got = file_sha256(path)
    if got != expected.lower():
        path.unlink(missing_ok=True)
        raise StrataError(f"checksum mismatch for {url}: sha256 {got}, the index lists {expected.lower()}; "
                          f"the download was deleted, run again")
