"""tritonclient's load_model with a configuration or files, on a daemon that serves no model
repository and takes no uploads (tests/integration/test_load_config.py has one that does): refused
as Triton refuses what it cannot load ("failed to load"), never silently ignored; a malformed body
is a 400 as well; a plain load and one with no parameters still load, on a real daemon over TCP."""

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
        with pytest.raises(InferenceServerException, match=r"failed to load 'tiny': .* edged serves none") as e:
            client.load_model("tiny", config=json.dumps({"max_batch_size": 8}))
        assert e.value.status() == "400"
        with pytest.raises(InferenceServerException, match="failed to load 'tiny': file: parameters need a config"):
            client.load_model("tiny", files={"file:1/model.onnx": b"\x00"})
        with pytest.raises(InferenceServerException, match=r"refused here \(\[server\] model_uploads = 0\)") as e:
            client.load_model("tiny", config="{}", files={"file:1/model.onnx": b"\x00"})
        assert e.value.status() == "403"
        client.load_model("tiny")  # no parameters: loads as ever
        assert client.is_model_ready("tiny")
    finally:
        client.close()


def test_a_malformed_load_body_is_refused(served: Served) -> None:
    port = served.ports["http"]
    status, data = tcp(port, "POST", "/v2/repository/models/tiny/load", b'{"parameters": ')
    assert status == 400 and b"failed to load 'tiny'" in data
    assert tcp(port, "POST", "/v2/repository/models/tiny/load", b"{}")[0] == 200
