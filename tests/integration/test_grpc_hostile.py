"""Hostile gRPC clients are bounded like HTTP ones: a message over server.max_body, a stream
past its request cap, more RPCs than server.grpc_max_streams, and a peer that stops reading
(cut off after server.grpc_write_timeout_s while the daemon serves others), on a stream and on
unary calls whose peer grants no flow-control window at all."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import numpy as np
import pytest

from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.proto import grpc_service_pb2_grpc as pbg
from tests.helpers import (
    DaemonProcess,
    closed_by_peer,
    grpc_call_headers,
    running,
    sample,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[tuple[DaemonProcess, Path]]:
    tmp = tmp_path_factory.mktemp("grpc_hostile")
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {
                "socket": str(tmp / "edged.sock"),
                "max_body": "64KiB",
                "grpc_stream_requests": 3,
                "grpc_max_streams": 2,
                "grpc_write_timeout_s": 1.0,
            },
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
            "models.tiny": {"path": str(model_dir / "tiny.onnx")},
        },
    )
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()
    yield d, tmp / "edged.sock.grpc"
    assert d.stop() == 0, d.log()


def _stub(path: Path, **options: int) -> tuple[grpc.Channel, pbg.GRPCInferenceServiceStub]:
    ch = grpc.insecure_channel(f"unix:{path}", options=list(options.items()))
    return ch, pbg.GRPCInferenceServiceStub(ch)


def _request(rows: int = 1) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="tiny")
    req.inputs.add(name="x", datatype="FP32", shape=[rows, 16])
    req.raw_input_contents.append(np.zeros((rows, 16), np.float32).tobytes())
    return req


def test_a_message_over_max_body_is_refused(served: tuple[DaemonProcess, Path]) -> None:
    ch, stub = _stub(served[1])
    with ch:
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(_request(rows=2048), timeout=30)  # 128 KiB of tensor
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=30).live


def test_a_stream_past_its_request_cap_ends(served: tuple[DaemonProcess, Path]) -> None:
    ch, stub = _stub(served[1])
    with ch:
        answers = stub.ModelStreamInfer(iter([_request() for _ in range(5)]), timeout=30)
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for a in answers:
                got.append(a)
        assert len(got) == 3 and all(not a.error_message for a in got)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.grpc_stream_requests" in (e.value.details() or "")


def test_more_rpcs_than_allowed_are_refused(served: tuple[DaemonProcess, Path]) -> None:
    ch, stub = _stub(served[1])
    gate = threading.Event()

    def held() -> Iterator[pb.ModelInferRequest]:
        yield _request()
        gate.wait(30)

    def open_held() -> Iterator[pb.ModelStreamInferResponse]:
        stream = stub.ModelStreamInfer(held(), timeout=60)
        next(stream)  # open and answered once
        return stream

    # The third call goes over a connection of its own: on the connection that holds both
    # streams, HTTP/2's stream limit (the same number) has the client wait instead of sending it.
    other, other_stub = _stub(served[1], **{"grpc.use_local_subchannel_pool": 1})
    with ch, other:
        # An RPC of the test before may still hold its slot a moment after its client saw it end.
        streams = [wait_for(open_held, 30, what="a held stream") for _ in range(2)]
        with pytest.raises(grpc.RpcError) as e:
            other_stub.ModelInfer(_request(), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.grpc_max_streams" in (e.value.details() or "")
        gate.set()
        for s in streams:
            list(s)

        # The client has the streams' last answers a moment before grpcio counts their handlers
        # done: the slot comes back within a deadline, not necessarily at once.
        def served_again() -> bool:
            return stub.ModelInfer(_request(), timeout=30).outputs[0].name == "probs"

        wait_for(served_again, 30, what="a unary call once the streams ended")


def test_a_peer_that_stops_reading_is_cut_off(served: tuple[DaemonProcess, Path]) -> None:
    d, path = served
    # A tiny flow-control window and no reading: the daemon's writes stall, then it cancels.
    ch, stub = _stub(path, **{"grpc.http2.lookahead_bytes": 1024, "grpc.http2.bdp_probe": 0})
    gate = threading.Event()

    def many() -> Iterator[pb.ModelInferRequest]:
        for _ in range(3):
            yield _request(rows=256)  # 4 KiB answers each
        gate.wait(30)

    with ch:
        stream = stub.ModelStreamInfer(many(), timeout=60)
        # Nothing is read from ``stream``: the daemon must give up within its write timeout
        # and keep serving other clients meanwhile.
        other_ch, other = _stub(path)
        with other_ch:
            assert other.ModelInfer(_request(), timeout=30).outputs[0].name == "probs"
        wait_for(lambda: "stream_stalled" in d.log() or "took no response" in d.log(), 30, what="the stall")
        gate.set()
        with pytest.raises(grpc.RpcError):
            list(stream)


class WindowlessPeer:
    """A raw HTTP/2 client (h2) that grants the server no stream window: no answer's data can
    reach it, whatever the daemon writes. It reads every frame (so the connection itself lives)
    and records how each of its calls ended."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.settimeout(0.2)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
        self.ended: dict[int, str] = {}  # stream id: "reset" or its grpc-status
        self.data: dict[int, int] = {}  # stream id: answer bytes received
        self.calls: list[int] = []
        self._flush()

    def call(self, method: str) -> int:
        sid = self.h2.get_next_available_stream_id()
        headers = grpc_call_headers(method)
        self.h2.send_headers(sid, headers)
        self.h2.send_data(sid, b"\x00\x00\x00\x00\x00", end_stream=True)  # an empty message
        self._flush()
        self.calls.append(sid)
        return sid

    def pump(self) -> None:
        """Read what has arrived and note the calls that ended."""
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return
        except OSError:  # reset by the daemon
            chunk = b""
        if not chunk:
            for sid in self.calls:
                self.ended.setdefault(sid, "connection closed")
            return
        for ev in self.h2.receive_data(chunk):
            if isinstance(ev, h2.events.DataReceived):
                self.data[ev.stream_id] = self.data.get(ev.stream_id, 0) + len(ev.data)
            elif isinstance(ev, h2.events.StreamReset):
                self.ended[ev.stream_id] = "reset"
            elif isinstance(ev, h2.events.TrailersReceived | h2.events.ResponseReceived):
                # header_encoding="utf-8": h2 hands the headers over as text
                status = {str(k): str(v) for k, v in ev.headers or ()}.get("grpc-status")
                if status is not None:
                    self.ended[ev.stream_id] = status
        self._flush()

    def _flush(self) -> None:
        out = self.h2.data_to_send()
        if out:
            self.sock.sendall(out)

    def close(self) -> None:
        self.sock.close()


