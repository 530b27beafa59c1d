"""The engine cache across restarts: a second start builds nothing; a corrupted or mismatched
entry is moved aside and rebuilt while the daemon keeps going."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import DaemonProcess

pytestmark = pytest.mark.integration

# These tests are about what the cache holds across restarts: each start builds before READY=1
# (the background builds of a stand-in start are tested in test_background_builds.py).
BLOCK = {"build": {"block_ready": True}}


def manifests(cache: Path) -> dict[str, dict[str, object]]:
    return {p.name: json.loads(p.read_text()) for p in cache.glob("*.json") if p.name != "digests.json"}


def test_second_start_is_a_cache_hit(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, tmp_path: Path
) -> None:
    d = daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}, extra=BLOCK)
    d.start()
    assert "tiny: building" in d.log()
    assert d.stop() == 0
    first = manifests(tmp_path / "cache")
    assert len(first) == 1
    (entry,) = first.values()
    assert entry["footprint"] and entry["build_seconds"] is not None

    d.log_path.write_text("")
    d.start()
    assert "building" not in d.log(), d.log()
    again = manifests(tmp_path / "cache")
    assert again.keys() == first.keys()
    for name, doc in again.items():  # the same entry: not rebuilt
        for field in ("key", "created", "build_seconds", "artifact_sha256"):
            assert doc[field] == first[name][field]
    with d.client() as c:
        st = c.status()
        assert st["models"]["tiny"]["footprint_measured"] is True
        assert st["models"]["tiny"]["cache_key"] == entry["key"]
    assert d.stop() == 0
    assert not d.socket.exists()  # removed on a clean stop


def test_corrupt_artifact_is_quarantined_and_rebuilt(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, tmp_path: Path
) -> None:
    d = daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}, extra=BLOCK)
    d.start()
    assert d.stop() == 0
    cache = tmp_path / "cache"
    (artifact,) = cache.glob("tiny-*.onnx")
    artifact.write_bytes(b"\x00garbage" + artifact.read_bytes()[8:])
    d.log_path.write_text("")
    d.start()
    assert "artefact checksum does not match" in d.log()
    assert "tiny: building" in d.log()
    moved = sorted(p.name for p in (cache / "quarantine").glob("tiny-*.onnx.*"))
    assert len(moved) == 2 and moved[1] == moved[0] + ".why"  # the artefact and why it was moved
    with d.client() as c:
        assert c.infer("tiny", {"x": np.zeros((1, 16), np.float32)})["probs"].shape == (1, 4)


def test_changed_model_rebuilds_and_manifest_mismatch(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    from edged.tools.demo import make_tiny_mlp

    model = make_tiny_mlp(tmp_path / "m.onnx")
    d = daemon_factory({"m": {"path": str(model)}}, extra=BLOCK)
    d.start()
    assert d.stop() == 0
    cache = tmp_path / "cache"
    (mpath,) = cache.glob("m-*.json")
    doc = json.loads(mpath.read_text())
    doc["key"] = "0" * 64  # a manifest that does not belong to its entry is never used
    mpath.write_text(json.dumps(doc))
    d.log_path.write_text("")
    d.start()
    assert "manifest key does not match" in d.log()
    assert d.stop() == 0
    make_tiny_mlp(model, hidden=8)  # new model bytes: a new key, a new entry
    d.log_path.write_text("")
    d.start()
    assert "m: building" in d.log()
    assert len(list(cache.glob("m-*.onnx"))) == 2


def test_artifact_that_does_not_load_is_rebuilt(
    daemon_factory: Callable[..., DaemonProcess], model_dir: Path, tmp_path: Path
) -> None:
    """An entry whose checksum matches but which the backend cannot load (a plan from another
    TensorRT, say) is moved aside and rebuilt at once; the daemon comes up ready."""
    from edged.cache.store import file_digest

    d = daemon_factory({"tiny": {"path": str(model_dir / "tiny.onnx")}}, extra=BLOCK)
    d.start()
    assert d.stop() == 0
    cache = tmp_path / "cache"
    (artifact,) = cache.glob("tiny-*.onnx")
    (mpath,) = cache.glob("tiny-*.json")
    artifact.write_bytes(b"not an onnx model at all")
    doc = json.loads(mpath.read_text())
    doc.update(artifact_size=artifact.stat().st_size, artifact_sha256=file_digest(artifact))
    mpath.write_text(json.dumps(doc))
    d.log_path.write_text("")
    d.start()
    assert "does not load" in d.log() and "rebuilding" in d.log()
    assert list((cache / "quarantine").glob("tiny-*.onnx.*"))
    with d.client() as c:
        assert c.infer("tiny", {"x": np.zeros((1, 16), np.float32)})["probs"].shape == (1, 4)
