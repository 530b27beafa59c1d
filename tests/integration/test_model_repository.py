"""A Triton model repository served as it is by the real daemon, with real ONNX Runtime and
Triton's own clients (HTTP over TCP, gRPC on its Unix socket): two versions with their routes
and the latest as the default,
dynamic batching with a preferred size, an instance group, a model.plan built for another device
falling back to the model.onnx beside it, edged.toml's keys, config.pbtxt fields refused by name,
a reload that finds a new version, and a GGUF language model."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tritongrpc
import tritonclient.http as tritonhttp
from tritonclient.utils import InferenceServerException

from edged.tools.demo import make_tiny_mlp
from tests.helpers import DaemonProcess, wait_for, while_held, write_config
from tests.integration.mosquitto import free_port
from tests.integration.test_llm import smollm2
from tests.repository import (
    CHAT_PBTXT,
    TINY_PBTXT,
    XAVIER,
    identity_model,
    model_folder,
    plan_with_manifest,
    reference,
)

pytestmark = pytest.mark.integration

__all__ = ["smollm2"]  # a fixture: imported so that pytest finds it

VERSIONS_PBTXT = (
    TINY_PBTXT
    + """
version_policy: { all { } }
instance_group [ { count: 2 kind: KIND_CPU } ]
"""
)
# One worker; a batch of 4 runs at once, a batch of 2 or 3 requests waits a minute for company
# (longer than the requests' timeout_ms from edged.toml), and a lone request runs at once.
BATCHED_PBTXT = (
    TINY_PBTXT
    + """
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 60000000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
)
PLAN_PBTXT = TINY_PBTXT.replace('platform: "onnxruntime_onnx"', 'platform: "tensorrt_plan"').replace(
    "dims: [ 16 ] }", "dims: [ 16 ] format: FORMAT_NCHW }"
)
# The model takes and gives [N]; clients send and receive [N, 1] (Triton's reshape example).
FLAT_PBTXT = """max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } } ]
"""
OVERRIDES = """
[models.m]
priority = 90

[models.batched]
timeout_ms = 10000
"""


def config(tmp: Path, repo: Path, **server: Any) -> Path:
    return write_config(
        tmp / "edged.toml",
        {
            "server": {"socket": str(tmp / "edged.sock"), "model_repository": str(repo), **server},
            "cache": {"dir": str(tmp / "cache")},
            "build": {"block_ready": True},
            "lifecycle": {"watch_files": False},
        },
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, int, Path]]:
    tmp = tmp_path_factory.mktemp("repository")
    repo = tmp / "repo"
    model_folder(repo, "m", VERSIONS_PBTXT, {1: "model.onnx", 2: "model.onnx"})
    model_folder(repo, "batched", BATCHED_PBTXT)
    det = model_folder(repo, "det", PLAN_PBTXT)
    plan_with_manifest(det / "1" / "model.plan", "8.5.2", XAVIER)
    identity_model(repo / "flat" / "1" / "model.onnx", ["N"])
    (repo / "flat" / "config.pbtxt").write_text(FLAT_PBTXT)
    (repo / "edged.toml").write_text(OVERRIDES)
    port = free_port()
    # Every model on its worker, which the test-only wedge (edged/lifecycle/faults.py) can hold
    # while tmp/wedge exists, so that requests queue behind it.
    cfg = config(tmp, repo, tcp=[f"127.0.0.1:{port}"], inline_threshold_us=0)
    env = {"EDGED_TEST_WEDGE": str(tmp / "wedge")}
    d = DaemonProcess(cfg, tmp / "edged.sock", tmp / "edged.log", env=env)
    d.start(timeout=120)
    yield d, port, repo
    assert d.stop() == 0, d.log()


@pytest.fixture
def triton(served: tuple[DaemonProcess, int, Path]) -> Iterator[tritonhttp.InferenceServerClient]:
    c = tritonhttp.InferenceServerClient(url=f"127.0.0.1:{served[1]}", network_timeout=30)
    yield c
    c.close()


def infer(
    c: tritonhttp.InferenceServerClient, model: str, x: np.ndarray, version: str = ""
) -> tuple[np.ndarray, dict[str, Any]]:
    inp = tritonhttp.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = c.infer(model, [inp], model_version=version)
    return result.as_numpy("probs"), result.get_response()


