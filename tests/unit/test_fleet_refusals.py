"""A refused bundle shows in the status, in a Prometheus counter by reason and as an event."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from edged.fleet.bundle import BundleRefused, open_bundle, sign_bundle
from edged.fleet.bundle_base import REFUSAL_CODES
from edged.fleet.refusals import Refusal, Refusals
from tests.fleet_keys import make_key, tiny_bundle


def count(registry: CollectorRegistry, code: str) -> float:
    value = registry.get_sample_value("edged_fleet_bundle_refusals_total", {"reason": code})
    assert value is not None
    return value


def test_every_reason_has_a_zero_sample_from_the_start_and_promtool_accepts_it() -> None:
    registry = CollectorRegistry()
    Refusals(registry)
    assert all(count(registry, code) == 0.0 for code in REFUSAL_CODES)
    text = generate_latest(registry)
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus package) is missing"
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, check=False)
    assert out.returncode == 0, out.stderr.decode()


def test_a_real_refusal_is_counted_kept_for_the_status_and_published(tmp_path: Path) -> None:
    key, other = make_key(tmp_path, "release"), make_key(tmp_path, "other")
    root = tiny_bundle(tmp_path)
    sign_bundle(root, key.private)
    registry = CollectorRegistry()
    events: list[Refusal] = []
    refusals = Refusals(registry, publish=events.append)
    with pytest.raises(BundleRefused) as info:
        open_bundle(root, [other.public], require_signed=True)
    refusals.record(info.value, model="tiny", source=str(root), version="1.0.0")
    assert count(registry, "untrusted_signer") == 1.0 and count(registry, "file_modified") == 0.0
    status = refusals.status()["tiny"]
    assert status["code"] == "untrusted_signer" and "bundle.sig" in status["reason"]
    body = json.loads(json.dumps(events[0].event()))
    assert body["event"] == "bundle_refused" and body["model"] == "tiny" and body["source"] == str(root)
    refusals.clear("tiny")
    assert refusals.status() == {}


def test_the_status_keeps_a_bounded_number_of_models() -> None:
    refusals = Refusals(CollectorRegistry(), keep=3)
    for i in range(10):
        refusals.record(BundleRefused("x", "unsigned"), model=f"m{i}", source="s")
    assert list(refusals.status()) == ["m7", "m8", "m9"]


def test_a_publisher_that_fails_does_not_lose_the_refusal() -> None:
    def broken(_: Refusal) -> None:
        raise ConnectionError("broker gone")

    registry = CollectorRegistry()
    refusals = Refusals(registry, publish=broken)
    refusals.record(BundleRefused("x", "unsigned"), model="m", source="s")
    assert count(registry, "unsigned") == 1.0 and "m" in refusals.status()


def test_a_code_outside_the_table_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        Refusals(CollectorRegistry()).record(BundleRefused("x", "whatever"), model="m", source="s")
