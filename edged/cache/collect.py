"""Collecting the engine cache: old generations, the quarantine and the digest index.

A generation is one build of a model for one device and library version: the entries that share
every key field except the precision, the calibration, the gate and auto's settings (an int8
record the gate rejected and the fp32 engine it fell back to are one generation, and so are a
``precision = "auto"`` choice and its candidates). Per model the newest
``keep_generations`` stay, and so does every entry in use; older ones go with their Q/DQ models.
The quarantine is bounded by count and bytes, oldest first. Everything here reads and deletes
files: call it from a worker thread, never on the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edged.cache.store import EngineCache

log = logging.getLogger(__name__)

# Key fields that differ between the precisions of one generation (``auto``: a choice among them
# belongs to the generation of the candidates it chose from).
_PER_PRECISION = ("precision", "calibration", "gate", "auto")


@dataclass
class GcReport:
    removed_entries: list[str] = field(default_factory=list)
    removed_quarantine: int = 0
    removed_digests: int = 0
    freed_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.removed_entries or self.removed_quarantine or self.removed_digests)


@dataclass(frozen=True)
class _Manifest:
    path: Path
    model: str
    key: str
    generation: str
    mtime: float
    data: dict[str, Any]


def _generation(data: dict[str, Any]) -> str:
    fields = {k: v for k, v in (data.get("key_fields") or {}).items() if k not in _PER_PRECISION}
    if not fields:  # a manifest from before key_fields were recorded: its own generation
        return str(data.get("key", ""))
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _manifests(cache: EngineCache) -> list[_Manifest]:
    found = []
    for path in cache.dir.glob("*.json"):
        if path.name == cache.digests.path.name:
            continue
        try:
            data = json.loads(path.read_bytes())
            mtime = path.stat().st_mtime
        except (OSError, ValueError):
            continue  # a manifest being written, or one lookup() will quarantine
        if isinstance(data, dict) and data.get("model") and data.get("key"):
            found.append(_Manifest(path, str(data["model"]), str(data["key"]), _generation(data), mtime, data))
    return found


def _remove(path: Path, report: GcReport) -> None:
    with contextlib.suppress(OSError):
        size = path.stat().st_size
        path.unlink()
        report.freed_bytes += size


def collect_generations(cache: EngineCache, keep: int, in_use: Collection[str], report: GcReport) -> None:
    """Remove all but the newest ``keep`` generations of each model, never an entry in use."""
    manifests = _manifests(cache)
    by_model: dict[str, list[_Manifest]] = {}
    for m in manifests:
        by_model.setdefault(m.model, []).append(m)
    doomed: list[_Manifest] = []
    for entries in by_model.values():
        newest: dict[str, float] = {}
        for m in entries:
            newest[m.generation] = max(newest.get(m.generation, 0.0), m.mtime)
        live = {m.generation for m in entries if m.key in in_use}
        ranked = sorted(newest, key=lambda g: newest[g], reverse=True)
        kept = set(ranked[:keep]) | live
        doomed += [m for m in entries if m.generation not in kept]
    gone = {m.path for m in doomed}
    kept_qdq = {m.data.get("qdq_model") for m in manifests if m.path not in gone}
    for m in doomed:
        if m.data.get("artifact"):
            artifact = cache.dir / str(m.data["artifact"])
            cache.digests.forget(str(artifact))
            _remove(artifact, report)
        _remove(m.path, report)
        with contextlib.suppress(OSError):
            (cache.dir / f".{m.path.stem}.lock").unlink()
        # A language model's saved prefix states live beside its entry and go with it.
        for state in sorted((cache.dir / f"{m.path.stem}.prefixes").glob("*.kv")):
            _remove(state, report)
        with contextlib.suppress(OSError):
            (cache.dir / f"{m.path.stem}.prefixes").rmdir()
        qdq = m.data.get("qdq_model")
        if qdq and qdq not in kept_qdq:
            stem = str(qdq).removesuffix(".onnx")
            _remove(cache.dir / "qdq" / str(qdq), report)
            _remove(cache.dir / "qdq" / f"{stem}.ranges.json", report)
        report.removed_entries.append(m.path.stem)
        log.info("cache: removed %s (an old generation of %s)", m.path.stem, m.model, extra={"model": m.model})


def collect_quarantine(cache: EngineCache, max_files: int, max_bytes: int, report: GcReport) -> None:
    """Keep the newest quarantined files within both bounds (a file and its .why note count once)."""
    if not cache.quarantine_dir.is_dir():
        return
    files = []
    for path in cache.quarantine_dir.iterdir():
        if path.name.endswith(".why"):
            continue
        with contextlib.suppress(OSError):
            st = path.stat()
            files.append((st.st_mtime, st.st_size, path))
    files.sort(key=lambda f: f[0], reverse=True)
    total = 0
    for i, (_, size, path) in enumerate(files):
        total += size
        if i < max_files and total <= max_bytes:
            continue
        _remove(path, report)
        with contextlib.suppress(OSError):
            Path(f"{path}.why").unlink()
        report.removed_quarantine += 1


def collect(
    cache: EngineCache, keep: int, in_use: Collection[str], quarantine_files: int, quarantine_bytes: int
) -> GcReport:
    report = GcReport()
    try:
        collect_generations(cache, keep, in_use, report)
        collect_quarantine(cache, quarantine_files, quarantine_bytes, report)
        report.removed_digests = cache.digests.prune()
        cache.digests.save()
    except OSError as e:  # collecting is housekeeping: a failure is logged, never fatal
        log.warning("cache collection stopped: %s", e)
    if report:
        log.info(
            "cache: collected %d entries, %d quarantined files, %d stale digests (%d bytes freed)",
            len(report.removed_entries),
            report.removed_quarantine,
            report.removed_digests,
            report.freed_bytes,
        )
    return report
