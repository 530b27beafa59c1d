"""A reload in which one model's new file cannot be served changes nothing, also when its engine
would build in the background after the commit (block_ready off): the reload fails naming the
model, the other changes are not applied, and the old version keeps serving."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edged.tools.demo import make_tiny_mlp
from tests.helpers import DaemonProcess, wait_for
from tests.integration.test_faults import X, hup, logged, ref, status

pytestmark = pytest.mark.integration


def test_a_reload_with_one_unloadable_model_changes_nothing(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    a, b = make_tiny_mlp(tmp_path / "a.onnx"), make_tiny_mlp(tmp_path / "b.onnx", hidden=20)
    d = daemon_factory(
        {"a": {"path": str(a), "priority": 10}, "b": {"path": str(b)}},
        extra={"lifecycle": {"watch_files": False}, "build": {"block_ready": False}},
    )
    d.start()
    before = {n: (m["cache_key"], m["priority"]) for n, m in status(d)["models"].items()}
    c_model = make_tiny_mlp(tmp_path / "c.onnx", hidden=24)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    good = d.config.read_text()
    # a's priority changes, c is added, b's file becomes one that cannot load.
    new = good.replace("priority = 10", "priority = 20").replace(str(b), str(broken))
    d.config.write_text(new + f'\n[models.c]\npath = "{c_model}"\n')
    hup(d)
    wait_for(logged(d, "reload failed", 1), 60, what="the reload to fail")
    line = next(x for x in d.log().splitlines() if "reload failed" in x)
    assert "b:" in line and "cannot be served" in line, line
    st = status(d)
    assert {n: (m["cache_key"], m["priority"]) for n, m in st["models"].items()} == before  # nothing applied
    assert "reload failed" in st["status"]
    with d.client() as c:
        np.testing.assert_allclose(c.infer("b", {"x": X})["probs"], ref(b), rtol=1e-5)  # the old b serves
