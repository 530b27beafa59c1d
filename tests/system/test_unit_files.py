"""Static checks of systemd/: `systemd-analyze verify`, the security exposure score, and the
consistency of the units with the sysusers.d snippet. No systemd is booted.

systemd-analyze starts a manager in test mode, which creates /run/systemd/systemd-units-load
and a /tmp/systemd-temporary-* directory; as root it runs in a private mount namespace with a
tmpfs on /run, and TMPDIR points into the test's own directory, so the host keeps neither.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from ns_host import REPO

from tests.helpers import unavailable

UNITS = REPO / "systemd"
EXEC = "/opt/edged/venv/bin/edged"
MAX_EXPOSURE = 3.0


@pytest.fixture
def _systemd_analyze() -> None:
    if shutil.which("systemd-analyze") is None:
        unavailable("systemd-analyze is not installed (Debian package 'systemd')")


needs_analyze = pytest.mark.usefixtures("_systemd_analyze")


def analyze(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmpdir), SYSTEMD_LOG_COLOR="0")
    cmd = ["systemd-analyze", *args]
    if os.geteuid() == 0 and shutil.which("unshare"):
        script = 'mount -n -t tmpfs tmpfs /run && exec "$@"'
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def installed_copy(tmp_path: Path) -> Path:
    """The units with ExecStart= pointing at a binary that exists here (verify checks it)."""
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    for name in ("edged.service", "edged.socket"):
        text = (UNITS / name).read_text().replace(EXEC, shutil.which("true") or "/bin/true")
        (unit_dir / name).write_text(text)
    return unit_dir


@needs_analyze
def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    unit_dir = installed_copy(tmp_path)
    out = analyze(tmp_path, "verify", "--man=no", str(unit_dir / "edged.socket"), str(unit_dir / "edged.service"))
    assert out.returncode == 0, out.stderr
    # verify reports problems on stderr even when it exits 0 (unknown keys, bad values).
    assert out.stderr.strip() == "", out.stderr


@needs_analyze
def test_security_exposure_is_low(tmp_path: Path) -> None:
    out = analyze(tmp_path, "security", "--offline=yes", "--no-pager", str(UNITS / "edged.service"))
    if "--offline" in out.stderr and out.returncode != 0:
        unavailable(f"systemd-analyze security --offline needs systemd 252+: {out.stderr.strip()}")
    m = re.search(r"Overall exposure level for edged\.service: (\d+\.\d+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, out.stdout


def test_every_supplementary_group_is_declared() -> None:
    """SupplementaryGroups= that names a missing group stops the service from starting."""
    unit = (UNITS / "edged.service").read_text()
    line = next(ln for ln in unit.splitlines() if ln.startswith("SupplementaryGroups="))
    declared = {ln.split()[1] for ln in (UNITS / "edged.sysusers").read_text().splitlines() if ln[:1] in ("g", "u")}
    assert {*line.split("=", 1)[1].split(), "edged"} <= declared


def test_socket_and_runtime_directory_agree() -> None:
    service = (UNITS / "edged.service").read_text()
    socket = (UNITS / "edged.socket").read_text()
    tmpfiles = (UNITS / "edged.tmpfiles").read_text()
    assert "ListenStream=/run/edged/edged.sock" in socket
    assert "RuntimeDirectory=edged\n" in service
    # Without it, stopping the service deletes the socket that edged.socket owns.
    assert "RuntimeDirectoryPreserve=yes" in service
    assert re.search(r"^d /run/edged 0750 edged edged", tmpfiles, re.M)
