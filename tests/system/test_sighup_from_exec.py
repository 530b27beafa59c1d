"""SIGHUP at any moment from the daemon's exec is survived, under the shipped unit in a booted
systemd (root): 0, 20, 50 and 100 ms after the exec, before Python has imported edged, the
process goes on to READY=1 with the same PID (the unit starts it under nohup, which ignores
SIGHUP until edged's own handler takes it; without that, Python's default action killed it with
exit 129)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from daemon_units import SERVICE, boot_edged
from systemd_ns import Boot
from unit_python import python_for_units

from edged.tools.demo import make_tiny_mlp
from tests.helpers import wait_for

pytestmark = pytest.mark.system

X = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(1, 16)

# In the namespace, in one shell so that no nsenter round trip stands between the exec and the
# signal: start, wait for the main PID, wait for it to be the Python interpreter (the exec, as
# /proc/PID/exe shows it), wait the moment under test, send what ExecReload= sends.
HUP_AFTER_EXEC = """
systemctl start --no-block {unit}
while pid=$(systemctl show -p MainPID --value {unit}); [ "$pid" = 0 ]; do :; done
while [ "$(readlink /proc/$pid/exe)" != "{python}" ]; do :; done
sleep {delay}
kill -HUP "$pid"
echo "$pid"
"""


@pytest.mark.parametrize("delay_ms", [0, 20, 50, 100])
def test_a_sighup_right_after_exec_is_survived(boot_systemd: Boot, tmp_path: Path, delay_ms: int) -> None:
    edged = boot_edged(boot_systemd)
    edged.write_config({"models.m": {"path": edged.install(make_tiny_mlp(tmp_path / "m.onnx"), "m.onnx")}})
    python = os.path.realpath(python_for_units()[0])
    script = HUP_AFTER_EXEC.format(unit=SERVICE, python=python, delay=delay_ms / 1000)
    run = edged.ns.run("sh", "-c", script, check=True, timeout=60)
    pid = int(run.stdout.split()[-1])
    wait_for(lambda: edged.state() in ("active", "failed", "inactive"), 120, interval=0.05, what="the start to end")
    assert edged.state() == "active", edged.diagnostics()
    assert edged.main_pid() == pid  # the same process: not killed and restarted
    with edged.client() as c:
        assert c.infer("m", {"x": X})["probs"].shape == (1, 4)
