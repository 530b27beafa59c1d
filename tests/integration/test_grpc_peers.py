"""The gRPC socket's connections are shared per user, as the HTTP socket's are: one user holding
every connection it can open keeps to its share (server.max_connections_per_peer), and another
user's client is served meanwhile (tests/integration/grpc_as_user.py, a process of that user)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import DaemonProcess, closed_by_peer, wait_for
from tests.integration.grpc_as_user import GrpcUser
from tests.integration.users import need_root, temp_group, temp_user

pytestmark = pytest.mark.integration


def test_one_user_keeps_to_its_share_of_the_grpc_socket(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, open_dir: Path
) -> None:
    need_root()
    sock = open_dir / "edged.sock"
    with temp_group() as group, temp_user() as bob:
        d = daemon_factory(
            {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
            extra={
                "server": {
                    "socket": str(sock),
                    "socket_group": group,
                    "max_connections": 6,
                    "max_connections_per_peer": 2,
                }
            },
        )
        d.socket = sock
        d.start()
        hogs = []
        try:
            for _ in range(6):  # all of max_connections, as root
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(f"{sock}.grpc")
                hogs.append(s)
            wait_for(lambda: sum(map(closed_by_peer, hogs)) == 4, 30, what="root's connections past its share closed")
            assert not any(map(closed_by_peer, hogs[:2])), "a connection within root's share was closed"
            b = GrpcUser(bob, group, Path(f"{sock}.grpc"))
            try:
                assert b("status") == {"ok": []}, "another user was not served while root held its share"
            finally:
                b.close()
        finally:
            for s in hogs:
                s.close()
