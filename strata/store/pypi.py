"""A package's newest wheel, as a PyPI-style JSON API lists it (GET <index>/<package>/json)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urljoin

from strata.errors import StrataError
from strata.store.net import get_json

ENV_PYPI_URL = "STRATA_PYPI_URL"
DEFAULT_PYPI_URL = "https://pypi.org/pypi"
WHEEL_TAG = "-py3-none-any.whl"


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    filename: str
    url: str
    sha256: str
    size: int | None  # bytes, where the index says


def index_url(env: Mapping[str, str] | None = None) -> str:
    """$STRATA_PYPI_URL (a mirror with the same JSON API), else PyPI's."""
    env = os.environ if env is None else env
    return (env.get(ENV_PYPI_URL) or DEFAULT_PYPI_URL).rstrip("/")


def newest_wheel(package: str, index: str | None = None) -> Wheel:
    """The pure-Python wheel of the package's newest release, with the sha256 the index lists."""
    url = f"{index or index_url()}/{package}/json"
    return wheel_from_json(get_json(url), package, url)


def wheel_from_json(data: Any, package: str, url: str) -> Wheel:
    try:
        version = str(data["info"]["version"])
        files = list(data["urls"])
    except (KeyError, TypeError):
        raise StrataError(f"{url}: not a PyPI JSON answer (no info.version / urls)") from None
    for entry in files:
        if not isinstance(entry, dict) or entry.get("yanked"):
            continue
        filename = str(entry.get("filename", ""))
        if not filename.endswith(WHEEL_TAG):
            continue
        sha256 = (entry.get("digests") or {}).get("sha256")
        if not sha256:
            raise StrataError(f"{url}: {filename} comes without a sha256 digest; refusing an unchecked download")
        link = entry.get("url")
        if not link:
            raise StrataError(f"{url}: {filename} comes without a url")
        size = entry.get("size")
        return Wheel(package, version, filename, urljoin(url, str(link)), str(sha256).lower(),
                     int(size) if isinstance(size, int) and size >= 0 else None)
    raise StrataError(f"{url}: release {version} of {package} has no {WHEEL_TAG[1:]} wheel")
