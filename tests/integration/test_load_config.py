"""Loads that carry a configuration and files (Triton's model repository extension), through
tritonclient's HTTP and gRPC clients against a real daemon serving a Triton repository
(tests/triton_models.py): a config in place of config.pbtxt serves at once and reads back in
ModelConfig, a plain load puts the repository's back, a config edged refuses leaves what serves
untouched, uploaded files serve a new model within server.model_uploads, and a load's file paths
are checked before anything is written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tritongrpc
import tritonclient.http as tritonhttp
from tritonclient.utils import InferenceServerException

from tests.helpers import DaemonProcess, wait_for, write_config
from tests.integration.test_listeners import tcp
from tests.integration.test_triton_examples import free_port
from tests.repository import reference
from tests.triton_models import example_repository

pytestmark = pytest.mark.integration


@dataclass
class Served:
    daemon: DaemonProcess
    http: int
    grpc: int
    cache: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("loadcfg")
    http, grpc = free_port(), free_port()
    cfg = write_config(
        tmp / "edged.toml",
        {
            "server": {
                "socket": str(tmp / "edged.sock"),
                "tcp": [f"127.0.0.1:{http}"],
                "grpc_tcp": [f"127.0.0.1:{grpc}"],
                "model_repository": str(example_repository(tmp / "repository")),
                "model_uploads": 1,
            },
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
        },
    )
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log").start()
    try:
        yield Served(d, http, grpc, tmp / "cache")
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture
def http(served: Served) -> Iterator[tritonhttp.InferenceServerClient]:
    c = tritonhttp.InferenceServerClient(url=f"127.0.0.1:{served.http}")
    yield c
    c.close()


@pytest.fixture
def grpc(served: Served) -> Iterator[tritongrpc.InferenceServerClient]:
    c = tritongrpc.InferenceServerClient(url=f"127.0.0.1:{served.grpc}")
    yield c
    c.close()


def _sum(client: Any, module: Any, rows: int, model: str = "simple") -> np.ndarray:
    a = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
    inputs = [module.InferInput(n, [rows, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(a)
    out = client.infer(model, inputs).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, a + a)
    return out


def _max_batch(grpc: tritongrpc.InferenceServerClient, name: str = "simple") -> int:
    return int(grpc.get_model_config(name).config.max_batch_size)


def _note(served: Served, name: str = "simple") -> str:
    status, body = tcp(served.http, "GET", "/v2/edged/status")
    assert status == 200
    return str(json.loads(body)["models"][name]["repository"]["note"])


def test_a_config_serves_in_place_of_config_pbtxt(
    served: Served, http: tritonhttp.InferenceServerClient, grpc: tritongrpc.InferenceServerClient
) -> None:
    assert _max_batch(grpc) == 8
    with pytest.raises(InferenceServerException):  # 12 rows: more than config.pbtxt's 8
        _sum(grpc, tritongrpc, 12)
    grpc.load_model("simple", config=json.dumps({"max_batch_size": 16}))
    assert _max_batch(grpc) == 16 and http.get_model_config("simple")["max_batch_size"] == 16
    _sum(grpc, tritongrpc, 12)
    _sum(http, tritonhttp, 12)
    assert _note(served) == "configured by a load request"
    # A load without a config puts the repository's back (HTTP this time).
    http.load_model("simple")
    assert _max_batch(grpc) == 8 and http.is_model_ready("simple") and _note(served) == ""
    with pytest.raises(InferenceServerException):
        _sum(http, tritonhttp, 12)


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ('{"sequence_batching": {}}', "sequence_batching is not supported"),
        ('{"max_batch_size": 9000}', "edged batches at most 4096 rows"),
        ('{"max_batch_size": "x"}', "config: Failed to parse max_batch_size field"),
        ('{"no_such_field": 1}', 'has no field named "no_such_field"'),
        ('{"name": "other"}', "'other' is not the model's name 'simple'"),
        ('"parameters": {"config": {{"max_batch_size": "16"}}}', "config: Failed to load JSON"),
    ],
)
def test_a_config_edged_refuses_changes_nothing(
    grpc: tritongrpc.InferenceServerClient, http: tritonhttp.InferenceServerClient, config: str, said: str
) -> None:
    for client in (grpc, http):
        with pytest.raises(InferenceServerException) as e:
            client.load_model("simple", config=config)
        assert "failed to load 'simple'" in e.value.message() and said in e.value.message(), e.value.message()
    assert _max_batch(grpc) == 8 and grpc.is_model_ready("simple")
    _sum(grpc, tritongrpc, 8)


def test_uploaded_files_serve_a_new_model(
    served: Served, http: tritonhttp.InferenceServerClient, grpc: tritongrpc.InferenceServerClient, model_dir: Path
) -> None:
    onnx = (model_dir / "tiny.onnx").read_bytes()
    config = json.dumps({"platform": "onnxruntime_onnx"})
    http.load_model("uploaded", config=config, files={"file:1/model.onnx": onnx})
    assert grpc.is_model_ready("uploaded")
    x = np.ones((1, 16), np.float32)
    inp = tritongrpc.InferInput("x", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    got = grpc.infer("uploaded", [inp]).as_numpy(grpc.get_model_metadata("uploaded").outputs[0].name)
    np.testing.assert_allclose(got, reference(model_dir / "tiny.onnx", x), rtol=1e-5)
    # server.model_uploads = 1: a second model with files of its own waits for the first to go.
    with pytest.raises(InferenceServerException) as e:
        grpc.load_model("another", config=config, files={"file:1/model.onnx": onnx})
    assert "server.model_uploads = 1" in e.value.message() and e.value.status() == "StatusCode.PERMISSION_DENIED"
    # Uploaded again under the same name: the new files replace the old, whose folder goes.
    grpc.load_model("uploaded", config=config, files={"file:1/model.onnx": onnx})
    assert len([p for p in (served.cache / "uploads").iterdir() if p.name.startswith("uploaded.")]) == 1
    # A load without a config keeps them (the repository has no such model); an unload drops
    # them and the model with them, which makes room for another.
    http.load_model("uploaded")
    assert grpc.is_model_ready("uploaded")
    grpc.unload_model("uploaded")
    assert "uploaded" not in {m.name for m in grpc.get_model_repository_index().models}
    assert not [p for p in (served.cache / "uploads").iterdir() if p.name.startswith("uploaded.")]
    grpc.load_model("another", config=config, files={"file:1/model.onnx": onnx})
    grpc.unload_model("another")


@pytest.mark.parametrize(
    ("files", "status", "said"),
    [
        ({"file:" + "A" * 256: b"a"}, "INTERNAL", "failed to poll from model repository"),
        ({"file:../escape.onnx": b"a"}, "INTERNAL", "'..' component"),
        ({"file:/etc/model.onnx": b"a"}, "INTERNAL", "not a relative path"),
        ({"file:1/model.plan": b"a"}, "INVALID_ARGUMENT", "edged builds TensorRT engines on this device"),
        ({"file:1/model.onnx": b"not onnx"}, "INVALID_ARGUMENT", "not an ONNX model"),
    ],
)
def test_a_loads_files_are_checked(
    served: Served, grpc: tritongrpc.InferenceServerClient, files: dict[str, bytes], status: str, said: str
) -> None:
    with pytest.raises(InferenceServerException) as e:
        grpc.load_model("fresh", config="{}", files=files)
    assert e.value.status() == f"StatusCode.{status}" and said in e.value.message(), e.value.message()
    assert grpc.is_server_live() and not grpc.is_model_ready("fresh")
    area = served.cache / "uploads"
    assert not area.exists() or not [p for p in area.iterdir() if p.name.startswith(("fresh", ".fresh"))]


def test_a_name_that_is_a_path_is_refused_before_any_file_is_written(
    served: Served, grpc: tritongrpc.InferenceServerClient, model_dir: Path
) -> None:
    before = sorted(p.name for p in served.cache.parent.iterdir())
    for name in ("/../../escaped", "../escaped", "a/b"):
        with pytest.raises(InferenceServerException) as e:
            grpc.load_model(name, config="{}", files={"file:1/model.onnx": (model_dir / "tiny.onnx").read_bytes()})
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "a model's name is" in e.value.message()
    assert sorted(p.name for p in served.cache.parent.iterdir()) == before
    area = served.cache / "uploads"
    assert not area.exists() or not [p for p in area.iterdir() if "escaped" in p.name]


def test_a_config_names_files_of_its_folders_only(grpc: tritongrpc.InferenceServerClient, model_dir: Path) -> None:
    outside = str(model_dir / "tiny.onnx")
    for config, said in [
        ({"default_model_filename": outside}, "default_model_filename"),
        ({"default_model_filename": ".."}, "default_model_filename"),
    ]:
        with pytest.raises(InferenceServerException) as e:
            grpc.load_model("simple_flat", config=json.dumps(config))
        assert said in e.value.message() and "is not a file name of the version folder" in e.value.message()
    assert grpc.get_model_metadata("simple_flat").inputs[0].name == "INPUT0"


def test_a_load_whose_client_gives_up_still_ends_in_step(
    served: Served, grpc: tritongrpc.InferenceServerClient, model_dir: Path
) -> None:
    """A client's deadline cancels the RPC mid-load: the load runs to its end anyway, so the
    override and the files agree and later reloads work."""
    onnx = (model_dir / "tiny.onnx").read_bytes()
    config = json.dumps({"platform": "onnxruntime_onnx"})
    area = served.cache / "uploads"
    cancelled = 0
    for timeout in (0.005, 0.02, 0.05, 0.1):
        try:
            grpc.load_model("late", config=config, files={"file:1/model.onnx": onnx}, client_timeout=timeout)
        except InferenceServerException as e:
            assert e.status() == "StatusCode.DEADLINE_EXCEEDED", e.message()
            cancelled += 1

        def settled() -> bool:
            folders = [p for p in area.iterdir() if "late" in p.name] if area.exists() else []
            return grpc.is_model_ready("late") == (len(folders) == 1) and len(folders) <= 1

        wait_for(settled, what="the load's files and the model agree")
    assert cancelled > 0  # at least one deadline ran out on the way
    grpc.load_model("simple", config=json.dumps({"max_batch_size": 12}))  # reloads still work
    assert _max_batch(grpc) == 12
    grpc.load_model("simple")
    if grpc.is_model_ready("late"):
        grpc.unload_model("late")
    assert not [p for p in area.iterdir() if "late" in p.name]
