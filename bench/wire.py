"""What goes on the wire, and a closed-loop load generator that adds as little as it can.

Every server gets the same client: pre-encoded HTTP/1.1 requests on keep-alive connections, a
response read by its Content-Length and nothing decoded on the timed path, so the figures are the
servers', not a client library's. Requests are the Open Inference Protocol with the binary tensor
extension for edged and Triton, and raw bytes for the hand-written FastAPI server. Frames travel
through a POSIX shared memory region per connection where the server offers it: the producer's
copy into the region is inside the timed request.
"""

from __future__ import annotations

import json
import select
import selectors
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from edged.client import encode_request
from edged.client.shm import ShmTensor
from edged.wire.tensors import datatype_of

Address = str | tuple[str, int]  # a Unix socket path or (host, port)


def http_bytes(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# How a client writes its requests (``v2_request``): tensors in the binary extension; the same with
# a request id, as tritonclient's request_id and edged.client's; the values in the JSON document
# with JSON answers, as curl and simple clients send them.
FORMS = ("binary", "numbered", "json")


def v2_request(
    model: str, name: str, value: np.ndarray | ShmTensor, outputs: Sequence[str], form: str = "binary"
) -> bytes:
    """An Open Inference Protocol request (edged and Triton alike), written in ``form`` (FORMS)."""
    path = f"/v2/models/{model}/infer"
    if form == "json" and isinstance(value, np.ndarray):
        tensor = {"name": name, "datatype": datatype_of(value.dtype), "shape": list(value.shape)}
        doc = {"inputs": [dict(tensor, data=value.reshape(-1).tolist())], "outputs": [{"name": o} for o in outputs]}
        return http_bytes(path, json.dumps(doc).encode(), {"Content-Type": "application/json"})
    body, headers = encode_request({name: value}, list(outputs), "bench-7" if form == "numbered" else "")
    return http_bytes(path, body, headers)


def v2_request_in_place(model: str, name: str, value: ShmTensor, output: str, offset: int, nbytes: int) -> bytes:
    """A request whose input is in a registered region and whose answer is written there too, at
    ``offset``: the response carries only the JSON header (edged and Triton alike)."""
    where = {"shared_memory_region": value.region, "shared_memory_byte_size": nbytes, "shared_memory_offset": offset}
    doc = {"inputs": [value.meta(name)], "outputs": [{"name": output, "parameters": where}]}
    return http_bytes(f"/v2/models/{model}/infer", json.dumps(doc).encode(), {"Content-Type": "application/json"})


def raw_request(model: str, x: np.ndarray) -> bytes:
    """The hand-written server's request: the tensor's bytes, its shape in a header."""
    shape = ",".join(map(str, x.shape))
    return http_bytes(
        f"/infer/{model}",
        np.ascontiguousarray(x).tobytes(),
        {"Content-Type": "application/octet-stream", "X-Shape": shape},
    )


def connect(addr: Address, timeout: float = 30.0) -> socket.socket:
    if isinstance(addr, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)
    sock.connect(addr)
    return sock


class _Reader:
    """Accumulates one HTTP/1.1 response; ``feed`` returns True once it is complete."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.need = -1
        self.head = b""

    def feed(self, chunk: bytes) -> bool:
        self.buf += chunk
        if self.need < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            self.head = bytes(self.buf[:end])
            lower = self.head.lower()
            at = lower.find(b"\r\ncontent-length:")
            if at < 0:
                raise RuntimeError(f"no Content-Length in {self.head[:200]!r}")
            self.need = end + 4 + int(lower[at + 17 :].split(b"\r\n", 1)[0])
        return len(self.buf) >= self.need

    def done(self) -> tuple[bytes, bytes]:
        if not self.head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{self.head[:200]!r}: {bytes(self.buf[len(self.head) + 4 :])[:300]!r}")
        head, body = self.head, bytes(self.buf[len(self.head) + 4 : self.need])
        self.buf, self.need, self.head = bytearray(), -1, b""
        return head, body


def roundtrip(sock: socket.socket, request: bytes) -> tuple[bytes, bytes]:
    """One blocking request on a connection: (response head, body)."""
    sock.sendall(request)
    reader = _Reader()
    while not reader.feed(sock.recv(1 << 20)):
        pass
    return reader.done()


def decode_v2(head: bytes, body: bytes) -> dict[str, np.ndarray]:
    from edged.client import decode_response

    lower = head.lower()
    at = lower.find(b"inference-header-content-length:")
    hl = int(lower[at + 32 :].split(b"\r\n", 1)[0]) if at >= 0 else None
    return decode_response(body, hl)


def decode_raw(head: bytes, body: bytes) -> np.ndarray:
    lower = head.lower()
    at = lower.find(b"x-shape:")
    shape = tuple(int(d) for d in lower[at + 8 :].split(b"\r\n", 1)[0].strip().split(b","))
    return np.frombuffer(body, np.float32).reshape(shape)


@dataclass
class Conn:
    """One client of a load run: where it connects, its request and what runs before each send
    (the producer's copy into this client's shared memory region, if any). The connection is
    opened for each run, untimed: servers close keep-alive connections that idle between runs."""

    addr: Address
    request: bytes
    before: Callable[[], None] | None = None
    reader: _Reader = field(default_factory=_Reader)
    sent_at: float = 0.0
    sock: socket.socket = field(init=False)


def closed_loop(conns: Sequence[Conn], max_requests: int, max_seconds: float) -> tuple[list[float], float]:
    """Keep every connection busy (one request in flight each) until either bound; return the
    latencies in seconds and the wall time of the run."""
    for c in conns:
        c.sock = connect(c.addr)
    try:
        return _loop(conns, max_requests, max_seconds)
    finally:
        for c in conns:
            c.sock.close()
            c.reader = _Reader()


def _loop(conns: Sequence[Conn], max_requests: int, max_seconds: float) -> tuple[list[float], float]:
    sel = selectors.DefaultSelector()
    latencies: list[float] = []
    started = time.perf_counter()
    deadline = started + max_seconds
    issued = 0
    for c in conns:
        c.sock.setblocking(False)
        sel.register(c.sock, selectors.EVENT_READ, c)
        _send(c)
        issued += 1
    try:
        while sel.get_map():
            for key, _ in sel.select(timeout=max_seconds + 30):
                c = key.data
                if not c.reader.feed(c.sock.recv(1 << 20)):
                    continue
                latencies.append(time.perf_counter() - c.sent_at)
                c.reader.done()
                if issued < max_requests and time.perf_counter() < deadline:
                    _send(c)
                    issued += 1
                else:
                    sel.unregister(c.sock)
    finally:
        sel.close()
    return latencies, time.perf_counter() - started


def _send(c: Conn) -> None:
    c.sent_at = time.perf_counter()
    if c.before is not None:
        c.before()
    view = memoryview(c.request)
    while view:  # a frame-sized body fills the socket buffer: wait for room, nothing else to do
        try:
            view = view[c.sock.send(view) :]
        except BlockingIOError:
            select.select([], [c.sock], [], 30)
