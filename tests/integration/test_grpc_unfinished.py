"""Request messages that never finish are bounded on the gRPC listeners (the Unix socket and
TCP) as HTTP bodies are: what grpcio buffers of them counts against server.bodies_in_flight, and
one must arrive whole within server.read_timeout_s. A raw HTTP/2 peer (h2) opens messages that
announce more than it sends, against a real daemon; past either bound its connection is closed,
and everyone else is served."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest

from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.proto import grpc_service_pb2_grpc as pbg
from tests.helpers import DaemonProcess, grpc_call_headers, sample, wait_for, write_config

pytestmark = pytest.mark.integration

MiB = 1 << 20


Address = Path | tuple[str, int]  # the gRPC Unix socket, or a grpc_tcp listener


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _daemon(tmp: Path, model_dir: Path, read_timeout_s: float, port: int, **server: object) -> DaemonProcess:
    """``server``: keys of the [server] table beyond (or in place of) these."""
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {
                "socket": str(tmp / "edged.sock"),
                "max_body": "8MiB",
                "bodies_in_flight": "16MiB",
                "read_timeout_s": read_timeout_s,
                "grpc_tcp": [f"127.0.0.1:{port}"],
                **server,
            },
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
            "models.tiny": {"path": str(model_dir / "tiny.onnx")},
        },
    )
    return DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()


@pytest.fixture(params=["unix", "tcp"])
def patient(request: pytest.FixtureRequest, tmp_path: Path, model_dir: Path) -> Iterator[tuple[DaemonProcess, Address]]:
    """A daemon whose read time-out is far off: only the budget closes connections; its Unix
    socket or its TCP listener."""
    port = _free_port()
    d = _daemon(tmp_path, model_dir, 120.0, port)
    yield d, tmp_path / "edged.sock.grpc" if request.param == "unix" else ("127.0.0.1", port)
    assert d.stop() == 0, d.log()


@pytest.fixture
def hasty(tmp_path: Path, model_dir: Path) -> Iterator[tuple[DaemonProcess, Address]]:
    """A daemon that waits 2 s for a message to arrive whole (over TCP: the Unix socket is
    the same relay)."""
    port = _free_port()
    d = _daemon(tmp_path, model_dir, 2.0, port)
    yield d, ("127.0.0.1", port)
    assert d.stop() == 0, d.log()


class Opener:
    """A raw HTTP/2 client that starts ModelInfer messages announcing ``announced`` bytes and
    sends parts of them, never the whole, as far as the server's flow control lets it."""

    def __init__(self, address: Address, answers_window: int | None = None) -> None:
        if isinstance(address, Path):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(address))
        else:
            self.sock = socket.create_connection(address)
        self.sock.settimeout(0.05)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        if answers_window is not None:  # the window this client grants the daemon's answers
            self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: answers_window})
        self.closed = False
        self.why = ""
        self.sent = 0
        self._flush()

    def open(self, announced: int) -> int:
        sid = self.h2.get_next_available_stream_id()
        headers = grpc_call_headers("ModelInfer")
        self.h2.send_headers(sid, headers)
        self.h2.send_data(sid, b"\0" + announced.to_bytes(4, "big"))
        self._flush()
        return sid

    def send(self, sid: int, n: int) -> int:
        """Up to ``n`` more bytes of the message on ``sid``, as the window allows; how many went."""
        self.pump(wait=0.001)
        room = min(n, self.h2.local_flow_control_window(sid), 256 * 1024)
        if self.closed or room <= 0:
            return 0
        chunk = self.h2.max_outbound_frame_size
        left = room
        while left:
            self.h2.send_data(sid, b"m" * min(chunk, left))
            left -= min(chunk, left)
        self._flush()
        self.sent += room
        return room

    def pump(self, wait: float = 0.05) -> None:
        """Read what the daemon sent (window updates, settings), or see that it closed."""
        if self.closed:
            return
        self.sock.settimeout(wait)
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            return
        except OSError:
            data = b""
        if not data:
            self.why = self.why or "closed by the daemon"
            self.closed = True
            return
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            self.why = f"h2: {e!r}"
            self.closed = True
            return
        for ev in events:
            if isinstance(ev, h2.events.ConnectionTerminated | h2.events.StreamReset):
                self.why = repr(ev)

    def _flush(self) -> None:
        out = self.h2.data_to_send()
        if out and not self.closed:
            self.sock.settimeout(10)  # a send waits for room; only reads are brief
            try:
                self.sock.sendall(out)
            except OSError:
                self.why = self.why or "closed by the daemon"
                self.closed = True

    def pumped(self) -> Opener:
        self.pump()
        return self

    def close(self) -> None:
        self.sock.close()


