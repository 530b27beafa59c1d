"""A client process that keeps a daemon's event loop busy: CONNECTIONS connections, each sending
DEPTH requests for model ``m`` (input x, ones of (1, 16)) pipelined at a time, until it is killed.
A separate process, so that its own Python does not compete with the test's for a GIL: threads of
the test process left the loop idle between their requests. Exits 1, saying why on stderr, at the
first answer that is not a 200.

    python -m tests.integration.flood SOCKET [CONNECTIONS] [DEPTH]
"""

from __future__ import annotations

import socket
import sys
import threading

import numpy as np

from edged.client import encode_request


def request() -> bytes:
    body, headers = encode_request({"x": np.ones((1, 16), np.float32)}, ["probs"])
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def exactly(s: socket.socket, size: int, buf: bytes = b"") -> bytes:
    while len(buf) < size:
        chunk = s.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        buf += chunk
    return buf


def one_answer(s: socket.socket) -> bytes:
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf = exactly(s, len(buf) + 1, buf)
    head = buf.partition(b"\r\n\r\n")[0]
    length = next(int(h[15:]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))
    return exactly(s, len(head) + 4 + length, buf)


def flood(path: str, depth: int, failed: threading.Event) -> None:
    req = request()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(path)
            s.sendall(req)
            size = len(one_answer(s))  # every answer has the same length
            while True:
                s.sendall(req * depth)
                got = exactly(s, size * depth)
                if got.count(b"HTTP/1.1 200 ") != depth:
                    raise RuntimeError(f"an answer that is not a 200: {got[:300]!r}")
    except Exception as e:
        print(f"flood: {e!r}", file=sys.stderr, flush=True)
        failed.set()


def main() -> None:
    path = sys.argv[1]
    connections = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    depth = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    failed = threading.Event()
    for _ in range(connections):
        threading.Thread(target=flood, args=(path, depth, failed), daemon=True).start()
    failed.wait()
    sys.exit(1)


if __name__ == "__main__":
    main()