def test_both_versions_answer_on_their_routes_and_the_default_is_the_latest(
    served: tuple[DaemonProcess, int, Path], triton: tritonhttp.InferenceServerClient
) -> None:
    repo = served[2]
    x = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
    one, two = (reference(repo / "m" / v / "model.onnx", x) for v in ("1", "2"))
    assert not np.allclose(one, two)  # the two versions are different models
    for version, expected in (("1", one), ("2", two), ("", two)):
        got, head = infer(triton, "m", x, version)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert (head["model_name"], head["model_version"]) == ("m", version or "2")
    assert triton.get_model_metadata("m")["versions"] == ["1", "2"]
    assert triton.get_model_metadata("m", "1")["versions"] == ["1"]
    assert triton.is_model_ready("m", "1") and triton.is_model_ready("m", "2")
    assert not triton.is_model_ready("m", "3")
    index = {(e["name"], e["version"]): e["state"] for e in triton.get_model_repository_index()}
    assert index[("m", "1")] == index[("m", "2")] == "READY"


def test_statistics_and_configuration_name_the_model_and_its_versions(
    triton: tritonhttp.InferenceServerClient,
) -> None:
    infer(triton, "m", np.zeros((1, 16), np.float32), "1")
    stats = triton.get_inference_statistics("m", "1")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("m", "1")] and stats[0]["inference_count"] >= 1
    every = {(s["name"], s["version"]) for s in triton.get_inference_statistics()["model_stats"]}
    assert {("m", "1"), ("m", "2"), ("batched", "1"), ("det", "1")} <= every
    config = triton.get_model_config("m", "1")
    assert (config["name"], config["version_policy"]) == ("m", {"specific": {"versions": [1, 2]}})
    # What DeepStream's gRPC mode reads to lay out its tensors: as config.pbtxt gave it.
    assert (config["max_batch_size"], config["input"][0]["dims"], config["output"][0]["dims"]) == (8, [16], [4])
    assert triton.get_model_config("det")["input"][0]["format"] == "FORMAT_NCHW"


def test_an_instance_group_and_edged_toml_shape_every_version(served: tuple[DaemonProcess, int, Path]) -> None:
    with served[0].client() as c:
        models = c.status()["models"]
    for name, version in (("m", "2"), ("m@1", "1")):
        assert (models[name]["backend"], models[name]["instances"], models[name]["priority"]) == ("onnxruntime", 2, 90)
        assert models[name]["repository"]["model"] == "m" and models[name]["repository"]["version"] == version


def test_a_preferred_batch_runs_as_soon_as_it_forms(served: tuple[DaemonProcess, int, Path]) -> None:
    """Five requests at once behind a held worker: four of them make the preferred size and run
    as one batch, and the one left over runs alone, neither waiting out the minute's delay."""
    d, _, repo = served
    with d.client() as c:
        before = c.status()["models"]["batched"]

    def one(i: int) -> np.ndarray:
        with d.client() as c:
            return c.infer("batched", {"x": np.full((1, 16), i, np.float32)})["probs"]

    def five() -> list[np.ndarray]:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            return list(pool.map(one, range(5)))

    answers = while_held(d, repo.parent / "wedge", "batched", 5, five)
    assert [a.shape for a in answers] == [(1, 4)] * 5
    with d.client() as c:
        after = c.status()["models"]["batched"]
    assert (after["batches"] - before["batches"], after["rows"] - before["rows"]) == (2, 5)


