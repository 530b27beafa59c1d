"""ModelStreamInfer with the real SmolLM2 language model, decoupled as Triton's vLLM backend
answers: one response per piece of text, then a final one with triton_final_response."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tritongrpc

from tests.helpers import DaemonProcess
from tests.integration.test_llm import daemon, http, llm_model, smollm2

pytestmark = pytest.mark.integration
__all__ = ["smollm2"]  # a fixture: imported so that pytest finds it


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Iterator[DaemonProcess]:
    d = daemon(tmp_path_factory.mktemp("grpc_llm"), {"llm": llm_model(smollm2)}).start(timeout=240)
    yield d
    assert d.stop() == 0, d.log()


def test_stream_infer_sends_pieces_then_a_final_response(edge: DaemonProcess) -> None:
    body = {"text_input": "The capital of France is", "parameters": {"max_tokens": 16, "temperature": 0.8, "seed": 7}}
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
