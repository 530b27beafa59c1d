"""Requests pipelined in one write before a malformed one are answered before its 400, on a real
daemon: good, good, garbage is 200, 200, 400, then the connection closes."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.helpers import DaemonProcess
from tests.integration.test_hostile_socket import connect, read_to_eof, tiny

pytestmark = pytest.mark.integration
__all__ = ["tiny"]  # a fixture: imported so that pytest finds it

GOOD = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
GARBAGE = b"\x00\x01 this is not HTTP\r\n\r\n"


@pytest.mark.parametrize("goods", [1, 2])
def test_pipelined_good_requests_are_answered_before_the_garbage(
    tiny: Callable[..., DaemonProcess], goods: int
) -> None:
    d = tiny()
    s = connect(d.socket)
    s.sendall(GOOD * goods + GARBAGE)
    answers = read_to_eof(s)
    s.close()
    statuses = [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", answers)]
    assert statuses == [200] * goods + [400], answers
    assert answers.endswith(b'"code":"bad_request"}')
