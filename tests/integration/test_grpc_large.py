"""Large gRPC messages are answered whole and right without the event loop carrying their
size. Typed contents become one Python object per value: millions of them cost the loop a third
of a second when converted there; here they are converted on a thread, a slice at a time, and no
stall of the loop over lifecycle.loop_stall_ms is counted. A large raw message and its answer
cross unary calls and streams with the same bytes (the answer's raw contents framed by edged,
tests/unit/test_grpc_kserve.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper

from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.proto import grpc_service_pb2_grpc as pbg
from tests.helpers import DaemonProcess, loop_stalls, write_config

pytestmark = pytest.mark.integration

UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def make_two(path: Path) -> None:
    """y = x + 1 and z = x + 2 on a [1, n] FP32 row: two answers as large as the request."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    two = helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])
    row: list[int | str] = [1, "n"]
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"]), helper.make_node("Add", ["x", "two"], ["z"])],
        "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, row)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, row) for n in ("y", "z")],
        initializer=[one, two],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def make_wide(path: Path) -> None:
    """y = x + 1 on a [1, n] FP32 row of any width: an answer as large as its request."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n"])],
        initializer=[one],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, pbg.GRPCInferenceServiceStub]]:
    tmp = tmp_path_factory.mktemp("grpc_large")
    make_wide(tmp / "wide.onnx")
    make_two(tmp / "two.onnx")
    cfg = write_config(
        tmp / "edged.toml",
        {
            # Typed contents are what HTTP carries as JSON: 24 MiB of them need room here.
            "server": {"socket": str(tmp / "edged.sock"), "max_json": "32MiB"},
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
            "models.wide": {"path": str(tmp / "wide.onnx")},
            "models.two": {"path": str(tmp / "two.onnx")},
        },
    )
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()
    with grpc.insecure_channel(f"unix:{tmp / 'edged.sock.grpc'}", options=UNLIMITED) as ch:
        yield d, pbg.GRPCInferenceServiceStub(ch)
    assert d.stop() == 0, d.log()


def _answer(resp: pb.ModelInferResponse) -> np.ndarray:
    (out,) = resp.outputs
    assert out.name == "y" and list(out.shape) == [1, out.shape[1]]
    return np.frombuffer(resp.raw_output_contents[0], np.float32)


def test_millions_of_typed_values_leave_the_loop_free(
    served: tuple[DaemonProcess, pbg.GRPCInferenceServiceStub],
) -> None:
    d, stub = served
    before = loop_stalls(d)
    x = np.arange(6_000_000, dtype=np.float32)
    req = pb.ModelInferRequest(model_name="wide")
    req.inputs.add(name="x", datatype="FP32", shape=[1, x.size]).contents.fp32_contents.extend(x.tolist())
    got = _answer(stub.ModelInfer(req, timeout=120))
    np.testing.assert_array_equal(got, x + 1)
    assert loop_stalls(d) == before, d.log()


def test_a_large_raw_message_is_answered_whole(served: tuple[DaemonProcess, pbg.GRPCInferenceServiceStub]) -> None:
    _, stub = served
    x = np.random.default_rng(7).random(6 << 20, dtype=np.float32)  # 24 MiB
    req = pb.ModelInferRequest(model_name="wide")
    req.inputs.add(name="x", datatype="FP32", shape=[1, x.size])
    req.raw_input_contents.append(x.tobytes())
    np.testing.assert_array_equal(_answer(stub.ModelInfer(req, timeout=120)), x + 1)
    # And through a stream, whose answers are framed the same way.
    (streamed,) = list(stub.ModelStreamInfer(iter([req]), timeout=120))
    assert not streamed.error_message
    np.testing.assert_array_equal(_answer(streamed.infer_response), x + 1)


def test_many_input_headers_are_refused_before_they_are_walked(
    served: tuple[DaemonProcess, pbg.GRPCInferenceServiceStub],
) -> None:
    """200,000 empty input headers (800 KiB): the model's input count refuses them before any
    list of them is walked on the loop (a million held it for 1.5 s there; parsing so many is one
    C call on a thread that holds the interpreter about 12 ms, well under the stall threshold)."""
    d, stub = served
    before = loop_stalls(d)
    req = pb.ModelInferRequest(model_name="wide")
    for _ in range(200_000):
        req.inputs.add()
        req.raw_input_contents.append(b"")
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req, timeout=120)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "200000 inputs" in (e.value.details() or "")
    assert loop_stalls(d) == before, d.log()


def test_an_answer_part_in_shared_memory_part_raw_is_whole(
    served: tuple[DaemonProcess, pbg.GRPCInferenceServiceStub],
) -> None:
    """One output bound for a region, the other (24 MiB) in the message: the message is made on
    a thread, the region written, and both are right."""
    _, stub = served
    x = np.random.default_rng(8).random(6 << 20, dtype=np.float32)
    region = shm.create_shared_memory_region("y", "/edged_grpc_two_y", x.nbytes)
    try:
        stub.SystemSharedMemoryRegister(
            pb.SystemSharedMemoryRegisterRequest(name="y", key="/edged_grpc_two_y", offset=0, byte_size=x.nbytes),
            timeout=30,
        )
        req = pb.ModelInferRequest(model_name="two")
        req.inputs.add(name="x", datatype="FP32", shape=[1, x.size])
        req.raw_input_contents.append(x.tobytes())
        bound = req.outputs.add(name="y")
        bound.parameters["shared_memory_region"].string_param = "y"
        bound.parameters["shared_memory_byte_size"].int64_param = x.nbytes
        req.outputs.add(name="z")
        resp = stub.ModelInfer(req, timeout=120)
        names = [o.name for o in resp.outputs]
        z = np.frombuffer(resp.raw_output_contents[names.index("z")], np.float32)
        np.testing.assert_array_equal(z, x + 2)
        y = shm.get_contents_as_numpy(region, np.float32, [1, x.size])
        np.testing.assert_array_equal(y[0], x + 1)
    finally:
        stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="y"), timeout=30)
        shm.destroy_shared_memory_region(region)
