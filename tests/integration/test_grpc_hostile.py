"""Hostile gRPC clients are bounded like HTTP ones: a message over server.max_body, a stream
past its request cap, more RPCs than server.grpc_max_streams, and a peer that stops reading
(cut off after server.grpc_write_timeout_s while the daemon serves others)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.proto import grpc_service_pb2_grpc as pbg
from tests.helpers import DaemonProcess, wait_for, write_config

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
    other, other_stub = _stub(served[1])
    with ch, other:
        # An RPC of the test before may still hold its slot a moment after its client saw it end.
        streams = [wait_for(open_held, 30, what="a held stream") for _ in range(2)]
        with pytest.raises(grpc.RpcError) as e:
            other_stub.ModelInfer(_request(), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
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