def _live(address: Address) -> bool:
    target = f"unix:{address}" if isinstance(address, Path) else "{}:{}".format(*address)
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        return bool(pbg.GRPCInferenceServiceStub(ch).ServerLive(pb.ServerLiveRequest(), timeout=10).live)


def test_unfinished_messages_past_the_bodies_budget_close_their_connection(
    patient: tuple[DaemonProcess, Address],
) -> None:
    d, path = patient
    for reason in ("bodies_in_flight", "read_timeout", "frames_per_read", "answer_not_taken", "no_call"):
        assert sample(d, f'edged_grpc_connections_closed_total{{reason="{reason}"}}') == 0
    peer = Opener(path)
    try:
        streams = [peer.open(7 * MiB) for _ in range(4)]
        deadline = time.monotonic() + 100
        while not peer.closed and time.monotonic() < deadline and peer.sent < 28 * MiB - 20:
            for sid in streams:
                peer.send(sid, 7 * MiB)
        # Closed once its messages under way passed the 16 MiB budget, before their 28.
        assert peer.closed and peer.sent < 20 * MiB, (peer.sent, peer.why)
        assert peer.why == "closed by the daemon", peer.why
        assert _live(path)
        wait_for(lambda: "server.bodies_in_flight" in d.log(), 10, what="the closing logged")
        assert sample(d, 'edged_grpc_connections_closed_total{reason="bodies_in_flight"}') == 1
    finally:
        peer.close()


def test_a_message_that_stops_arriving_closes_its_connection(hasty: tuple[DaemonProcess, Address]) -> None:
    d, path = hasty
    peer = Opener(path)
    try:
        sid = peer.open(MiB)
        assert peer.send(sid, 1000) == 1000
        began = time.monotonic()
        wait_for(lambda: peer.pumped().closed, 20, what="the stalled connection closed")
        waited = time.monotonic() - began
        assert 1.5 < waited < 10, waited  # read_timeout_s = 2, swept every half second
        assert _live(path)
        assert sample(d, 'edged_grpc_connections_closed_total{reason="read_timeout"}') == 1
    finally:
        peer.close()


@pytest.fixture
def busy(tmp_path: Path, model_dir: Path) -> Iterator[tuple[DaemonProcess, Address]]:
    """A daemon that waits 2 s for a message to arrive whole and 8 s for a stream's answer to be
    taken, with room for a 64 MiB message."""
    port = _free_port()
    d = _daemon(tmp_path, model_dir, 2.0, port, max_body="96MiB", bodies_in_flight="128MiB", grpc_write_timeout_s=8.0)
    yield d, ("127.0.0.1", port)
    assert d.stop() == 0, d.log()


def test_a_message_waiting_on_a_busy_streams_window_is_not_timed_out(busy: tuple[DaemonProcess, Address]) -> None:
    """grpcio lets a large stream message in only as the stream's handler reads. Here the handler
    is held writing the stream's first answer (the client grants its answers no window): the
    second request, 64 MiB, stops arriving once grpcio's window for it is spent, through no
    fault of its client, and the connection outlives read_timeout_s (2 s) by far, until the
    answer's own time-out ends it."""
    d, address = busy
    peer = Opener(address, answers_window=0)
    try:
        sid = peer.h2.get_next_available_stream_id()
        peer.h2.send_headers(sid, grpc_call_headers("ModelStreamInfer"))
        first = pb.ModelInferRequest(model_name="tiny")
        first.inputs.add(name="x", datatype="FP32", shape=[1, 16])
        first.raw_input_contents.append(b"\0" * 64)
        body = first.SerializeToString()
        peer.h2.send_data(sid, b"\0" + len(body).to_bytes(4, "big") + body)
        peer.h2.send_data(sid, b"\0" + (64 * MiB).to_bytes(4, "big"))
        peer._flush()
        began = time.monotonic()
        while time.monotonic() - began < 5 and not peer.closed:
            peer.send(sid, 64 * MiB)
        assert not peer.closed, (peer.why, peer.sent)
        assert 0 < peer.sent < 64 * MiB  # grpcio let part of it in, then waited on its handler
        assert sample(d, 'edged_grpc_connections_closed_total{reason="read_timeout"}') == 0
    finally:
        peer.close()


