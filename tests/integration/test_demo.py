"""The bundled demo: the PP-OCRv4 text detector served with configs/demo.toml's settings, a camera
frame sent through shared memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import onnxruntime as ort
import pytest

from edged.config import load
from tests.conftest import REPO
from tests.helpers import DaemonProcess

pytestmark = pytest.mark.integration


def test_demo_config_is_valid() -> None:
    cfg = load(REPO / "configs" / "demo.toml")
    assert set(cfg.models) == {"ocr_det", "tiny", "smollm2"}
    assert cfg.models["ocr_det"].profiles["x"].opt == [1, 3, 640, 640]
    det = cfg.models["ocr_det"]
    assert det.precision == "auto" and det.calibration is not None and det.gate.metrics == ("mask_iou",)
    assert det.calibration.data == str(REPO / "data" / "calib" / "ocr_det")  # what the demo's set-up makes


def test_the_demo_set_up_renders_the_detectors_calibration_pages(tmp_path: Path) -> None:
    from edged.config import CalibrationConfig
    from edged.quantize.calibrate import CalibrationSet
    from edged.tools.demo import DEMO_PAGES, detector_pages

    pages = detector_pages(tmp_path)
    assert pages == tmp_path / "calib" / "ocr_det" and len(list(pages.glob("*.png"))) == DEMO_PAGES
    assert not list(tmp_path.glob("calib/.*"))  # nothing half-written beside it
    # They load as configs/demo.toml reads them (its calibration table, with this folder).
    table = load(REPO / "configs" / "demo.toml").models["ocr_det"].calibration
    assert table is not None
    cal = CalibrationConfig(**dict(msgspec.structs.asdict(table), data=str(pages)))
    from edged.backends.base import TensorSpec

    samples = CalibrationSet.load(cal, (TensorSpec("x", "float32", (-1, 3, -1, -1)),))
    assert len(samples) == DEMO_PAGES
    assert detector_pages(tmp_path) == pages  # rendered once


def test_detector_frame_through_shared_memory(daemon_factory: Callable[..., DaemonProcess], demo_models: Path) -> None:
    d = daemon_factory(
        {
            "ocr_det": {
                "path": str(demo_models),
                "backend": "onnxruntime",
                "profiles": {"x": {"min": [1, 3, 32, 32], "opt": [1, 3, 640, 640], "max": [1, 3, 1280, 1280]}},
            }
        }
    )
    d.start()
    frame = np.random.default_rng(0).random((1, 3, 640, 640), dtype=np.float32)
    with d.client() as c:
        meta = c.model_metadata("ocr_det")
        assert meta["inputs"][0]["shape"] == [-1, 3, -1, -1]
        out = c.infer_shm("ocr_det", {"x": frame})
        (name,) = out
        ref = ort.InferenceSession(str(demo_models), providers=["CPUExecutionProvider"]).run(None, {"x": frame})[0]
        assert out[name].shape == ref.shape == (1, 1, 640, 640)
        np.testing.assert_allclose(out[name], ref, atol=1e-4)
        # Outside the configured profile: a precise 400, and the daemon keeps going.
        from edged import errors

        with pytest.raises(errors.InvalidInputError, match="outside the profile"):
            c.infer("ocr_det", {"x": np.zeros((1, 3, 16, 16), np.float32)})
        assert c.ready()
