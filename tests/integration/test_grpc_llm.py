"""ModelStreamInfer with the real SmolLM2 language model, decoupled as Triton's vLLM backend
answers: one response per piece of text, then a final one with triton_final_response, the text
the HTTP generate route gives for the same request; a client that cancels its stream mid-way
frees the model's one slot for the next stream."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tritongrpc

from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.proto import grpc_service_pb2_grpc as pbg
from tests.helpers import DaemonProcess, wait_for
from tests.integration.test_llm import COUNTING, daemon, http, llm_model, smollm2

pytestmark = pytest.mark.integration
__all__ = ["smollm2"]  # a fixture: imported so that pytest finds it


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Iterator[DaemonProcess]:
    models = {
        "llm": llm_model(smollm2),
        "solo": dict(llm_model(smollm2, context=1536, max_tokens_limit=1000), queue_depth=1),
    }
    d = daemon(tmp_path_factory.mktemp("grpc_llm"), models).start(timeout=240)
    yield d
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize(
    "parameters", [{"max_tokens": 16, "temperature": 0}, {"max_tokens": 16, "temperature": 0.8, "seed": 7}]
)
def test_stream_infer_sends_pieces_then_a_final_response(edge: DaemonProcess, parameters: dict[str, Any]) -> None:
    body = {"text_input": "The capital of France is", "parameters": parameters}
    with http(edge) as c:
        whole = c.post("/v2/models/llm/generate", json=body).json()
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tritongrpc.InferenceServerClient(url=f"unix:{edge.socket}.grpc")
    text = tritongrpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"The capital of France is"], dtype=object))
    sampling = tritongrpc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps(body["parameters"]).encode()], dtype=object))
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    pieces: list[str] = []
    try:
        client.async_stream_infer("llm", [text, sampling], request_id="g1", enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            if final:
                assert result.as_numpy("text_output") is None
                break
            out = result.as_numpy("text_output")
            assert out is not None and response.id == "g1"
            pieces.append(out[0].decode())
    finally:
        client.stop_stream()
        client.close()
    assert len(pieces) > 1
    assert "".join(pieces) == whole["text_output"]


def _request(text: str, max_tokens: int) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name="solo", id="c")
    msg.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    raw = text.encode()
    msg.raw_input_contents.append(len(raw).to_bytes(4, "little") + raw)
    msg.parameters["max_tokens"].int64_param = max_tokens
    msg.parameters["temperature"].double_param = 0.0
    return msg


def _held(msg: pb.ModelInferRequest, release: threading.Event) -> Iterator[pb.ModelInferRequest]:
    yield msg
    release.wait(120)  # the stream stays open, as a client's that may send more


def test_a_cancelled_stream_frees_its_slot_for_the_next(edge: DaemonProcess) -> None:
    cancelled = edge.log().count("cancelled after")
    release = threading.Event()
    with grpc.insecure_channel(f"unix:{edge.socket}.grpc") as ch:
        stub = pbg.GRPCInferenceServiceStub(ch)
        call = stub.ModelStreamInfer(_held(_request(COUNTING, 1000), release), timeout=120)
        first = next(call)
        assert not first.error_message and first.infer_response.raw_output_contents
        # The one slot is taken and its queue holds one: a second stream's request would wait.
        call.cancel()
        release.set()
        wait_for(lambda: edge.log().count("cancelled after") > cancelled, 60, what="the generation to stop")
        answers = list(stub.ModelStreamInfer(iter([_request("hi", 2)]), timeout=120))
    assert [a.error_message for a in answers] == [""] * len(answers)
    assert answers[-1].infer_response.parameters["triton_final_response"].bool_param
    line = [x for x in edge.log().splitlines() if "cancelled after" in x][-1]
    assert int(line.split("cancelled after ")[1].split()[0]) < 1000
