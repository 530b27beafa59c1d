from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from edged.cache.store import EngineCache, SourceDigests, cache_key

FIELDS = {
    "model_sha256": "a" * 64,
    "precision": "int8",
    "profiles": {"x": [[1], [2], [4]]},
    "calibration": {"digest": "c", "method": "minmax"},
    "backend": "onnxruntime",
    "backend_version": "1.32",
    "device": {"cpu": "x"},
    "options": {},
}


def test_key_is_stable_and_covers_every_field() -> None:
    base = cache_key(FIELDS)
    assert base == cache_key(dict(reversed(list(FIELDS.items()))))
    for field, other in [
        ("model_sha256", "b" * 64),
        ("precision", "fp32"),
        ("profiles", {}),
        ("calibration", {"digest": "d", "method": "minmax"}),
        ("backend_version", "1.33"),
        ("device", {"cpu": "y"}),
    ]:
        assert cache_key(dict(FIELDS, **{field: other})) != base, field


def commit(cache: EngineCache, data: bytes = b"engine") -> str:
    key = cache_key(FIELDS)
    tmp = cache.temp_path(".bin")
    tmp.write_bytes(data)
    cache.commit("m", key, ".bin", tmp, {"precision": "int8"})
    return key


def test_commit_then_lookup(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    cache.prepare()
    key = commit(cache)
    entry = cache.lookup("m", key, ".bin")
    assert entry is not None and entry.artifact.read_bytes() == b"engine"
    assert entry.manifest["artifact_size"] == 6 and entry.manifest["precision"] == "int8"
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damaged_entries_are_moved_aside(tmp_path: Path, damage: str) -> None:
    cache = EngineCache(tmp_path)
    cache.prepare()
    key = commit(cache)
    artifact = cache.artifact_path("m", key, ".bin")
    if damage == "truncate":
        artifact.write_bytes(b"eng")
    elif damage == "flip":
        artifact.write_bytes(b"ENGINE")
    elif damage == "delete":
        artifact.unlink()
    else:
        cache.manifest_path("m", key).write_text("{not json")
    assert cache.lookup("m", key, ".bin") is None
    assert not cache.manifest_path("m", key).exists()
    assert list((tmp_path / "quarantine").iterdir())


def _hold_lock(
    directory: str, key: str, ready: multiprocessing.synchronize.Event, release: multiprocessing.synchronize.Event
) -> None:
    with EngineCache(directory).lock("m", key):
        ready.set()
        release.wait(30)


def test_lock_excludes_another_process(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_lock, args=(str(tmp_path), "k", ready, release))
    p.start()
    try:
        assert ready.wait(30)
        with pytest.raises(TimeoutError), cache.lock("m", "k", timeout=0.2):
            pass
        release.set()
        with cache.lock("m", "k", timeout=30):
            pass
    finally:
        release.set()
        p.join(30)


def test_temporaries_of_dead_builds_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / ".tmp-999999999-abc.bin"
    dead.write_bytes(b"partial")
    mine = tmp_path / f".tmp-{os.getpid()}-abc.bin"
    mine.write_bytes(b"in progress")
    EngineCache(tmp_path).prepare()
    assert not dead.exists() and mine.exists()


def test_source_digests_rehash_only_on_change(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"one")
    d = SourceDigests(tmp_path)
    first = d.digest(str(model))
    d.save()
    again = SourceDigests(tmp_path)
    assert again.digest(str(model)) == first
    time.sleep(0.01)  # a new mtime, not synchronisation
    model.write_bytes(b"two")
    assert again.digest(str(model)) != first


def test_artefacts_are_trusted_by_stamp_and_verified_in_full_on_demand(tmp_path: Path) -> None:
    """A reload must not re-read every engine: a lookup hashes an artefact only when its (size,
    mtime, inode) changed; verify() reads it in full (what a failed load does)."""
    from edged.cache.store import file_digest

    reads: list[str] = []

    def counting(path: str) -> str:
        reads.append(path)
        return file_digest(path)

    cache = EngineCache(tmp_path)
    cache.prepare()
    cache.digests = SourceDigests(tmp_path, hasher=counting)
    key = commit(cache)
    for _ in range(3):
        assert cache.lookup("m", key, ".bin") is not None
    assert len(reads) == 1
    artifact = cache.artifact_path("m", key, ".bin")
    st = artifact.stat()
    with open(artifact, "r+b") as f:  # bit rot: same size, same inode, mtime put back
        f.write(b"E")
    os.utime(artifact, ns=(st.st_atime_ns, st.st_mtime_ns))
    entry = cache.lookup("m", key, ".bin")
    assert entry is not None and len(reads) == 1  # trusted by its stamp...
    assert "corrupted" in cache.verify(entry)  # ...and caught by the full check


def test_source_digests_prune_files_that_are_gone(tmp_path: Path) -> None:
    kept, gone = tmp_path / "kept.onnx", tmp_path / "gone.onnx"
    kept.write_bytes(b"k")
    gone.write_bytes(b"g")
    d = SourceDigests(tmp_path)
    d.digest(str(kept))
    d.digest(str(gone))
    gone.unlink()
    assert d.prune() == 1
    d.save()
    assert list(json.loads((tmp_path / "digests.json").read_text())) == [str(kept)]


def test_a_failed_build_removes_its_own_temporaries(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    cache.prepare()
    mine = cache.temp_path(".onnx")
    other = tmp_path / ".tmp-1-abc.onnx"
    other.write_bytes(b"another process's")
    cache.remove_temporaries(os.getpid())
    assert not mine.exists() and other.exists()
