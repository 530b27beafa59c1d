"""Fair shares of connections, on a real daemon: one peer holding twice its share (idle keep-alive
and silent connections) locks out no other peer and no health check; an unauthenticated TCP client
holds no slot that an authenticated one needs; loopback TCP needs the token once it is set."""

from __future__ import annotations

import contextlib
import http.client
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from edged.client import Client
from tests.helpers import DaemonProcess
from tests.integration.test_hostile_socket import connect, error_of, read_to_eof
from tests.integration.test_listeners import BODY, free_port
from tests.integration.users import AsUser, need_root, temp_group, temp_user

pytestmark = pytest.mark.integration

TOKEN = "share-token-0123456789abcdef"
X = np.full((1, 16), 0.5, np.float32)


@pytest.fixture
def tiny(daemon_factory: Callable[..., DaemonProcess], model_dir: Path) -> Callable[..., DaemonProcess]:
    def start(**server: Any) -> DaemonProcess:
        return daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}, extra={"server": server}).start()

    return start


@contextlib.contextmanager
def held(sockets: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield sockets
    finally:
        for s in sockets:
            s.close()


def keep_alive(path: Path) -> socket.socket:
    """A connection that made one request and stays open (idle keep-alive)."""
    s = connect(path)
    s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b'{"live":true}'):  # the whole answer, head and body
        chunk = s.recv(65536)
        assert chunk, answer
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200")
    return s


def request(s: socket.socket, head: bytes) -> bytes:
    s.sendall(head)
    return read_to_eof(s)


def test_one_peer_holding_twice_its_share_locks_out_no_other_peer(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, open_dir: Path
) -> None:
    need_root()
    sock = str(open_dir / "edged.sock")

    def other_peer() -> Any:
        with Client(sock, timeout=10) as c:
            out = c.infer("tiny", {"x": X})
            return [c.live(), c.ready(), float(next(iter(out.values())).sum())]

    with temp_group() as access, temp_user() as user:
        server = {"socket": sock, "socket_group": access, "max_connections": 64, "max_connections_per_peer": 8}
        d = daemon_factory(
            {"tiny": {"path": str(model_dir / "tiny.onnx")}}, extra={"server": dict(server, reserved_connections=4)}
        )
        d.socket = Path(sock)
        d.start()
        with held([keep_alive(d.socket) for _ in range(4)] + [connect(d.socket) for _ in range(4)]) as mine:
            # 56 more, twice the whole pool in all: two reach the reserve (one health request
            # each), the rest are refused at once.
            extra = [connect(d.socket) for _ in range(56)]
            refused = [error_of(read_to_eof(s)) for s in extra[2:]]
            assert refused == [(503, "too_many_connections")] * 54
            with held(extra[:2]):
                infer = b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
                assert error_of(request(extra[0], infer)) == (503, "too_many_connections")
                assert request(extra[1], b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
                    b"HTTP/1.1 200"
                )
                other = AsUser(user, [other_peer], (access,))
                try:
                    live, ready, total = other.call(other_peer)
                finally:
                    assert other.close() == 0
                assert live and ready and np.isfinite(total)
            # The hog's own connections inside its share keep being served.
            last = request(mine[0], b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert last.startswith(b"HTTP/1.1 200")
        assert "server.max_connections_per_peer" in d.log()
        d.stop()


def test_a_full_pool_still_answers_a_health_check_then_closes(tiny: Callable[..., DaemonProcess]) -> None:
    d = tiny(max_connections=4, reserved_connections=2)
    with held([keep_alive(d.socket) for _ in range(4)]):
        probe = connect(d.socket)
        answer = request(probe, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")  # read to EOF: closed after
        assert answer.startswith(b"HTTP/1.1 200")
        probe.close()
        busy = connect(d.socket)
        assert error_of(request(busy, b"GET /v2/models/tiny HTTP/1.1\r\nHost: x\r\n\r\n")) == (
            503,
            "too_many_connections",
        )
        busy.close()


def tcp_socket(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=15, source_address=(source, 0))
    return s


def tcp_infer(port: int, token: str | None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    conn.request("POST", "/v2/models/tiny/infer", body=BODY, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


@pytest.fixture
def tokened(tiny: Callable[..., DaemonProcess], tmp_path: Path) -> tuple[DaemonProcess, int]:
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    d = tiny(
        tcp=[f"127.0.0.1:{port}"],
        tcp_token_file=str(token_file),
        max_connections=16,
        max_connections_per_peer=8,
        reserved_connections=2,
    )
    return d, port


def test_loopback_tcp_needs_the_token_once_it_is_set(tokened: tuple[DaemonProcess, int]) -> None:
    d, port = tokened
    status, data = tcp_infer(port, None)
    assert status == 401 and orjson.loads(data)["code"] == "unauthorized"
    assert tcp_infer(port, "wrong-token-0123456789abcdef")[0] == 401
    assert tcp_infer(port, TOKEN)[0] == 200
    # Without the token the connection is closed after the 401: it holds no slot.
    s = tcp_socket(port)
    answer = request(s, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 401") and b"Connection: close" in answer.replace(b"connection", b"Connection")
    s.close()
    assert f"tcp 127.0.0.1:{port} (the API, bearer token required)" in d.log()


def test_unauthenticated_connections_hold_no_slot_an_authenticated_one_needs(
    tokened: tuple[DaemonProcess, int],
) -> None:
    d, port = tokened
    # Twice the whole pool, silent, from two loopback addresses (one local user can use any of 127/8).
    flood = [tcp_socket(port, f"127.0.0.{1 + i % 2}") for i in range(32)]
    with held(flood):
        for _ in range(3):
            status, data = tcp_infer(port, TOKEN)
            assert status == 200, data
        with Client(str(d.socket), timeout=10) as c:  # the Unix socket's peers too
            assert c.live() and c.infer("tiny", {"x": X})
    assert "had shown no token" in d.log()
