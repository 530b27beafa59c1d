"""Answers made at once on the connection (transports/http/connection.py's ``Direct``), on the daemon's
real stack in process: uvicorn with edged's protocol on a real Unix socket, a real registry and
ONNX Runtime model (the demo's tiny MLP, made to run inline). Each answer made at once must be
byte for byte the answer of the ASGI call it replaces (the versioned path never takes the
shortcut), on the same connection, pipelined or not."""

from __future__ import annotations

import asyncio
import gzip
from pathlib import Path

import numpy as np
import pytest

from tests.unit.direct_answer_stack import DIRECT, ROUTED, Served, X, answer, as_json, binary, exchange, http, run


def test_answers_made_at_once_are_the_asgi_calls_answers_byte_for_byte(tmp_path: Path) -> None:
    body, length = binary(X)
    cases = {
        "binary": (body, [length]),
        "json": (as_json(X), []),
        "binary input, json output": (binary(X, output=False)[0], [binary(X, output=False)[1]]),
        "connection close": (body, [length, "Connection: close"]),
        "wrong shape (400)": (as_json(np.zeros((1, 15), np.float32)), []),
        "malformed (400)": (b'{"inputs": [', []),
        "header length past the body (400)": (body, ["Inference-Header-Content-Length: 99999"]),
    }

    async def test(s: Served) -> None:
        stats = s.svc.metrics.model("m")
        for name, (data, headers) in cases.items():
            before = (stats.requests, stats.failures)
            at_once, routed = await exchange(s, http(DIRECT, data, *headers), http(ROUTED, data, *headers))
            assert at_once == routed, name
            assert s.kinds.pop() == "answer", name  # the first went through ``now``, the second did not
            assert not s.kinds
            once = (stats.requests - before[0], stats.failures - before[1])
            assert once[0] == 2 or once == (0, 0), (name, once)  # each counted as the other was
        # HTTP/1.0: no keep-alive, so the answer says connection: close and the socket closes
        at_once, routed = await exchange(
            s, http(DIRECT, body, length, version="1.0"), http(ROUTED, body, length, version="1.0")
        )
        assert at_once == routed and b"connection: close" in at_once

    run(tmp_path, test)


def test_pipelined_requests_in_one_write_are_answered_in_order(tmp_path: Path) -> None:
    body, length = binary(X)
    health = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    requests = [http(DIRECT, body, length), http(ROUTED, body, length), health, http(DIRECT, as_json(X))] * 8

    async def test(s: Served) -> None:
        reader, writer = await s.connect()
        writer.write(b"".join(requests))
        got = [await answer(reader) for _ in requests]
        writer.close()
        # The first is answered at once; those behind the ASGI call it then meets are queued by
        # uvicorn and served by tasks (a read arriving after the queue drained may go at once).
        assert s.kinds.count("answer") >= 1 and "declined" not in s.kinds
        s.kinds.clear()
        alone = await exchange(s, *requests[:4])
        assert got == alone * 8
        assert s.kinds == ["answer"] * 2
        s.kinds.clear()
        reader, writer = await s.connect()
        writer.write(http(DIRECT, body, length) * 20)  # one read: a few at once, the rest queued
        got = [await answer(reader) for _ in range(20)]
        writer.close()
        assert got == [alone[0]] * 20
        assert 1 <= len(s.kinds) < 20 and set(s.kinds) == {"answer"}  # the loop is not held for all

    run(tmp_path, test)