def test_clients_send_and_receive_the_reshaped_dims(served: tuple[DaemonProcess, int, Path]) -> None:
    d = served[0]
    x = np.arange(3, dtype=np.float32).reshape(3, 1)
    with d.client() as c:
        assert c.model_metadata("flat")["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 1]}]
        got = c.infer("flat", {"x": x})["y"]
        status, body, _ = c.request("POST", "/v2/models/flat/infer", _json_body("x", np.zeros((3,), np.float32)))
    np.testing.assert_array_equal(got, x)  # the model's [3] answer, given back as [3, 1]
    assert status == 400 and "input 'x': shape [3] does not match [?, 1]" in body.decode()
    assert "flat: warm-up request answered" not in d.log()  # the daemon's own warm-up sent the dims too


def _json_body(name: str, x: np.ndarray) -> bytes:
    doc = {"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]}
    return json.dumps(doc).encode()


def test_a_batch_larger_than_max_batch_size_is_refused(triton: tritonhttp.InferenceServerClient) -> None:
    with pytest.raises(
        InferenceServerException, match=r"input 'x': shape \[9, 16\] is outside the profile \[1, 16\]..\[8, 16\]"
    ):
        infer(triton, "m", np.zeros((9, 16), np.float32))


def test_a_foreign_plan_falls_back_to_the_onnx_beside_it_and_status_says_so(
    served: tuple[DaemonProcess, int, Path], triton: tritonhttp.InferenceServerClient
) -> None:
    d, _, repo = served
    x = np.ones((1, 16), np.float32)
    got, _ = infer(triton, "det", x)
    np.testing.assert_allclose(got, reference(repo / "det" / "1" / "model.onnx", x), rtol=1e-5, atol=1e-6)
    with d.client() as c:
        det = c.status()["models"]["det"]
    assert det["state"] == "ready"
    note = det["repository"]["note"]
    assert note.startswith("model.plan was built by tensorrt 8.5.2 on Jetson AGX Xavier (nvidia,p2888)")
    assert note.endswith("; serving the model.onnx beside it instead, built for this device")
    shown = subprocess.run(
        [sys.executable, "-m", "edged", "status", "--socket", str(d.socket)], capture_output=True, text=True, check=True
    )
    assert "det (version 1 of det): model.plan was built by tensorrt 8.5.2" in shown.stdout


# --- the same repository through tritonclient.grpc, on the gRPC Unix socket -------------------


@pytest.fixture
def triton_grpc(served: tuple[DaemonProcess, int, Path]) -> Iterator[tritongrpc.InferenceServerClient]:
    c = tritongrpc.InferenceServerClient(url=f"unix:{served[0].socket}.grpc")
    yield c
    c.close()


def infer_grpc(
    c: tritongrpc.InferenceServerClient, model: str, x: np.ndarray, version: str = ""
) -> tuple[np.ndarray, Any]:
    inp = tritongrpc.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = c.infer(model, [inp], model_version=version)
    out = result.as_numpy("probs")
    assert out is not None
    return out, result.get_response()


def test_both_versions_answer_over_grpc_and_the_default_is_the_latest(
    served: tuple[DaemonProcess, int, Path], triton_grpc: tritongrpc.InferenceServerClient
) -> None:
    repo, c = served[2], triton_grpc
    x = np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32)
    one, two = (reference(repo / "m" / v / "model.onnx", x) for v in ("1", "2"))
    for version, expected in (("1", one), ("2", two), ("", two)):
        got, head = infer_grpc(c, "m", x, version)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert (head.model_name, head.model_version) == ("m", version or "2")
    assert list(c.get_model_metadata("m").versions) == ["1", "2"]
    assert list(c.get_model_metadata("m", "1").versions) == ["1"]
    assert c.is_model_ready("m", "1") and c.is_model_ready("m", "2")
    assert not c.is_model_ready("m", "3")
    index = {(e.name, e.version): e.state for e in c.get_model_repository_index().models}
    assert index[("m", "1")] == index[("m", "2")] == "READY"
    config = c.get_model_config("m", "1").config
    assert (config.name, list(config.version_policy.specific.versions)) == ("m", [1, 2])
    assert (config.max_batch_size, list(config.input[0].dims), list(config.output[0].dims)) == (8, [16], [4])
    assert [g.count for g in config.instance_group] == [2]
    batched = c.get_model_config("batched").config.dynamic_batching
    assert (list(batched.preferred_batch_size), batched.max_queue_delay_microseconds) == ([4], 60000000)


def test_a_preferred_batch_forms_from_grpc_requests(served: tuple[DaemonProcess, int, Path]) -> None:
    d, _, repo = served
    with d.client() as c:
        before = c.status()["models"]["batched"]

    def one(i: int) -> np.ndarray:
        c = tritongrpc.InferenceServerClient(url=f"unix:{d.socket}.grpc")
        try:
            inp = tritongrpc.InferInput("x", [1, 16], "FP32")
            inp.set_data_from_numpy(np.full((1, 16), i, np.float32))
            out = c.infer("batched", [inp]).as_numpy("probs")
            assert out is not None
            return out
        finally:
            c.close()

    def five() -> list[np.ndarray]:
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            return list(pool.map(one, range(5)))

    answers = while_held(d, repo.parent / "wedge", "batched", 5, five)
    assert [a.shape for a in answers] == [(1, 4)] * 5
    with d.client() as c:
        after = c.status()["models"]["batched"]
    assert (after["batches"] - before["batches"], after["rows"] - before["rows"]) == (2, 5)


def test_a_foreign_plan_serves_its_onnx_over_grpc(
    served: tuple[DaemonProcess, int, Path], triton_grpc: tritongrpc.InferenceServerClient
) -> None:
    repo = served[2]
    x = np.ones((1, 16), np.float32)
    got, _ = infer_grpc(triton_grpc, "det", x)
    np.testing.assert_allclose(got, reference(repo / "det" / "1" / "model.onnx", x), rtol=1e-5, atol=1e-6)
    assert triton_grpc.get_model_config("det").config.input[0].format == 2  # FORMAT_NCHW, as config.pbtxt says
    with pytest.raises(tritongrpc.InferenceServerException) as e:
        infer_grpc(triton_grpc, "m", np.zeros((9, 16), np.float32))
    assert "input 'x': shape [9, 16] is outside the profile [1, 16]..[8, 16]" in e.value.message()


def test_a_repository_model_unloads_and_loads_over_grpc(triton_grpc: tritongrpc.InferenceServerClient) -> None:
    c = triton_grpc
    c.unload_model("det")
    assert not c.is_model_ready("det")
    index = {(e.name, e.version): e.state for e in c.get_model_repository_index().models}
    assert index[("det", "1")] != "READY"
    c.load_model("det")
    assert c.is_model_ready("det")
    assert infer_grpc(c, "det", np.ones((1, 16), np.float32))[0].shape == (1, 4)


def test_unsupported_fields_stop_the_start_naming_them(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    model_folder(repo, "m", TINY_PBTXT + "sequence_batching { }\nresponse_cache { enable: true }")
    cfg = write_config(tmp_path / "edged.toml", {"server": {"socket": str(tmp_path / "edged.sock")}})
    done = subprocess.run(
        [sys.executable, "-m", "edged", "serve", "--config", str(cfg), "--model-repository", str(repo)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 78, done.stderr
    assert f"{repo}/m/config.pbtxt: sequence_batching is not supported: edged has no sequence batcher" in done.stderr
    assert "response_cache is not supported" in done.stderr


def test_a_new_version_folder_is_served_after_the_reload_it_triggers(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    repo = tmp_path / "repo"
    model_folder(repo, "m", TINY_PBTXT + "version_policy: { latest { num_versions: 2 } }")
    cfg = config(tmp_path, repo)
    text = cfg.read_text().replace("watch_files = false", "watch_files = true\nwatch_interval_s = 0.2")
    cfg.write_text(text)
    d = DaemonProcess(cfg, tmp_path / "edged.sock", tmp_path / "edged.log")
    daemons.append(d)
    d.start()
    with d.client() as c:
        assert c.model_metadata("m")["versions"] == ["1"]
    staged = tmp_path / "staged"
    make_tiny_mlp(staged / "model.onnx", hidden=96)
    os.rename(staged, repo / "m" / "2")  # the version appears whole
    with d.client() as c:
        wait_for(lambda: c.model_metadata("m")["versions"] == ["1", "2"], 60, what="version 2 served")
        x = np.ones((1, 16), np.float32)
        np.testing.assert_allclose(
            c.infer("m", {"x": x})["probs"], reference(repo / "m" / "2" / "model.onnx", x), rtol=1e-5
        )
        status, body, _ = c.request("GET", "/v2/models/m/versions/1")
        assert status == 200 and json.loads(body)["versions"] == ["1"]
    shutil.rmtree(repo / "m" / "1")
    with d.client() as c:
        wait_for(lambda: c.request("GET", "/v2/models/m/versions/1")[0] == 404, 60, what="version 1 gone")
        assert c.model_metadata("m")["versions"] == ["2"]


def test_a_gguf_in_the_repository_is_a_language_model(
    tmp_path: Path, daemons: list[DaemonProcess], smollm2: Path
) -> None:
    repo = tmp_path / "repo"
    (repo / "chat" / "1").mkdir(parents=True)
    os.symlink(smollm2, repo / "chat" / "1" / "model.gguf")
    (repo / "chat" / "config.pbtxt").write_text(CHAT_PBTXT + "instance_group [ { count: 1 } ]")
    (repo / "edged.toml").write_text(
        "[models.chat]\ntimeout_ms = 60000\n[models.chat.warmup]\niterations = 1\n"
        "[models.chat.llm]\ncontext = 1024\nmax_tokens = 8\nmax_tokens_limit = 512\n"
        "warmup_prompt_tokens = 64\nwarmup_decode_tokens = 4\n"
    )
    d = DaemonProcess(config(tmp_path, repo), tmp_path / "edged.sock", tmp_path / "edged.log")
    daemons.append(d)
    d.start(timeout=240)
    with d.client(timeout=120) as c:
        status, body, _ = c.request(
            "POST",
            "/v2/models/chat/generate",
            json.dumps({"text_input": "Name a colour.", "max_tokens": 8, "temperature": 0}).encode(),
        )
        assert status == 200, body
        assert json.loads(body)["text_output"]
        chat = c.status()["models"]["chat"]
    assert (chat["backend"], chat["repository"]["model"]) == ("llama", "chat")
