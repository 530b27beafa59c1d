"""precision = "auto" on a real daemon with ONNX Runtime: every candidate built and judged, the
ones that pass timed in the build child, the fastest served, and the figures in the status, the
cache manifest and ``edged plan``; a candidate that fails its gate is never served; a restart
reuses the choice without timing again; a new generation of the key (the generation tag, standing
in for a changed device fingerprint as in the other cache tests) chooses again."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.quantize.choice import Candidate, choose
from tests.helpers import DaemonProcess, wait_for
from tests.integration.test_int8 import detector, render_text_images

pytestmark = pytest.mark.integration

FRAME = np.random.default_rng(0).random((1, 3, 160, 160), dtype=np.float32)
DELAY_ENV = "EDGED_TEST_BUILD_DELAY_S"


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_text_images(tmp_path_factory.mktemp("pages") / "pages", 10)


def auto_model(path: Path, data: Path, gate: dict[str, object]) -> dict[str, Any]:
    return dict(detector(path, data, gate), precision="auto")


def status(d: DaemonProcess) -> dict[str, Any]:
    with d.client() as c:
        return dict(c.status()["models"]["det"])


def manifests(cache: Path) -> dict[str, Any]:
    """The model's cache manifests by precision ("auto" for the choices, a list of them)."""
    found: dict[str, Any] = {}
    for p in sorted(cache.glob("det-*.json")):
        data = json.loads(p.read_text())
        if data["precision"] == "auto":
            found.setdefault("auto", []).append(data)
        else:
            found[data["precision"]] = data
    return found


def plan(d: DaemonProcess, *args: str) -> str:
    run = [sys.executable, "-m", "edged", "plan", "--config", str(d.config), *args]
    return subprocess.run(run, capture_output=True, text=True, check=True).stdout


def test_a_candidate_that_fails_its_gate_is_not_chosen_and_the_figures_are_shown(
    daemon_factory: Callable[..., DaemonProcess], demo_models: Path, pages: Path, tmp_path: Path
) -> None:
    # A gate int8 cannot pass, without the search: fp32 is the one candidate left. The build runs
    # in the background (slowed) while the source model stands in.
    gate: dict[str, object] = {"max_rel_l2": 0.001, "min_cosine": 0.99999, "search": "off"}
    d = daemon_factory(
        {"det": auto_model(demo_models, pages, gate)}, extra={"build": {"block_ready": False}}, env={DELAY_ENV: "2"}
    )
    d.start(timeout=120)
    st = status(d)
    assert st["fallback"] and "while building onnxruntime auto" in st["reason"], st
    with d.client() as c:
        assert c.infer("det", {"x": FRAME})["sigmoid_0.tmp_0"].shape == (1, 1, 160, 160)
    st = wait_for(lambda: (s := status(d))["auto"] and not s["fallback"] and s, 180, 0.2, "the auto build")
    assert st["precision"] == "fp32" and st["requested_precision"] == "auto" and st["state"] == "ready", st
    auto = st["auto"]
    by = {c["precision"]: c for c in auto["candidates"]}
    assert set(by) == {"int8", "fp32"}
    assert by["int8"]["passed"] is False and "failed the accuracy gate" in by["int8"]["note"]
    assert "median_ms" not in by["int8"]  # never timed, never served
    assert by["fp32"]["passed"] is True and by["fp32"]["median_ms"] > 0 and by["fp32"]["runs"] >= 4
    assert auto["choice"]["precision"] == "fp32" and "int8 failed the accuracy gate" in auto["choice"]["why"]
    assert st["precision_reason"].startswith("auto chose fp32")
    # The manifests: the choice under a key of its own, the candidates under theirs.
    found = manifests(tmp_path / "cache")
    (record,) = found["auto"]
    assert record["artifact"] is None and record["auto"] == auto
    assert record["key"] != st["cache_key"] == found["fp32"]["key"] == by["fp32"]["key"]
    assert found["int8"]["artifact"] is None and found["int8"]["gate"]["passed"] is False
    # edged plan shows the same figures.
    text = plan(d)
    assert "det: auto: candidates fp32" in text and "chose fp32" in text and "failed the accuracy gate" in text
    (model,) = json.loads(plan(d, "--json"))["models"]
    assert model["auto"] == auto and model["precision"] == "fp32"


def test_the_fastest_passing_candidate_serves_and_the_choice_is_kept_until_the_key_changes(
    daemon_factory: Callable[..., DaemonProcess], demo_models: Path, pages: Path, tmp_path: Path
) -> None:
    gate: dict[str, object] = {"max_rel_l2": 0.5, "min_cosine": 0.9}  # what int8 passes on this model (test_int8.py)
    d = daemon_factory({"det": auto_model(demo_models, pages, gate)}, extra={"cache": {"generation_tag": ""}})
    d.start(timeout=240)
    st = status(d)
    auto = st["auto"]
    assert {c["precision"] for c in auto["candidates"] if c["passed"] and c["median_ms"] > 0} == {"int8", "fp32"}
    figures = [Candidate(c["precision"], c["label"], c["passed"], c.get("median_ms")) for c in auto["candidates"]]
    expected = choose(figures)
    assert expected is not None and auto["choice"]["precision"] == expected.precision == st["precision"]
    with d.client() as c:
        assert c.infer("det", {"x": FRAME})["sigmoid_0.tmp_0"].shape == (1, 1, 160, 160)
    (first,) = manifests(tmp_path / "cache")["auto"]
    # A restart reads the choice: nothing is built, judged or timed again.
    assert d.stop() == 0
    d.log_path.write_text("")
    d.start(timeout=60)
    assert "building" not in d.log()
    assert status(d)["auto"] == auto and manifests(tmp_path / "cache")["auto"] == [first]
    # Another generation of the key (as a changed device fingerprint gives): chosen again.
    assert d.stop() == 0
    d.config.write_text(d.config.read_text().replace('generation_tag = ""', 'generation_tag = "v2"'))
    d.log_path.write_text("")
    d.start(timeout=240)
    assert "building" in d.log()
    records = manifests(tmp_path / "cache")["auto"]
    assert len(records) == 2 and first in records
    (second,) = [r for r in records if r["key"] != first["key"]]
    assert status(d)["auto"] == second["auto"] and second["auto"]["choice"]["precision"] == status(d)["precision"]
