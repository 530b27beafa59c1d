"""A client that shuts its side of the connection after sending a request still gets the answer,
on a real daemon: a request run on a worker thread, and a pipelined pair; then the connection
closes."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests.helpers import DaemonProcess
from tests.integration.test_hostile_socket import connect, read_to_eof
from tests.integration.test_metrics import WIDTH, make_slow

pytestmark = pytest.mark.integration


@pytest.fixture
def slow(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> DaemonProcess:
    # Tens of milliseconds a run: served on its worker thread, so the answer comes after the EOF.
    model = make_slow(tmp_path / "slow.onnx")
    return daemon_factory({"slow": {"path": str(model)}}).start()


def infer_request() -> bytes:
    x = np.full((64, WIDTH), 0.01, np.float32)
    tensor = {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
    body = orjson.dumps({"inputs": [tensor]})
    head = f"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


@pytest.mark.parametrize("requests", [1, 2])
def test_a_request_sent_before_a_half_close_is_answered(slow: DaemonProcess, requests: int) -> None:
    s = connect(slow.socket)
    s.sendall(infer_request() * requests)
    s.shutdown(socket.SHUT_WR)
    answers = read_to_eof(s)  # the daemon closes once it has answered
    s.close()
    assert [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", answers)] == [200] * requests, answers[:300]
    assert answers.count(b'"name":"y"') == requests
