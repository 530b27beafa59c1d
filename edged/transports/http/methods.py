"""Which HTTP methods a route takes: 405 with an ``Allow`` header, and HEAD wherever GET is; and
the headers and body other error answers need (415 names the encodings edged reads; under
``/v1/`` the body is in OpenAI's shape).

HEAD is answered exactly as GET (status and headers, content-length included); uvicorn drops the
body of an answer to a HEAD request, so the routes need not know about it.
"""

from __future__ import annotations

import orjson

from edged.errors import EdgedError, MethodNotAllowedError, UnsupportedEncodingError

Headers = list[tuple[bytes, bytes]]


def expect(method: str, *allowed: str) -> None:
    """Refuse ``method`` unless it is one of ``allowed`` (HEAD goes with GET)."""
    if method in allowed or (method == "HEAD" and "GET" in allowed):
        return
    allow = (*allowed, "HEAD") if "GET" in allowed and "HEAD" not in allowed else allowed
    raise MethodNotAllowedError(f"method {method} is not allowed here; use {' or '.join(allowed)}", allow)


def error_headers(error: EdgedError, base: Headers) -> Headers:
    """The headers of an error answer: ``base`` plus what the error's status requires."""
    if isinstance(error, MethodNotAllowedError):
        return [*base, (b"allow", ", ".join(error.allow).encode())]
    if isinstance(error, UnsupportedEncodingError):  # RFC 9110 15.5.16, and what Triton sends
        return [*base, (b"accept-encoding", b"gzip, deflate")]
    return base


def error_body(code: str, message: str, path: str | bytes) -> bytes:
    """An error answer's body: ``{"error": message, "code": code}``, or under ``/v1/`` OpenAI's
    ``{"error": {"message", "type", "code", "param"}}``, which OpenAI's clients read (their
    exceptions' ``code`` and ``type``); the stable code is kept in both."""
    openai = path.startswith(b"/v1/") if isinstance(path, bytes) else path.startswith("/v1/")
    if openai:
        return orjson.dumps({"error": {"message": message, "type": code, "code": code, "param": None}})
    return orjson.dumps({"error": message, "code": code})
