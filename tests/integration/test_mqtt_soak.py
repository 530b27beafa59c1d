"""A short run of the soak command (bench/soak.py): socket, shared-memory and MQTT clients at
once, through a reload and a broker restart, with no error and no lost MQTT request. The full
10-minute run, and the RSS and fd slopes, are the benchmark's (``scripts/bench.sh soak``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.mosquitto import need

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_a_short_soak_has_no_errors(tmp_path: Path) -> None:
    need("mosquitto", "mosquitto")
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--seconds", "25", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == 0, r["error_kinds"]
    assert r["mqtt_lost"] == 0
    assert all(n > 0 for n in r["good_answered"].values()), r["good_answered"]
    assert r["bad_answered_right"] > 0
    assert set(r["events"]) == {"reload", "broker_restart"} and "reload done" in r["events"]["reload"]["log"]
    assert r["daemon_exit"] == 0
