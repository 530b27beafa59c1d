"""The Unix relay's side that reads before grpcio's side is connected holds a flood in the kernel
rather than in the daemon (pure logic: a fake transport records what the pipe asks of it)."""

from __future__ import annotations

from edged.transports.budget import BodyBudget
from edged.transports.grpc.peers import _EARLY_MAX, _Pipe
from edged.transports.grpc.unfinished import Unfinished


class FakeTransport:
    def __init__(self) -> None:
        self.paused = False
        self.written: list[bytes] = []

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written.append(data)


def test_reading_pauses_at_the_early_limit_and_resumes_once_flushed() -> None:
    # grpcio's side (what it reads is not counted): a flood before the client's side connects.
    pipe, client = _Pipe(Unfinished(BodyBudget(1 << 30)), False, lambda why, reason: None), FakeTransport()
    pipe.connection_made(client)  # type: ignore[arg-type]
    pipe.data_received(b"x" * (_EARLY_MAX - 1))
    assert not client.paused
    pipe.data_received(b"yy")
    assert client.paused and pipe.early_bytes == _EARLY_MAX + 1
    inner = FakeTransport()
    pipe.flush_to(inner)
    assert b"".join(inner.written) == b"x" * (_EARLY_MAX - 1) + b"yy"
    assert not client.paused and pipe.early == [] and pipe.early_bytes == 0
