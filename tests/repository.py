"""Triton-style model repositories for the tests: folders, config.pbtxt files, ONNX models
made with the onnx helper API, a GGUF header, and a TensorRT plan's manifest."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edged.errors import EdgedError
from edged.tools.demo import make_tiny_mlp, save_graph

# The tiny MLP of edged.tools.demo: x [N, 16] FP32 → probs [N, 4] FP32.
TINY_PBTXT = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "probs" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


# A GGUF language model on edged's llama backend, streaming allowed (decoupled).
CHAT_PBTXT = """backend: "llama"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def reference(model: Path, x: np.ndarray) -> np.ndarray:
    """The tiny MLP's answer from ONNX Runtime itself, in this process."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, {"x": x})[0]
    return out


def model_folder(root: Path, name: str, pbtxt: str | None, versions: dict[int, str] | None = None) -> Path:
    """``root/name`` with a config.pbtxt (None: none) and version folders, each holding the tiny
    MLP (hidden layer 32 + 32 × (version - 1), so versions answer differently) under its file name."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    if pbtxt is not None:
        (folder / "config.pbtxt").write_text(pbtxt)
    for version, file in (versions or {1: "model.onnx"}).items():
        make_tiny_mlp(folder / str(version) / file, hidden=32 * version)
    return folder


def identity_model(path: Path, shape: list[int | str], elem: str = "FLOAT", name: str = "x", out: str = "y") -> Path:
    """``name`` → ``out``, unchanged, of the given ONNX element type and shape (str: dynamic)."""
    from onnx import TensorProto, helper

    kind = getattr(TensorProto, elem)
    graph = helper.make_graph(
        [helper.make_node("Identity", [name], [out])],
        "identity",
        [helper.make_tensor_value_info(name, kind, shape)],
        [helper.make_tensor_value_info(out, kind, shape)],
    )
    return save_graph(graph, path)


def gguf_header(path: Path) -> Path:
    """The smallest GGUF edged reads a header from: magic, version 3, no tensors, no keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    return path


def plan_with_manifest(plan: Path, version: str, device: dict[str, str], data: bytes = b"not a real engine") -> Path:
    """A model.plan and the manifest edged writes beside an engine (model.plan.json)."""
    plan.parent.mkdir(parents=True, exist_ok=True)
    plan.write_bytes(data)
    manifest: dict[str, Any] = {
        "version": 1,
        "backend": "tensorrt",
        "precision": "fp16",
        "artifact_sha256": hashlib.sha256(data).hexdigest(),
        "key_fields": {"backend": "tensorrt", "backend_version": version, "device": device},
    }
    plan.with_name(plan.name + ".json").write_text(json.dumps(manifest))
    return plan


def no_tensorrt() -> tuple[str, Mapping[str, str]]:
    """This device's TensorRT, on a machine without one (plans.Identity)."""
    raise EdgedError("tensorrt is not installed")


ORIN = {"gpu": "Orin", "compute_capability": "8.7", "sm_count": "8", "board": "Jetson Orin Nano (nvidia,p3767-0005)"}
XAVIER = {"gpu": "Xavier", "compute_capability": "7.2", "sm_count": "6", "board": "Jetson AGX Xavier (nvidia,p2888)"}
