"""Builds that never block serving, under the shipped units in a booted systemd (root).

With a fresh cache, `systemctl start` returns as soon as the model serves on its stand-in (the
FP32 model on ONNX Runtime), long before its int8 engine is built; STATUS= says what serves while
the build runs, then the engine is swapped in and STATUS= says so, with the unit active throughout.
A SIGHUP during the start-up and a start-up with a configuration problem are survived as the
lifecycle promises: the reload runs once ready; the problem exits 78 and systemd does not restart.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from daemon_units import SERVICE, Edged, boot_edged
from systemd_ns import Boot

from edged.tools.demo import make_tiny_mlp
from tests.helpers import wait_for

pytestmark = pytest.mark.system

X = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(1, 16)
DELAY = "EDGED_TEST_BUILD_DELAY_S"


def slow_build(boot: Boot, seconds: int) -> Edged:
    return boot_edged(boot, extra=f"[Service]\nEnvironment={DELAY}=m={seconds}\n")


def test_active_on_a_stand_in_while_the_engine_builds(boot_systemd: Boot, tmp_path: Path) -> None:
    edged = slow_build(boot_systemd, 6)
    edged.write_config(
        {
            "build": {"block_ready": False},
            "models.m": {"path": edged.install(make_tiny_mlp(tmp_path / "m.onnx"), "m.onnx")},
        }
    )
    blocked = edged.start()
    assert edged.state() == "active"
    status = edged.prop("StatusText")
    assert "m serving on onnxruntime fp32 while building onnxruntime fp32" in status, status
    with edged.client() as c:
        assert c.status()["models"]["m"]["fallback"] is True
        assert c.infer("m", {"x": X})["probs"].shape == (1, 4)
    seen: list[str] = []

    def swapped() -> bool:
        text = edged.prop("StatusText")
        seen.append(text)
        assert edged.state() == "active", edged.diagnostics()
        return text == "1 models ready"

    wait_for(swapped, 120, interval=0.05, what="the built engine to be swapped in")
    assert any("%)" in text for text in seen), seen  # build progress was shown
    with edged.client() as c:
        m = c.status()["models"]["m"]
    assert m["fallback"] is False and m["cache_key"], m
    print(f"\nsystemctl start blocked {blocked:.2f} s for a model whose build takes over 6 s")
    assert blocked < 6


def test_a_sighup_while_activating_is_survived_and_reloads_once_ready(boot_systemd: Boot, tmp_path: Path) -> None:
    edged = slow_build(boot_systemd, 4)
    edged.write_config({"models.m": {"path": edged.install(make_tiny_mlp(tmp_path / "m.onnx"), "m.onnx")}})
    edged.ns.systemctl("start", "--no-block", SERVICE, check=True)
    wait_for(lambda: edged.prop("StatusText").startswith("building m"), 60, interval=0.02, what="the build")
    pid = edged.main_pid()
    edged.ns.run("kill", "-HUP", str(pid), check=True)  # what ExecReload= sends; systemd waits for the start
    wait_for(lambda: edged.state() == "active", 120, interval=0.05, what="edged active")
    assert edged.main_pid() == pid  # the same process: the SIGHUP did not kill it (no exit 129)
    wait_for(lambda: "reload done" in edged.journal(), 60, interval=0.1, what="the deferred reload")
    with edged.client() as c:
        assert c.infer("m", {"x": X})["probs"].shape == (1, 4)


def test_a_configuration_problem_exits_78_and_is_not_restarted(boot_systemd: Boot, tmp_path: Path) -> None:
    edged = boot_edged(boot_systemd)
    edged.write_config(
        {
            "memory": {"probe": "nvml"},  # no NVML in the namespace: a configuration problem
            "models.m": {"path": edged.install(make_tiny_mlp(tmp_path / "m.onnx"), "m.onnx")},
        }
    )
    edged.ns.systemctl("start", "--no-block", SERVICE)
    wait_for(lambda: edged.state() == "failed", 60, interval=0.05, what="the unit to fail")
    shown = edged.show("ExecMainStatus", "NRestarts")
    assert shown["ExecMainStatus"] == "78" and shown["NRestarts"] == "0", shown
    journal = edged.journal()
    assert "cannot start: memory.probe" in journal and "Traceback" not in journal
