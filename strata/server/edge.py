"""Who may talk to a server: the Host, Origin, CORS, API-key and content-type policy, applied
to every request before any route runs (ASGI middleware, shared by `strata serve` and
`strata engine`).

Why: a web page can make a browser send requests to a server on 127.0.0.1, and with DNS
rebinding it can even read the answers. Browsers always name the page's origin (`Origin`)
on cross-origin and POST requests, and a rebound name still arrives as that name in `Host`.
So, as Ollama and llama-server users expect:

- Host: a server bound to a loopback address answers only loopback names (`localhost`,
  `127.0.0.1`, `[::1]`, any port) plus `allowed_hosts`; bound elsewhere it answers any
  name unless `allowed_hosts` is given. Others: 403.
- Origin: requests without one (curl, SDKs) pass; pages on a loopback origin and those in
  `allowed_origins` (`"*"` allows all) get CORS answers (preflight included); any other
  origin, `null` too, gets 403; a value that is no URL at all (`http://[evil`) gets 400.
- Content-Type of a POST: JSON, none, or `application/x-www-form-urlencoded` (what `curl -d`
  sends; read as JSON). Other types, `text/plain` and `multipart/form-data` among them, get
  415: they are what a page may send without a preflight, and never JSON on purpose.
- Headers: at most MAX_HEADERS of them and MAX_HEADER_BYTES in all (431): the HTTP parser
  takes any size that arrives in one read.
- API key: when one is set, every route but the exempt ones (`/health` of a user key; none
  for the engine's own secret) needs `Authorization: Bearer <key>`; CORS preflights carry no
  credentials and pass (they reach no route).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from urllib.parse import urlsplit

from strata.server.errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY = "*"
# CORS preflight answers
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type"
PREFLIGHT_MAX_AGE_S = "600"
MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 * 1024
# POST bodies read as JSON; everything else a page could send without a preflight is refused
JSON_TYPES = frozenset({"", "application/json", "application/x-www-form-urlencoded"})


def is_loopback(bind_host: str) -> bool:
    h = bind_host.strip("[]").lower()
    return h in LOOPBACK_NAMES or h.startswith("127.")


def host_name(value: str) -> str:
    """'Localhost:8080' -> 'localhost', '[::1]:80' -> '::1', 'example.com.' -> 'example.com'."""
    v = value.strip().lower()
    if v.startswith("["):
        v = v[1:v.find("]")] if "]" in v else v[1:]
    elif v.count(":") == 1:
        v = v.split(":", 1)[0]
    return v.rstrip(".")


@dataclass(frozen=True)
class EdgePolicy:
    api_key: str | None = None
    key_exempt: frozenset[str] = frozenset({"/health"})
    allowed_hosts: tuple[str, ...] = (ANY,)  # host names, or "*"
    allowed_origins: tuple[str, ...] = ()  # "scheme://host[:port]", or "*"; loopback origins always

    @classmethod
    def for_bind(cls, bind_host: str, *, api_key: str | None = None, allowed_hosts=None,
                 allowed_origins=(), key_exempt: frozenset[str] = frozenset({"/health"})) -> "EdgePolicy":
        """allowed_hosts None: loopback names when bound to loopback, else any name."""
        if allowed_hosts is None or not list(allowed_hosts):
            hosts = tuple(sorted(LOOPBACK_NAMES)) if is_loopback(bind_host) else (ANY,)
        else:
            hosts = tuple(ANY if h == ANY else host_name(h) for h in allowed_hosts)
            if is_loopback(bind_host):
                hosts = tuple(sorted(set(hosts) | LOOPBACK_NAMES))
        origins = tuple(o if o == ANY else o.strip().lower().rstrip("/") for o in allowed_origins)
        return cls(api_key=api_key or None, key_exempt=key_exempt, allowed_hosts=hosts, allowed_origins=origins)

    # ------------------------------------------------------------ the decisions (pure)
    def host_ok(self, host: str | None) -> bool:
        if host is None or ANY in self.allowed_hosts:
            return True  # HTTP/1.0 without Host cannot come from a browser
        return host_name(host) in self.allowed_hosts

    def origin_ok(self, origin: str) -> bool:
        o = origin.strip().lower().rstrip("/")
        if ANY in self.allowed_origins or o in self.allowed_origins:
            return True
        parts = origin_parts(o)
        return parts is not None and parts[0] in ("http", "https") and parts[1] in LOOPBACK_NAMES

    def key_ok(self, authorization: str) -> tuple[bool, str]:
        """(ok, why-not) for an Authorization header value."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False, "missing API key: send 'Authorization: Bearer <key>'"
        if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), self.api_key.encode()):
            return False, "invalid API key"
        return True, ""