def test_an_answer_made_at_once_arms_no_keepalive_timer_over_the_next_request(tmp_path: Path) -> None:
    """An answer made at once, with the next request's head in the same read: that request's
    body comes later than keepalive_s. The answer's keep-alive timer must not close the
    connection meanwhile (uvicorn cancels it only when data is read or an answer completes)."""
    body, length = binary(X)
    nxt = http(ROUTED, body, length)
    cut = nxt.index(b"\r\n\r\n") + 4

    async def test(s: Served) -> None:
        (expected,) = await exchange(s, nxt)
        reader, writer = await s.connect()
        writer.write(http(DIRECT, body, length) + nxt[:cut])
        await answer(reader)
        await asyncio.sleep(1.5)  # time passing is what is tested: past keepalive_s, within read_timeout_s
        writer.write(nxt[cut:])
        assert await answer(reader) == expected
        writer.close()

    run(tmp_path, test, keepalive_s=1)


def test_a_body_in_pieces_and_a_client_gone_mid_body(tmp_path: Path) -> None:
    body, length = binary(X)
    request = http(DIRECT, body, length)
    cut = request.index(b"\r\n\r\n") + 10

    async def test(s: Served) -> None:
        (expected,) = await exchange(s, request)
        reader, writer = await s.connect()
        writer.write(request[:cut])
        await writer.drain()
        await asyncio.sleep(0.05)  # not synchronisation: the rest may come in the same read or not
        writer.write(request[cut:])
        assert await answer(reader) == expected
        writer.close()
        reader, writer = await s.connect()
        writer.write(request[:cut])  # then gone: nothing was started for it, nothing is left
        await writer.drain()
        writer.close()
        assert await exchange(s, request) == [expected]
        assert s.kinds == ["answer"] * 3

    run(tmp_path, test)


def test_what_follows_an_answer_that_closed_the_connection_is_never_run(tmp_path: Path) -> None:
    """HTTP/1.0 asking for keep-alive, three requests in one write: uvicorn answers the first with
    connection: close and closes; the parser still finds the other two in the read. Neither may
    run (nobody would get its answer), as behind a cycle whose answer closes the connection."""
    body, length = binary(X)
    request = http(DIRECT, body, length, "Connection: keep-alive", version="1.0")

    async def test(s: Served) -> None:
        stats = s.svc.metrics.model("m")
        before = stats.requests
        reader, writer = await s.connect()
        writer.write(request * 3)
        got = await asyncio.wait_for(reader.read(), 30)  # to the end: the daemon closed it
        writer.close()
        assert got.count(b"HTTP/1.1 200") == 1 and b"connection: close" in got
        assert stats.requests == before + 1 and s.kinds == ["answer"]

    run(tmp_path, test)


def test_an_absurd_content_length_is_read_as_uvicorn_reads_it(tmp_path: Path) -> None:
    """Thousands of leading zeros (llhttp takes them): the same answer on both paths, not a 400
    for an integer too long to convert."""
    body, length = binary(X)
    head = f"Content-Length: {'0' * 5000}{len(body)}"

    def odd(path: str) -> bytes:
        return ("\r\n".join([f"POST {path} HTTP/1.1", "Host: x", head, length]) + "\r\n\r\n").encode() + body

    async def test(s: Served) -> None:
        at_once, routed = await exchange(s, odd(DIRECT), odd(ROUTED))
        assert at_once == routed
        assert b"invalid HTTP request" not in at_once, at_once  # the head was read, not refused

    run(tmp_path, test)


@pytest.mark.parametrize("encoding", ["gzip", None])
def test_an_answer_to_compress_is_finished_by_a_task(tmp_path: Path, encoding: str | None) -> None:
    body, length = binary(X)
    accept = [f"Accept-Encoding: {encoding}"] if encoding else []

    async def test(s: Served) -> None:
        at_once, routed = await exchange(s, http(DIRECT, body, length, *accept), http(ROUTED, body, length, *accept))
        assert at_once == routed
        assert s.kinds == ["rest"]
        head, _, data = at_once.partition(b"\r\n\r\n")
        assert b"vary: accept-encoding" in head
        assert (b"content-encoding: gzip" in head) == (encoding == "gzip")
        if encoding:
            assert gzip.decompress(data).startswith(b'{"model_name":"m"')

    run(tmp_path, test, compress_min_size="1B")
