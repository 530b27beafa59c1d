"""Collecting the engine cache (real files in a real cache directory): generations per model,
entries in use, Q/DQ models, the quarantine's bounds, the digest index."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from edged.cache.collect import collect
from edged.cache.store import EngineCache, cache_key


def fields(model_sha: str, precision: str = "fp32", device: str = "cpu-a") -> dict[str, Any]:
    return {
        "model_sha256": model_sha,
        "precision": precision,
        "profiles": {},
        "backend": "onnxruntime",
        "backend_version": "1.32",
        "device": {"cpu": device},
        "options": {},
    }


def entry(cache: EngineCache, model: str, f: dict[str, Any], age: int, **extra: Any) -> str:
    """Commit an entry whose files are ``age`` seconds old."""
    key = cache_key(f)
    tmp = cache.temp_path(".onnx")
    tmp.write_bytes(b"engine " + key.encode())
    e = cache.commit(model, key, ".onnx", tmp, dict(extra, key_fields=f, precision=f["precision"]))
    when = 1_700_000_000 - age
    for p in (e.artifact, e.manifest_path):
        os.utime(p, (when, when))
    return key


def present(cache: EngineCache, model: str, key: str) -> bool:
    return cache.manifest_path(model, key).exists() and cache.artifact_path(model, key, ".onnx").exists()


def test_keeps_the_newest_generations_per_model_and_everything_in_use(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    cache.prepare()
    old = entry(cache, "m", fields("1"), age=300)
    middle = entry(cache, "m", fields("2"), age=200)
    new = entry(cache, "m", fields("3"), age=100)
    other = entry(cache, "other", fields("9"), age=900)  # another model's only generation
    report = collect(cache, keep=1, in_use={middle}, quarantine_files=16, quarantine_bytes=1 << 30)
    assert present(cache, "m", new) and present(cache, "m", middle) and present(cache, "other", other)
    assert not present(cache, "m", old)
    assert not cache.artifact_path("m", old, ".onnx").exists()
    assert len(report.removed_entries) == 1 and report.freed_bytes > 0


def test_precisions_of_one_build_are_one_generation(tmp_path: Path) -> None:
    """An int8 record the gate rejected and the fp32 engine it fell back to go together."""
    cache = EngineCache(tmp_path)
    cache.prepare()
    old_int8 = entry(cache, "m", dict(fields("1", "int8"), calibration={"digest": "c"}), age=300)
    old_fp32 = entry(cache, "m", fields("1"), age=299)
    new_fp32 = entry(cache, "m", fields("1", device="cpu-b"), age=10)  # a new device fingerprint
    new_int8 = entry(cache, "m", dict(fields("1", "int8", "cpu-b"), calibration={"digest": "c"}), age=11)
    collect(cache, keep=1, in_use=set(), quarantine_files=16, quarantine_bytes=1 << 30)
    assert present(cache, "m", new_fp32) and present(cache, "m", new_int8)
    assert not present(cache, "m", old_fp32) and not present(cache, "m", old_int8)


def test_an_auto_choice_stays_with_the_candidate_it_chose(tmp_path: Path) -> None:
    """precision = "auto": the choice (a record without an artefact, with auto's settings in its
    key) is one generation with its candidates, so the one in use keeps its choice."""
    cache = EngineCache(tmp_path)
    cache.prepare()
    auto = dict(fields("1", "auto"), auto={"margin": 0.03, "timing": {"threads": 0}})
    choice = cache_key(auto)
    cache.commit("m", choice, ".onnx", None, {"key_fields": auto, "precision": "auto", "auto": {"choice": {}}})
    os.utime(cache.manifest_path("m", choice), (1_700_000_000 - 300, 1_700_000_000 - 300))
    chosen = entry(cache, "m", fields("1"), age=299)
    newer = entry(cache, "m", fields("2"), age=10)  # a newer generation, not in use
    collect(cache, keep=1, in_use={chosen}, quarantine_files=16, quarantine_bytes=1 << 30)
    assert cache.manifest_path("m", choice).exists() and present(cache, "m", chosen) and present(cache, "m", newer)
    collect(cache, keep=1, in_use={newer}, quarantine_files=16, quarantine_bytes=1 << 30)
    assert not cache.manifest_path("m", choice).exists() and not present(cache, "m", chosen)


def test_qdq_models_go_with_the_last_entry_that_uses_them(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    cache.prepare()
    (tmp_path / "qdq").mkdir()
    for name in ("m-old.onnx", "m-old.ranges.json", "m-shared.onnx"):
        (tmp_path / "qdq" / name).write_bytes(b"q")
    entry(cache, "m", fields("1"), age=300, qdq_model="m-old.onnx")
    entry(cache, "m", fields("2"), age=200, qdq_model="m-shared.onnx")
    entry(cache, "m", fields("3"), age=100, qdq_model="m-shared.onnx")
    collect(cache, keep=1, in_use=set(), quarantine_files=16, quarantine_bytes=1 << 30)
    assert sorted(p.name for p in (tmp_path / "qdq").iterdir()) == ["m-shared.onnx"]


def test_quarantine_is_bounded_by_count_and_bytes(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    cache.prepare()
    for i in range(6):
        victim = tmp_path / f"bad{i}.onnx"
        victim.write_bytes(b"x" * 100)
        cache.quarantine(victim, f"test {i}")
    files = sorted(cache.quarantine_dir.iterdir())
    for i, p in enumerate(p for p in files if not p.name.endswith(".why")):
        os.utime(p, (1_700_000_000 + i, 1_700_000_000 + i))
    collect(cache, keep=2, in_use=set(), quarantine_files=4, quarantine_bytes=1 << 30)
    left = [p for p in cache.quarantine_dir.iterdir() if not p.name.endswith(".why")]
    assert len(left) == 4 and len(list(cache.quarantine_dir.glob("*.why"))) == 4
    collect(cache, keep=2, in_use=set(), quarantine_files=4, quarantine_bytes=250)
    assert len([p for p in cache.quarantine_dir.iterdir() if not p.name.endswith(".why")]) == 2


def test_the_digest_index_forgets_files_that_are_gone(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "cache")
    cache.prepare()
    model = tmp_path / "m.onnx"
    model.write_bytes(b"model")
    cache.digests.digest(str(model))
    model.unlink()
    report = collect(cache, keep=2, in_use=set(), quarantine_files=4, quarantine_bytes=1 << 30)
    assert report.removed_digests == 1
    assert str(model) not in (tmp_path / "cache" / "digests.json").read_text()