def origin_parts(origin: str) -> tuple[str, str | None] | None:
    """(scheme, host name) of an Origin value, or None when it cannot be read as a URL: an
    unclosed IPv6 bracket (`http://[evil`) or a port out of range make urlsplit raise, and
    such a value comes from no browser. ("null", an opaque origin, reads as ("", None).)"""
    try:
        parts = urlsplit(origin)
        _ = parts.port  # raises for a port that is not a number in range
        return parts.scheme, parts.hostname
    except ValueError:
        return None


def content_type_ok(value: str) -> bool:
    media = value.split(";", 1)[0].strip().lower()
    return media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


def _headers(scope) -> dict[str, str]:
    # latin-1: any byte maps to one character, so odd header bytes never raise here
    out: dict[str, str] = {}
    for k, v in scope.get("headers", ()):
        out.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
    return out


class EdgeMiddleware:
    """ASGI middleware applying an EdgePolicy; refusals are OpenAI-shaped errors."""

    def __init__(self, app, policy: EdgePolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        policy = self.policy
        h = _headers(scope)
        method, path = scope["method"], scope["path"]
        origin = h.get("origin")
        refusal: APIError | None = None
        raw_headers = scope.get("headers", ())
        if len(raw_headers) > MAX_HEADERS or sum(len(k) + len(v) for k, v in raw_headers) > MAX_HEADER_BYTES:
            refusal = APIError("header_too_large_error", f"the request headers are over {MAX_HEADERS} headers or "
                               f"{MAX_HEADER_BYTES} bytes", code="header_too_large")
        elif not policy.host_ok(h.get("host")):
            refusal = APIError("permission_error", f"Host {h.get('host')!r} is not served here; add it to "
                               "allowed_hosts (--allowed-hosts) to allow it", param="Host", code="host_not_allowed")
        elif origin is not None and not policy.origin_ok(origin):
            if origin_parts(origin.strip().lower()) is None:
                refusal = APIError("invalid_request_error", f"Origin {origin!r} is not a valid origin "
                                   "(scheme://host[:port])", param="Origin", code="invalid_origin")
            else:
                refusal = APIError("permission_error", f"Origin {origin!r} is not allowed; add it to "
                                   "allowed_origins (--allowed-origins) to allow it", param="Origin",
                                   code="origin_not_allowed")
        elif method == "OPTIONS" and origin is not None and "access-control-request-method" in h:
            return await _preflight(origin, send)
        elif policy.api_key and path not in policy.key_exempt:
            ok, why = policy.key_ok(h.get("authorization", ""))
            if not ok:
                refusal = APIError("authentication_error", why, code="invalid_api_key")
        if refusal is None and method == "POST" and not content_type_ok(h.get("content-type", "")):
            refusal = APIError("unsupported_media_type_error",
                               f"Content-Type {h.get('content-type')!r} is not accepted; send application/json",
                               param="Content-Type", code="unsupported_media_type")
        allowed_origin = origin is not None and policy.origin_ok(origin)
        cors = {"access-control-allow-origin": origin, "vary": "Origin"} if allowed_origin else {}
        if refusal is not None:
            # the client may still be sending its body: answer and close the connection
            return await refusal.response(headers={**cors, "connection": "close"})(scope, receive, send)
        if not cors:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  *((k.encode(), v.encode("latin-1")) for k, v in cors.items())]}
            await send(message)

        return await self.app(scope, receive, send_with_cors)


async def _preflight(origin: str, send) -> None:
    headers = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
               (b"access-control-allow-methods", ALLOW_METHODS.encode()),
               (b"access-control-allow-headers", ALLOW_HEADERS.encode()),
               (b"access-control-max-age", PREFLIGHT_MAX_AGE_S.encode()), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})