def test_unary_calls_to_a_peer_that_takes_no_data_are_cut_off(served: tuple[DaemonProcess, Path]) -> None:
    """Both of grpc_max_streams' slots taken by unary calls whose answers cannot be delivered:
    each is cancelled after grpc_write_timeout_s and other clients are served again."""
    d, path = served
    cut_before = sample(d, 'edged_grpc_connections_closed_total{reason="answer_not_taken"}')
    peer = WindowlessPeer(path)
    try:
        calls = [peer.call("ServerLive") for _ in range(2)]
        deadline = time.monotonic() + 30
        while not all(c in peer.ended for c in calls) and time.monotonic() < deadline:
            peer.pump()
        assert all(c in peer.ended for c in calls), f"calls still open: {peer.ended}"
        assert all(peer.ended[c] != "0" for c in calls), peer.ended  # none answered OK
        assert not any(peer.data.get(c) for c in calls), "the answer came through a zero window"
        ch, stub = _stub(path)
        with ch:
            live = wait_for(lambda: stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live, 30, what="a free slot")
            assert live
        assert sample(d, 'edged_grpc_connections_closed_total{reason="answer_not_taken"}') > cut_before
    finally:
        peer.close()


def _hog(source: str, port: int) -> socket.socket:
    """A TCP connection from ``source`` (an address of the loopback network) that sends nothing."""
    return socket.create_connection(("127.0.0.1", port), source_address=(source, 0))


