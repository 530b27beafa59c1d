"""The connection layer against hostile clients, on a real daemon: stalled and idle connections,
oversize headers, the connection limit and admin_group. A stalled connection holds nothing up:
/v2/health/live is answered while it is still open, before its read timeout; after each hostile
connection the daemon is alive and its loop answers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from edged.client import Client
from tests.helpers import DaemonProcess, wait_for
from tests.integration.test_shm_security import assert_live
from tests.integration.users import AsUser, need_root, temp_group, temp_user

pytestmark = pytest.mark.integration


def connect(path: Path | str, timeout: float = 15.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


def read_to_eof(s: socket.socket) -> bytes:
    """Everything the daemon sends until it closes the connection (socket timeout: test fails)."""
    chunks = []
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def still_open(s: socket.socket) -> bool:
    """Nothing received on ``s`` yet, and not closed by the daemon (a peek that does not wait)."""
    timeout = s.gettimeout()
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        s.settimeout(timeout)
    return False


def error_of(response: bytes) -> tuple[int, str]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(body)["code"]


@pytest.fixture
def tiny(daemon_factory: Callable[..., DaemonProcess], model_dir: Path) -> Callable[..., DaemonProcess]:
    def start(**server: Any) -> DaemonProcess:
        return daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}, extra={"server": server}).start()

    return start


STALLS = {
    "idle": b"",
    "mid-headers": b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Le",
    "mid-body": b'POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"inputs":',
}


READ_TIMEOUT_S = 2.0


@pytest.mark.parametrize("stall", list(STALLS))
def test_stalled_connection_is_closed_after_the_read_timeout(tiny: Callable[..., DaemonProcess], stall: str) -> None:
    d = tiny(read_timeout_s=READ_TIMEOUT_S)
    s = connect(d.socket)
    opened = time.monotonic()
    s.sendall(STALLS[stall])
    assert_live(d)
    # Answered while the stalled connection is still open, its timeout not yet reached: the
    # stall holds nothing up (a loop blocked on it would answer only after the 408).
    assert still_open(s), "the health checks were answered only once the stalled connection was closed"
    response = read_to_eof(s)
    took = time.monotonic() - opened
    s.close()
    assert error_of(response) == (408, "request_timeout")
    assert READ_TIMEOUT_S - 0.1 < took < 10 * READ_TIMEOUT_S, took  # closed at its timeout, not before
    with d.client() as c:
        assert c.infer("tiny", {"x": np.zeros((1, 16), np.float32)})["probs"].shape == (1, 4)


def test_keep_alive_connection_serves_requests_back_to_back(tiny: Callable[..., DaemonProcess]) -> None:
    """The read timeout counts per request: a connection used for many requests is not cut."""
    d = tiny(read_timeout_s=1.0)
    with d.client() as c:
        deadline = time.monotonic() + 2.5  # longer than the read timeout, with requests throughout
        n = 0
        while time.monotonic() < deadline:
            assert c.live()
            n += 1
    assert n > 10


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ([("X-Big", "a" * 32_000)], "header_too_large"),
        ([(f"X-H{i}", "1") for i in range(101)], "too_many_headers"),
    ],
)
def test_oversize_headers_get_431(
    tiny: Callable[..., DaemonProcess], headers: list[tuple[str, str]], code: str
) -> None:
    d = tiny()
    s = connect(d.socket)
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers)
    s.sendall(f"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n{lines}\r\n".encode())
    assert error_of(read_to_eof(s)) == (431, code)
    s.close()
    assert_live(d)


def test_a_header_that_never_ends_is_cut_at_the_limit(tiny: Callable[..., DaemonProcess]) -> None:
    """One header line of 64 MiB: refused after about max_header_size, never buffered whole."""
    d = tiny(max_header_size="16KiB")
    assert d.proc is not None
    rss_before = _rss(d.proc.pid)
    s = connect(d.socket)
    sent = 0

    def send() -> None:
        nonlocal sent
        with contextlib.suppress(OSError):  # the daemon closes the connection mid-send
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nX-Big: ")
            chunk = b"a" * (1 << 20)
            for _ in range(64):
                s.sendall(chunk)
                sent += len(chunk)

    sender = threading.Thread(target=send)
    sender.start()
    response = read_to_eof(s)
    sender.join(30)
    s.close()
    assert error_of(response) == (431, "header_too_large")
    assert sent < 64 << 20  # the rest was never accepted
    assert _rss(d.proc.pid) - rss_before < 32 << 20
    assert_live(d)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_connection_limit_refuses_one_more_and_serves_the_rest(tiny: Callable[..., DaemonProcess]) -> None:
    d = tiny(max_connections=4, reserved_connections=0)  # the reserve: test_connection_shares.py
    held = [d.client() for _ in range(4)]
    try:
        for c in held:
            assert c.live()  # accepted and counted
        extra = connect(d.socket)
        assert error_of(read_to_eof(extra)) == (503, "too_many_connections")
        extra.close()
        assert all(c.live() for c in held)  # the connections inside the limit keep being served
        held.pop().close()
        with Client(str(d.socket), timeout=5) as c:
            assert wait_for(c.live, 10, what="a slot to free up")
    finally:
        for c in held:
            c.close()
    assert "server.max_connections" in d.log()


# --- admin_group ------------------------------------------------------------------------------------


def test_admin_group_gates_load_and_unload(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, open_dir: Path
) -> None:
    need_root()
    sock = str(open_dir / "edged.sock")

    def attempt() -> Any:
        c = Client(sock)
        out: dict[str, object] = {}
        for action in ("unload", "load"):
            status, data, _ = c.request("POST", f"/v2/repository/models/tiny/{action}", b"")
            out[action] = [status, orjson.loads(data).get("code")]
        out["index"] = c.request("POST", "/v2/repository/index", b"")[0]
        out["infer"] = c.infer("tiny", {"x": np.zeros((1, 16), np.float32)})["probs"].shape[1]
        return out

    with temp_group() as access, temp_group() as admins, temp_user((admins,)) as alice, temp_user() as bob:
        d = daemon_factory(
            {"tiny": {"path": str(model_dir / "tiny.onnx")}},
            extra={"server": {"socket": sock, "socket_group": access, "admin_group": admins}},
        )
        d.socket = Path(sock)
        d.start()
        a, b = AsUser(alice, [attempt], (access,)), AsUser(bob, [attempt], (access,))
        try:
            as_bob = b.call(attempt)
            as_alice = a.call(attempt)
        finally:
            a.close()
            b.close()
        with d.client() as root:
            root.unload("tiny")
            root.load("tiny")
    assert as_bob == {"unload": [403, "forbidden"], "load": [403, "forbidden"], "index": 200, "infer": 4}
    assert as_alice == {"unload": [200, None], "load": [200, None], "index": 200, "infer": 4}
