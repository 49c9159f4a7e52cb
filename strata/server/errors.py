"""API errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

One table maps each error type to its HTTP status, so handlers raise by type and never
pick status codes by hand.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

# error type -> HTTP status (llama-server's and vLLM's names)
STATUS_BY_TYPE: dict[str, int] = {
    "invalid_request_error": 400,
    "exceed_context_size_error": 400,
    "authentication_error": 401,
    "permission_error": 403,  # a Host or Origin this server does not serve
    "not_found_error": 404,
    "method_not_allowed_error": 405,
    "request_timeout_error": 408,  # the body did not arrive within body_timeout
    "request_too_large_error": 413,
    "unsupported_media_type_error": 415,
    "header_too_large_error": 431,
    "rate_limit_error": 429,
    "server_error": 500,
    "unavailable_error": 503,
    "timeout_error": 504,
}


class APIError(Exception):
    """Raised inside handlers; rendered as an OpenAI-shaped JSON error."""

    def __init__(self, type_: str, message: str, *, param: str | None = None, code: Any = None,
                 status: int | None = None, extra: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.type = type_
        self.message = message
        self.param = param
        self.code = code
        self.status = status or STATUS_BY_TYPE[type_]
        self.extra = extra or {}
        self.headers = headers or {}  # e.g. "connection: close" after a body that never arrived

    def body(self) -> dict[str, Any]:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(headers or {})})


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError("invalid_request_error", message, param=param)


def error_for_status(status: int, message: str) -> APIError:
    """For framework errors (404 route, 405 method) that arrive as bare status codes."""
    for type_, s in STATUS_BY_TYPE.items():
        if s == status:
            return APIError(type_, message)
    return APIError("invalid_request_error" if status < 500 else "server_error", message, status=status)