def test_tcp_connections_past_a_peers_share_or_their_pool_are_closed(tmp_path: Path, model_dir: Path) -> None:
    """Connections that never send a call (no token is asked before one) cannot take every
    descriptor, nor the Unix socket's connections: one TCP address holds at most
    server.max_connections_per_peer of them, a TCP listener at most server.max_connections, each
    one past either is closed at once, and the Unix socket, a pool of its own, serves as before;
    once they go, TCP serves again."""
    share, pool = 4, 6  # server.max_connections_per_peer, server.max_connections
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = write_config(
        tmp_path / "edged.toml",
        {
            "server": {
                "socket": str(tmp_path / "edged.sock"),
                "max_connections": pool,
                "max_connections_per_peer": share,
                "grpc_tcp": [f"127.0.0.1:{port}"],
            },
            "cache": {"dir": str(tmp_path / "cache")},
            "models.tiny": {"path": str(model_dir / "tiny.onnx")},
        },
    )
    with running(cfg, tmp_path / "edged.sock", tmp_path / "edged.log") as d:
        first = [_hog("127.0.0.1", port) for _ in range(share + 2)]
        wait_for(lambda: sum(map(closed_by_peer, first)) >= 2, 30, what="the connections past the share closed")
        second = [_hog("127.0.0.2", port) for _ in range(3)]  # the pool has room for two more
        hogs = first + second
        try:
            wait_for(lambda: sum(map(closed_by_peer, second)) >= 1, 30, what="the connection past the pool closed")
            assert not any(map(closed_by_peer, first[:share] + second[:2])), "a connection within the limits closed"
            ch, stub = _stub(tmp_path / "edged.sock.grpc")
            with ch:
                assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
        finally:
            for s in hogs:
                s.close()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as tcp:
            live = pbg.GRPCInferenceServiceStub(tcp).ServerLive
            assert wait_for(lambda: live(pb.ServerLiveRequest(), timeout=5).live, 30, what="TCP served again")
        assert d.stop() == 0, d.log()


def test_tcp_connections_without_an_authorised_call_are_closed(tmp_path: Path, model_dir: Path) -> None:
    """A TCP connection shows its token only with a call: one that makes no authorised call
    within server.read_timeout_s of connecting (none at all, or with a wrong token) is closed, as
    an HTTP connection without a request is; one whose call was authorised stays."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("grpc-hostile-token-0123456789")
    token.chmod(0o600)
    cfg = write_config(
        tmp_path / "edged.toml",
        {
            "server": {
                "socket": str(tmp_path / "edged.sock"),
                "read_timeout_s": 2.0,
                "grpc_tcp": [f"127.0.0.1:{port}"],
                "tcp_token_file": str(token),
            },
            "cache": {"dir": str(tmp_path / "cache")},
            "models.tiny": {"path": str(model_dir / "tiny.onnx")},
        },
    )
    closed = 'edged_grpc_connections_closed_total{reason="no_call"}'
    own = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
    with running(cfg, tmp_path / "edged.sock", tmp_path / "edged.log") as d:
        idle = _hog("127.0.0.1", port)
        wrong = grpc.insecure_channel(f"127.0.0.1:{port}", options=own)
        right = grpc.insecure_channel(f"127.0.0.1:{port}", options=own)
        try:
            with pytest.raises(grpc.RpcError) as e:
                pbg.GRPCInferenceServiceStub(wrong).ServerLive(
                    pb.ServerLiveRequest(), timeout=10, metadata=[("authorization", "Bearer nope")]
                )
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            live = pbg.GRPCInferenceServiceStub(right).ServerLive
            auth = [("authorization", "Bearer grpc-hostile-token-0123456789")]
            assert live(pb.ServerLiveRequest(), timeout=10, metadata=auth).live
            wait_for(lambda: closed_by_peer(idle), 20, what="the connection that never called closed")
            wait_for(lambda: sample(d, closed) >= 2, 20, what="the wrong token's connection closed")
            time.sleep(2.5)  # a time-out and more: the authorised connection is not closed with them
            assert sample(d, closed) == 2
        finally:
            idle.close()
            wrong.close()
            right.close()
        assert d.stop() == 0, d.log()
