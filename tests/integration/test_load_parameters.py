"""tritonclient's load_model with a configuration or files is refused as Triton refuses what it
cannot load ("failed to load", 400), never silently ignored; a malformed body is a 400 as well; a
plain load and one with no parameters still load, on a real daemon over TCP."""

from __future__ import annotations

import json

import pytest
import tritonclient.http as tritonhttp
from tritonclient.utils import InferenceServerException

from tests.integration.test_listeners import tcp
from tests.integration.test_tritonclient import Served, served

pytestmark = pytest.mark.integration
__all__ = ["served"]  # a fixture: imported so that pytest finds it


def test_load_with_a_config_is_refused_by_name(served: Served) -> None:
    port = served.ports["http"]
    client = tritonhttp.InferenceServerClient(url=f"127.0.0.1:{port}")
    try:
        with pytest.raises(InferenceServerException, match="failed to load 'tiny': config in a load request"):
            client.load_model("tiny", config=json.dumps({"max_batch_size": 8}))
        with pytest.raises(InferenceServerException, match="failed to load 'tiny': file:1/model.onnx"):
            client.load_model("tiny", files={"file:1/model.onnx": b"\x00"})
        client.load_model("tiny")  # no parameters: loads as ever
        assert client.is_model_ready("tiny")
    finally:
        client.close()


def test_a_malformed_load_body_is_refused(served: Served) -> None:
    port = served.ports["http"]
    status, data = tcp(port, "POST", "/v2/repository/models/tiny/load", b'{"parameters": ')
    assert status == 400 and b"failed to load 'tiny'" in data
    assert tcp(port, "POST", "/v2/repository/models/tiny/load", b"{}")[0] == 200