@pytest.fixture
def tight(tmp_path: Path, model_dir: Path) -> Iterator[tuple[DaemonProcess, Address]]:
    """A daemon whose gRPC messages under way share an 8 MiB budget and must arrive within 2 s."""
    d = _daemon(tmp_path, model_dir, 2.0, _free_port(), max_body="4MiB", bodies_in_flight="8MiB")
    yield d, tmp_path / "edged.sock.grpc"
    assert d.stop() == 0, d.log()


def _unread(sock: socket.socket) -> int:
    """Bytes the kernel holds for ``sock`` that it has not read."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])


def test_a_client_that_reads_nothing_cannot_hold_the_budget(tight: tuple[DaemonProcess, Address]) -> None:
    """A client that stops reading its answers makes the relay stop reading grpcio's side, window
    grants included: a window that then looks spent proves nothing, so its unfinished message is
    timed as ever, and the connection dropped at the time-out (though its client reads nothing)
    gives the budget back at once, counted once."""
    d, address = tight
    peer = Opener(address)
    try:
        peer.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
        peer.h2.increment_flow_control_window(2**30)
        peer._flush()
        # Calls with 64 KiB answers, never read: they pile up in the relay, which stops reading grpcio.
        req = pb.ModelInferRequest(model_name="tiny")
        req.inputs.add(name="x", datatype="FP32", shape=[4096, 16])
        req.raw_input_contents.append(b"\0" * (4096 * 64))
        body = req.SerializeToString()
        call = b"\0" + len(body).to_bytes(4, "big") + body
        sids = []
        for _ in range(24):  # all but their last byte, reading what grpcio sends meanwhile
            sid = peer.h2.get_next_available_stream_id()
            peer.h2.send_headers(sid, grpc_call_headers("ModelInfer"))
            sent = 0
            while sent < len(call) - 1:
                room = min(peer.h2.local_flow_control_window(sid), len(call) - 1 - sent, 16384)
                if room <= 0:
                    peer.pump(0.02)
                    continue
                peer.h2.send_data(sid, call[sent : sent + room])
                sent += room
                peer._flush()
            sids.append(sid)
        for sid in sids:  # then the last bytes, and no more reading
            peer.h2.send_data(sid, call[-1:], end_stream=True)
        peer._flush()
        # The answers fill what the kernel holds for the client, and then the relay's buffer.
        wait_for(lambda: _unread(peer.sock) > 128 * 1024, 30, what="answers left unread")
        # A message sent exactly up to the window the client last saw, and no more.
        sid = peer.h2.get_next_available_stream_id()
        peer.h2.send_headers(sid, grpc_call_headers("ModelInfer"))
        window = peer.h2.local_flow_control_window(sid)
        stuck = b"\0" + (11 * MiB).to_bytes(4, "big") + b"m" * (window - 5)
        for i in range(0, window, 16384):
            peer.h2.send_data(sid, stuck[i : i + 16384])
            peer._flush()

        def closed() -> float:
            return sum(
                sample(d, f'edged_grpc_connections_closed_total{{reason="{why}"}}')
                for why in ("read_timeout", "answer_not_taken", "bodies_in_flight")
            )

        # Where the relay stops reading grpcio's side, the message is timed out (read_timeout_s
        # and a sweep). Where the kernel takes the answers instead, the relay may see the window
        # spent while grpcio grants no more: then the clock stops for 6 s at most. Where the
        # calls' last bytes come late, their messages under way and this one pass the budget.
        # Whichever bound it meets, the connection goes, and is counted once.
        wait_for(lambda: closed() >= 1, 20, what="the connection dropped")
        time.sleep(1.5)  # three sweeps: a dropped connection is not closed (and counted) again
        assert closed() == 1
        with d.client(timeout=10) as c:  # the budget is free again: a body near it is taken
            doc = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,16],"data":[' + b",".join([b"0"] * 16) + b"]}]}"
            status, _, _ = c.request(
                "POST",
                "/v2/models/tiny/infer",
                body=doc + b" " * (3900 << 10),
                headers={"Content-Type": "application/json"},
            )
        assert status == 200
    finally:
        peer.close()
