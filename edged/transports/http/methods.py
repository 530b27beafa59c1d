"""Which HTTP methods a route takes: 405 with an ``Allow`` header, and HEAD wherever GET is; and
the headers other error answers need (415 names the encodings edged reads).

HEAD is answered exactly as GET (status and headers, content-length included); uvicorn drops the
body of an answer to a HEAD request, so the routes need not know about it.
"""

from __future__ import annotations

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
