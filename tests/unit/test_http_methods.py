"""Which methods a route takes: HEAD goes with GET, and a 405 names what is allowed."""

from __future__ import annotations

import pytest

from edged.errors import BadRequestError, MethodNotAllowedError, UnsupportedEncodingError
from edged.transports.http.methods import error_headers, expect

BASE = [(b"content-type", b"application/json")]


def test_head_goes_with_get() -> None:
    expect("GET", "GET")
    expect("HEAD", "GET")
    expect("POST", "GET", "POST")
    with pytest.raises(MethodNotAllowedError) as e:
        expect("HEAD", "POST")
    assert e.value.allow == ("POST",)


@pytest.mark.parametrize(
    ("method", "allowed", "allow"),
    [
        ("POST", ("GET",), b"GET, HEAD"),
        ("GET", ("POST",), b"POST"),
        ("DELETE", ("GET", "POST"), b"GET, POST, HEAD"),
    ],
)
def test_405_carries_allow(method: str, allowed: tuple[str, ...], allow: bytes) -> None:
    with pytest.raises(MethodNotAllowedError) as e:
        expect(method, *allowed)
    assert f"method {method} is not allowed here" in e.value.message
    assert error_headers(e.value, BASE) == [*BASE, (b"allow", allow)]


def test_other_errors_keep_their_headers() -> None:
    assert error_headers(BadRequestError("x"), BASE) == BASE
    assert error_headers(UnsupportedEncodingError("x"), BASE) == [*BASE, (b"accept-encoding", b"gzip, deflate")]
