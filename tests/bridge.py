"""A TCP port forwarded to a Unix socket by the test process, as ``socat TCP-LISTEN:PORT,fork
UNIX-CONNECT:SOCKET`` does: tritonclient.http speaks only host:port, and shared memory needs a
peer with a user id and a process (SO_PEERCRED), which a TCP peer has not. Through the bridge the
daemon's peer is the test process, of the same user as the client that made the region."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path


class Bridge:
    def __init__(self, unix_path: Path) -> None:
        self.unix_path = unix_path
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self.sockets: list[socket.socket] = [self.server]
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                tcp, _ = self.server.accept()
            except OSError:
                return  # closed
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            unix.connect(str(self.unix_path))
            self.sockets += [tcp, unix]
            for src, dst in ((tcp, unix), (unix, tcp)):
                t = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                t.start()
                self.threads.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self.threads:
            t.join(10)
