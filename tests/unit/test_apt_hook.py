"""The apt hook (systemd/edged-apt-hook) against the real dpkg database of this machine: it acts
only when the watched packages changed, records the first state silently, never fails apt."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import unavailable

HOOK = Path(__file__).resolve().parents[2] / "systemd" / "edged-apt-hook"


@pytest.fixture(autouse=True)
def _dpkg_query() -> None:
    if shutil.which("dpkg-query") is None:
        unavailable("needs dpkg-query (a Debian system)")


def run(tmp_path: Path, action: str, patterns: str = "mosquitto* libc6") -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        EDGED_APT_STATE=str(tmp_path / "state" / "apt-versions"),
        EDGED_APT_PATTERNS=patterns,
        EDGED_APT_ACTION=action,
    )
    return subprocess.run(["sh", str(HOOK)], env=env, capture_output=True, text=True, timeout=60)


def test_acts_only_when_the_watched_packages_change(tmp_path: Path) -> None:
    acted = tmp_path / "acted"
    first = run(tmp_path, f"touch {acted}")
    assert first.returncode == 0 and not acted.exists()  # the first run records only
    recorded = (tmp_path / "state" / "apt-versions").read_text()
    assert len(recorded.strip()) == 64
    assert run(tmp_path, f"touch {acted}").returncode == 0 and not acted.exists()  # nothing changed
    # Another set of packages installed: the same as an upgrade of the watched ones.
    changed = run(tmp_path, f"touch {acted}", patterns="libc6")
    assert changed.returncode == 0 and acted.exists()
    assert "restarting edged" in changed.stderr
    assert (tmp_path / "state" / "apt-versions").read_text() != recorded


def test_a_failing_action_never_fails_apt(tmp_path: Path) -> None:
    assert run(tmp_path, "false").returncode == 0
    result = run(tmp_path, "false", patterns="libc6")
    assert result.returncode == 0 and "failed" in result.stderr
