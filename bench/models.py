"""The benchmark's models and the facts every server needs about them.

Three ONNX models, each with a dynamic batch dimension:
  * ``tiny``: the demo's 16→32→4 MLP (1x16 in), where a server's own overhead is the whole cost;
  * ``conv640``: a small conv net on a 1x3x640x640 frame, built here with the onnx helper API
    and fixed weights, cheap enough that moving the frame is a visible share of the cost;
  * ``ocr_det``: the demo's PP-OCRv4 text detector at 1x3x640x640, a real model.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edged.tools.demo import save_graph


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str
    input: str
    shape: tuple[int, ...]
    outputs: tuple[str, ...]
    threads: int  # intra-op threads, the same for every server
    frame: bool  # frame-sized input: shared memory where the server offers it

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * 4

    def sample(self, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).random(self.shape, dtype=np.float32)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(doc: dict[str, Any]) -> ModelSpec:
        return ModelSpec(**dict(doc, shape=tuple(doc["shape"]), outputs=tuple(doc["outputs"])))


def make_conv640(path: Path) -> Path:
    """Conv(3→8, s2) → Conv(8→16, s2) → Conv(16→32, s2) → GlobalAveragePool → Gemm(32→10)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(640)
    inits, nodes, prev, chans = [], [], "x", 3
    for i, out in enumerate((8, 16, 32)):
        w = (rng.standard_normal((out, chans, 3, 3)) * (2 / (9 * chans)) ** 0.5).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.zeros(out, np.float32), f"b{i}")]
        nodes += [
            helper.make_node(
                "Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]
            ),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
        ]
        prev, chans = f"r{i}", out
    fc = (rng.standard_normal((chans, 10)) * 0.3).astype(np.float32)
    inits += [numpy_helper.from_array(fc, "fc"), numpy_helper.from_array(np.zeros(10, np.float32), "fcb")]
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc", "fcb"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv640",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 640, 640])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    return save_graph(graph, path)


def make_wide_mlp(path: Path, d_in: int = 256, hidden: int = 2048, d_out: int = 16) -> Path:
    """256→2048→2048→16 (17 MB of weights): at batch 1 ONNX Runtime streams every weight for one
    row (memory-bound GEMV); a batch shares that read. The scheduler phase's batchable model."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2048)
    dims = [(d_in, hidden), (hidden, hidden), (hidden, d_out)]
    inits, nodes, prev = [], [], "x"
    for i, (a, b) in enumerate(dims):
        w = (rng.standard_normal((a, b)) * (1 / a) ** 0.5).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.zeros(b, np.float32), f"b{i}")]
        out = "y" if i == len(dims) - 1 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [out]))
        if out != "y":
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"]))
            prev = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "mlp2k",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", d_out])],
        inits,
    )
    return save_graph(graph, path)


def batchable(bench_models: Path) -> ModelSpec:
    path = bench_models / "mlp2k.onnx"
    if not path.exists():
        make_wide_mlp(path)
    return ModelSpec("mlp2k", str(path.resolve()), "x", (1, 256), ("y",), len(os.sched_getaffinity(0)), False)


def demo_onnx(data_dir: Path) -> None:
    """The demo's two ONNX models (not its language model, which no benchmark here needs), fetched
    or built if missing; a host without a package index gets them carried in data/models."""
    from edged.tools.demo import extract_detector, make_tiny_mlp

    if not (data_dir / "models" / "ocr_det.onnx").exists():
        extract_detector(data_dir / "models" / "ocr_det.onnx")
    if not (data_dir / "models" / "tiny.onnx").exists():
        make_tiny_mlp(data_dir / "models" / "tiny.onnx")


def prepare(data_dir: Path, bench_models: Path) -> dict[str, ModelSpec]:
    """Fetch the demo models if missing, build the conv net, and describe all three. Only the two
    ONNX demo models are needed (not the language model): a host without a package index runs
    this with them carried in data/models."""
    demo_onnx(data_dir)
    conv = bench_models / "conv640.onnx"
    if not conv.exists():
        make_conv640(conv)
    demo = (data_dir / "models").resolve()
    conv = conv.resolve()
    cores = len(os.sched_getaffinity(0))  # what edged picks for one instance (threads = 0)
    specs = [
        ModelSpec("tiny", str(demo / "tiny.onnx"), "x", (1, 16), ("probs",), 1, False),
        ModelSpec("conv640", str(conv), "x", (1, 3, 640, 640), ("logits",), cores, True),
        ModelSpec("ocr_det", str(demo / "ocr_det.onnx"), "x", (1, 3, 640, 640), ("sigmoid_0.tmp_0",), cores, True),
    ]
    return {s.name: s for s in specs}


def write_specs(path: Path, specs: dict[str, ModelSpec]) -> Path:
    path.write_text(json.dumps([s.to_json() for s in specs.values()]))
    return path


def read_specs(path: Path) -> dict[str, ModelSpec]:
    return {d["name"]: ModelSpec.from_json(d) for d in json.loads(path.read_text())}


def session(spec: ModelSpec, config: dict[str, str] | None = None) -> Any:
    """An ONNX Runtime session as every server builds it (the spec's threads, default optimisation);
    ``config``: session config entries on top (edged's serving ones, for a like-for-like floor)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    so.log_severity_level = 3
    so.intra_op_num_threads = spec.threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(spec.path, so, providers=["CPUExecutionProvider"])
