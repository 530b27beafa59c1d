"""The warm-up reaches the connection path: requests through the daemon's own socket before
READY=1, left out of every count."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests.helpers import DaemonProcess

pytestmark = pytest.mark.integration


def test_the_warm_up_goes_through_the_socket_and_counts_nothing(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path
) -> None:
    d = daemon_factory(
        {"tiny": {"path": str(model_dir / "tiny.onnx"), "backend": "onnxruntime"}},
        extra={"server": {"log_level": "debug"}},
    ).start()
    assert f"tiny: warmed the connection path through {d.socket}" in d.log()
    with d.client() as c:
        status, data, _ = c.request("GET", "/v2/models/tiny/stats")
        assert status == 200
        stats = orjson.loads(data)["model_stats"][0]
        assert stats["inference_count"] == 0 and stats["inference_stats"]["success"]["count"] == 0, stats
        assert c.status()["models"]["tiny"]["requests"] == 0
        c.infer("tiny", {"x": np.ones((1, 16), np.float32)})
        assert c.status()["models"]["tiny"]["requests"] == 1
