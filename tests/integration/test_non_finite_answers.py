"""Non-finite floats in JSON answers are read by Triton's and KServe's own clients, on a real
daemon: edged writes them as "NaN", "Infinity" and "-Infinity" (protobuf's JSON form), which
tritonclient and the KServe SDK both turn back into floats; bare NaN, as Triton writes it, is not
JSON, and the KServe SDK (orjson) and JSON.parse refuse the whole answer."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest
import tritonclient.http as tritonhttp

from edged.tools.demo import save_graph
from tests.helpers import DaemonProcess
from tests.integration.test_listeners import free_port

pytestmark = pytest.mark.integration

X = np.array([[1.5, np.nan, np.inf, -np.inf]], np.float32)


def make_passthrough(path: Path) -> Path:
    """y = x, FP32 [1, 4]: whatever goes in comes back, non-finite values included."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "passthrough",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    save_graph(graph, path)
    return path


@pytest.fixture
def served(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> tuple[DaemonProcess, int]:
    port = free_port()
    model = make_passthrough(tmp_path / "p.onnx")
    d = daemon_factory({"p": {"path": str(model)}}, extra={"server": {"tcp": [f"127.0.0.1:{port}"]}}).start()
    return d, port


def same(got: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == (1, 4)
    assert got[0, 0] == 1.5 and math.isnan(got[0, 1]) and got[0, 2] == math.inf and got[0, 3] == -math.inf


def test_the_answer_is_strict_json(served: tuple[DaemonProcess, int]) -> None:
    d, _ = served
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.5, 0, 0, 0]}]})
    body = body.replace(b"[1.5,0,0,0]", b"[1.5,NaN,Infinity,-Infinity]")  # as Python's json writes them
    with d.client() as c:
        status, data, _ = c.request("POST", "/v2/models/p/infer", body, {"Content-Type": "application/json"})
    assert status == 200, data
    assert orjson.loads(data)["outputs"][0]["data"] == [1.5, "NaN", "Infinity", "-Infinity"]


def test_tritonclient_reads_non_finite_answers(served: tuple[DaemonProcess, int]) -> None:
    _, port = served
    client = tritonhttp.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        inp = tritonhttp.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(X, binary_data=False)
        out = tritonhttp.InferRequestedOutput("y", binary_data=False)
        same(client.infer("p", [inp], outputs=[out]).as_numpy("y"))
    finally:
        client.close()


# The KServe SDK's own protocol buffers define the `inference` package that Triton's (tritonclient.grpc,
# edged's gRPC service) define too, and protobuf refuses a second definition of a name in one
# process: the SDK runs in a process of its own.
KSERVE_CLIENT = """
import asyncio, json, sys
import httpx, numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

async def infer():
    transport = httpx.AsyncHTTPTransport(uds=sys.argv[1])
    client = InferenceRESTClient(RESTConfig(transport=transport, protocol="v2", retries=0))
    try:
        inp = InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(np.array([[1.5, 0, 0, 0]], np.float32), binary_data=False)
        inp.data = [1.5, "NaN", "Infinity", "-Infinity"]  # the SDK's own JSON cannot hold bare NaN
        response = await client.infer("http://edged", InferRequest("p", [inp]), model_name="p")
        got = response.outputs[0].as_numpy()
        print(json.dumps({"dtype": str(got.dtype), "shape": list(got.shape), "values": [repr(float(v)) for v in got.ravel()]}))
    finally:
        await client.close()

asyncio.run(infer())
"""


def test_the_kserve_sdk_reads_non_finite_answers(served: tuple[DaemonProcess, int]) -> None:
    d, _ = served
    run = subprocess.run(
        [sys.executable, "-c", KSERVE_CLIENT, str(d.socket)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    got = orjson.loads(run.stdout.strip().splitlines()[-1])
    assert got["dtype"] == "float32" and got["shape"] == [1, 4]
    values = np.array([float(v) for v in got["values"]], np.float32).reshape(1, 4)
    same(values)
