"""Request and response bodies: Content-Encoding in both directions, bounded inflating."""

from __future__ import annotations

import asyncio
import gzip
import zlib
from typing import Any

import numpy as np
import pytest

from edged.errors import BadRequestError, PayloadTooLargeError, UnsupportedEncodingError
from edged.transports.http import body as http_body
from edged.transports.http.body import accepted_encoding, compress, inflate, read_body

GZIP, DEFLATE = 16 + zlib.MAX_WBITS, zlib.MAX_WBITS


def scope(**headers: str) -> dict[str, Any]:
    return {"headers": [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]}


def fake_receive(chunks: list[bytes]) -> Any:
    """A fake ASGI receive (pure logic under test): the body in the given messages."""
    messages = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return receive


def data(n: int) -> bytes:
    """Compressible but not trivial: small integers."""
    return np.random.default_rng(n).integers(0, 8, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", [0, 100, 70_000, 5_000_000])
@pytest.mark.parametrize("wbits", [GZIP, DEFLATE])
def test_inflate_round_trips(size: int, wbits: int) -> None:
    raw = data(size)
    packed = gzip.compress(raw) if wbits == GZIP else zlib.compress(raw)
    assert bytes(asyncio.run(inflate(packed, wbits, size))) == raw  # exactly at the limit
    assert bytes(asyncio.run(inflate(np.frombuffer(packed, np.uint8).data, wbits, size))) == raw
    if size:
        with pytest.raises(PayloadTooLargeError, match="inflates to more than"):
            asyncio.run(inflate(packed, wbits, size - 1))


def test_a_small_body_that_inflates_far_goes_on_past_the_loop_step() -> None:
    raw = bytes(8 << 20)  # 8 KiB of gzip: inline by size, far above the loop's output step
    packed = gzip.compress(raw)
    assert len(packed) <= http_body._INLINE_IN
    assert bytes(asyncio.run(inflate(packed, GZIP, 8 << 20))) == raw
    with pytest.raises(PayloadTooLargeError):
        asyncio.run(inflate(packed, GZIP, 1 << 20))


def test_broken_streams() -> None:
    packed = gzip.compress(data(1000))
    for body, words in (
        (b"not gzip at all", "corrupt"),
        (packed[:-10], "truncated"),
        (packed + b"\x00", "follow the end"),
        (packed + packed, "follow the end"),
        (b"", "truncated"),
        (packed[:5], "truncated"),
    ):
        with pytest.raises(BadRequestError, match=words):
            asyncio.run(inflate(body, GZIP, 1 << 20))


def test_content_encoding_header() -> None:
    body = data(500)
    cases = {
        "gzip": gzip.compress(body),
        "GZip": gzip.compress(body),
        "x-gzip": gzip.compress(body),
        "deflate": zlib.compress(body),
        "identity": body,
        "identity, gzip": gzip.compress(body),
    }
    for encoding, packed in cases.items():
        got = asyncio.run(read_body(scope(content_encoding=encoding), fake_receive([packed]), 1 << 20))
        assert bytes(got) == body, encoding
    for encoding, words in (("br", "'br' is not supported"), ("gzip, deflate", "one encoding")):
        with pytest.raises(UnsupportedEncodingError, match=words):
            asyncio.run(read_body(scope(content_encoding=encoding), fake_receive([body]), 1 << 20))


def test_the_compressed_size_is_bounded_too() -> None:
    packed = gzip.compress(data(100_000))
    head = scope(content_encoding="gzip", content_length=str(len(packed)))
    with pytest.raises(PayloadTooLargeError, match="server.max_body"):
        asyncio.run(read_body(head, fake_receive([packed]), len(packed) - 1))
    chunks = [packed[i : i + 1000] for i in range(0, len(packed), 1000)]  # chunked: no length given
    with pytest.raises(PayloadTooLargeError):
        asyncio.run(read_body(scope(content_encoding="gzip"), fake_receive(chunks), len(packed) - 1))
    assert bytes(asyncio.run(read_body(scope(content_encoding="gzip"), fake_receive(chunks), 100_000))) == data(100_000)


@pytest.mark.parametrize(
    ("accept", "want"),
    [
        ("", None),
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("gzip, deflate", "gzip"),
        ("deflate, gzip;q=0", "deflate"),
        ("GZIP;Q=0.5", "gzip"),
        ("br", None),
        ("*", "gzip"),
        ("*;q=0", None),
        ("identity", None),
        ("gzip;q=bogus, deflate", "deflate"),
    ],
)
def test_accept_encoding(accept: str, want: str | None) -> None:
    assert accepted_encoding(scope(accept_encoding=accept)) == want


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("size", [1000, 200_000])
def test_compress_parts(encoding: str, size: int) -> None:
    raw = data(size)
    parts: list[bytes | memoryview] = [raw[:10], memoryview(raw)[10 : size // 2], raw[size // 2 :]]
    packed = b"".join(asyncio.run(compress(parts, size, encoding)))
    assert (gzip.decompress(packed) if encoding == "gzip" else zlib.decompress(packed)) == raw


def test_one_pass_over_the_headers_finds_what_the_body_and_the_infer_route_read() -> None:
    head = {
        "headers": [
            (b"host", b"localhost"),
            (b"content-length", b"12"),
            (b"content-encoding", b"gzip"),
            (b"inference-header-content-length", b"5"),
            (b"content-length", b"99"),  # only the first counts, as before
            (b"inference-header-content-length", b"7"),
            (b"content-encoding", b"identity"),
        ]
    }
    got = http_body.body_headers(head)
    assert got.length == b"12"
    assert got.encodings == (b"gzip", b"identity")
    assert got.header_lengths == (b"5", b"7")
    assert http_body.body_headers({"headers": []}) == (None, (), ())
    # No name twice: read with one dict, the same answer the loop gives
    once = [(b"content-length", b"12"), (b"content-encoding", b"gzip"), (b"inference-header-content-length", b"5")]
    assert http_body.body_headers({"headers": once}) == (b"12", (b"gzip",), (b"5",))
    assert http_body.body_headers({"headers": once[:1]}) == (b"12", (), ())


def test_read_body_takes_headers_already_walked() -> None:
    raw = data(300)
    packed = gzip.compress(raw)
    head = scope(content_encoding="gzip", content_length=str(len(packed)))
    walked = http_body.body_headers(head)
    assert bytes(asyncio.run(read_body(head, fake_receive([packed]), 1 << 20, walked))) == raw
    with pytest.raises(PayloadTooLargeError, match="exceeds the limit"):
        asyncio.run(read_body(head, fake_receive([packed]), len(packed) - 1, walked))
