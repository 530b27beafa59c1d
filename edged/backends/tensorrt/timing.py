"""TensorRT's timing cache, one per device fingerprint, kept in the engine cache's ``timing/``.

Most of an engine build is tactic timing: TensorRT runs every candidate kernel of every layer.
The timing cache keeps those measurements, so a build that finds a layer already timed on this
GPU and TensorRT skips the measurement. One file per device fingerprint (TensorRT version, GPU,
driver, L4T) serves every build on the device: the rebuild of a model, another model, and every
trial of a mixed-precision search (whose artefacts live in a temporary folder, so the cache must
not be looked for beside them). It is written atomically (a crash leaves the old file or the new
one); one TensorRT rejects is moved to the cache's ``quarantine/`` and timing starts afresh. Two
builds at once on one device (the daemon's and ``edged build``) each save what they timed; the
later write wins, which costs the earlier one's new timings, never a build.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged.cache.store import EngineCache, atomic_write

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)


def timing_cache_path(configured: str, root: Path, fingerprint: Mapping[str, str]) -> Path:
    """``configured`` (the ``timing_cache`` option) when set, else ``root/timing/<digest of the
    device fingerprint>.cache``; ``root`` is the engine cache's directory."""
    if configured:
        return Path(configured)
    canon = json.dumps(dict(fingerprint), sort_keys=True).encode()
    return root / "timing" / f"{hashlib.sha256(canon).hexdigest()[:20]}.cache"


@dataclass
class TimingCache:
    """The timing cache of one build: loaded into the builder config before, saved after."""

    path: Path
    root: Path  # the engine cache whose quarantine takes a rejected file
    loaded_bytes: int = 0
    saved_bytes: int = 0

    def load(self, config: trt.IBuilderConfig) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as e:
            log.warning("cannot read timing cache %s (%s); timing every tactic", self.path, e)
            data = b""
        try:
            cache = config.create_timing_cache(data)
            if data and (cache is None or not config.set_timing_cache(cache, False)):
                raise ValueError("TensorRT rejected it")
        except Exception as e:  # a damaged or foreign cache costs timing, never the build
            EngineCache(self.root).quarantine(self.path, f"timing cache rejected by TensorRT: {e}")
            log.warning("timing cache %s unusable (%s); moved aside, timing every tactic", self.path.name, e)
            data = b""
            cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
        self.loaded_bytes = len(data)
        if data:
            log.info(
                "timing cache %s: %s of tactic timings for this device loaded; layers timed before are not timed again",
                self.path.name,
                _kib(len(data)),
            )
        else:
            log.info("timing cache %s: none yet for this device; this build times every tactic", self.path.name)

    def save(self, config: trt.IBuilderConfig) -> None:
        try:
            data = bytes(config.get_timing_cache().serialize())
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, data)
        except OSError as e:  # a lost timing cache only makes the next build slower
            log.warning("cannot save timing cache %s: %s", self.path, e)
            return
        self.saved_bytes = len(data)
        grown = self.saved_bytes - self.loaded_bytes
        log.info(
            "timing cache %s: %s after the build (%s)",
            self.path.name,
            _kib(self.saved_bytes),
            f"{_kib(grown)} of new timings" if grown > 0 else "every layer's timing came from the cache",
        )

    def manifest(self) -> dict[str, Any]:
        return {"timing_cache": self.path.name, "timing_cache_bytes": [self.loaded_bytes, self.saved_bytes]}


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"
