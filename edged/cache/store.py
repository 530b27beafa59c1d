"""The engine cache: key, manifest, file lock, atomic writes, quarantine.

One artefact plus one JSON manifest per entry, named by the model and a key that covers everything
an artefact is bound to (design section 5). Writes go to a temporary file in the same directory,
are fsynced and renamed into place, so a crash leaves either the old entry or the new one. A build
holds an exclusive ``flock`` on the entry so two processes never build it at once. An entry whose
artefact or manifest does not check out is moved to ``quarantine/`` and rebuilt, never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
_CHUNK = 1 << 20


def file_digest(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cache_key(fields: Mapping[str, Any]) -> str:
    """sha256 over a canonical JSON of the key fields (model digest, precision, profiles,
    calibration digest and method, backend name and version, device fingerprint, build options)."""
    canon = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either the old or the new bytes, never a mix."""
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{os.getpid()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


@dataclass(frozen=True)
class Entry:
    """A cache entry that checked out: its artefact can be loaded."""

    key: str
    artifact: Path
    manifest_path: Path
    manifest: dict[str, Any]


class EngineCache:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.quarantine_dir = self.dir / "quarantine"
        # Artefact digests are trusted by (size, mtime, inode) like source files: a reload must
        # not re-read every engine. A load that fails checks the artefact in full (verify()).
        self.digests = SourceDigests(self.dir)

    def prepare(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        self._remove_stale_temporaries()

    # --- names ---

    def stem(self, model: str, key: str) -> str:
        return f"{model}-{key[:20]}"

    def artifact_path(self, model: str, key: str, suffix: str) -> Path:
        return self.dir / f"{self.stem(model, key)}{suffix}"

    def manifest_path(self, model: str, key: str) -> Path:
        return self.dir / f"{self.stem(model, key)}.json"

    # --- reading ---

    def read_manifest(self, model: str, key: str) -> dict[str, Any] | None:
        path = self.manifest_path(model, key)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.quarantine(path, f"unreadable manifest: {e}")
            return None
        return data if isinstance(data, dict) else None

    def lookup(self, model: str, key: str, suffix: str) -> Entry | None:
        """The entry for ``key`` if its manifest and artefact check out; None (after moving
        anything bad aside) when it must be built."""
        manifest = self.read_manifest(model, key)
        if manifest is None:
            return None
        mpath = self.manifest_path(model, key)
        artifact = self.artifact_path(model, key, suffix)
        problem = self._check(manifest, key, artifact)
        if problem:
            log.warning("cache entry %s rejected: %s", mpath.name, problem, extra={"model": model})
            self.quarantine(artifact, problem)
            self.quarantine(mpath, problem)
            return None
        return Entry(key, artifact, mpath, manifest)

    def _check(self, manifest: Mapping[str, Any], key: str, artifact: Path) -> str:
        if manifest.get("version") != MANIFEST_VERSION:
            return f"manifest version {manifest.get('version')!r} != {MANIFEST_VERSION}"
        if manifest.get("key") != key:
            return "manifest key does not match the entry"
        if manifest.get("artifact") is None:
            return ""  # a record without an artefact (a precision the gate rejected)
        try:
            size = artifact.stat().st_size
        except FileNotFoundError:
            return "artefact is missing"
        if size != manifest.get("artifact_size"):
            return f"artefact size {size} != manifest {manifest.get('artifact_size')}"
        if self.digests.digest(str(artifact)) != manifest.get("artifact_sha256"):
            return "artefact checksum does not match the manifest"
        return ""

    def verify(self, entry: Entry) -> str:
        """The full check, reading every byte: '' when the artefact matches its manifest."""
        if entry.manifest.get("artifact") is None:
            return ""
        try:
            actual = file_digest(entry.artifact)
        except OSError as e:
            return f"artefact cannot be read: {e.strerror}"
        if actual != entry.manifest.get("artifact_sha256"):
            return "artefact checksum does not match the manifest (corrupted on disk)"
        return ""

    # --- writing ---

    @contextlib.contextmanager
    def lock(self, model: str, key: str, timeout: float | None = None) -> Iterator[None]:
        """Exclusive build lock on one entry, across processes."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f".{self.stem(model, key)}.lock"
        with open(path, "a+b") as f:
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"cache entry {path.name} is locked") from None
                    time.sleep(0.05)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def temp_path(self, suffix: str) -> Path:
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{os.getpid()}-", suffix=suffix, dir=self.dir)
        os.close(fd)
        return Path(tmp)

    def commit(
        self,
        model: str,
        key: str,
        suffix: str,
        tmp_artifact: Path | None,
        manifest: dict[str, Any],
    ) -> Entry:
        """Move a finished artefact into place and write its manifest (the manifest last, so a
        crash between the two leaves an entry that fails its check and is rebuilt)."""
        artifact = self.artifact_path(model, key, suffix)
        manifest = dict(manifest, version=MANIFEST_VERSION, key=key, model=model)
        if tmp_artifact is not None:
            with open(tmp_artifact, "rb+") as f:
                os.fsync(f.fileno())
            manifest["artifact"] = artifact.name
            manifest["artifact_size"] = tmp_artifact.stat().st_size
            manifest["artifact_sha256"] = file_digest(tmp_artifact)
            os.replace(tmp_artifact, artifact)
        else:
            manifest["artifact"] = None
        mpath = self.manifest_path(model, key)
        atomic_write(mpath, json.dumps(manifest, indent=2, sort_keys=True).encode())
        return Entry(key, artifact, mpath, manifest)

    def update_manifest(self, entry: Entry, **fields: Any) -> Entry:
        manifest = dict(entry.manifest, **fields)
        atomic_write(entry.manifest_path, json.dumps(manifest, indent=2, sort_keys=True).encode())
        return Entry(entry.key, entry.artifact, entry.manifest_path, manifest)

    def quarantine(self, path: Path, reason: str) -> None:
        if not path.exists():
            return
        self.digests.forget(str(path))
        dest = self.quarantine_dir / f"{path.name}.{int(time.time())}"
        try:
            self.quarantine_dir.mkdir(exist_ok=True)
            os.replace(path, dest)
            (dest.parent / f"{dest.name}.why").write_text(reason + "\n")
            log.warning("moved %s aside to %s: %s", path.name, dest, reason)
        except OSError as e:  # never let a cache problem stop the daemon
            log.error("cannot move %s aside (%s); removing it", path, e)
            with contextlib.suppress(OSError):
                path.unlink()

    def remove_temporaries(self, pid: int) -> None:
        """A build that failed (a full disk, an error) removes what it wrote at once, so the
        space comes back before the next build rather than at the next start."""
        for tmp in [*self.dir.glob(f".tmp-{pid}-*"), *self.dir.glob(f"qdq/.tmp-{pid}-*")]:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()

    def _remove_stale_temporaries(self) -> None:
        """Temporaries of a build that died (its pid is gone) never become entries."""
        for tmp in [*self.dir.glob(".tmp-*"), *self.dir.glob("qdq/.tmp-*")]:
            try:
                pid = int(tmp.name.split("-")[1])
            except (IndexError, ValueError):
                continue
            if pid != os.getpid() and not _pid_alive(pid):
                with contextlib.suppress(OSError):
                    if tmp.is_dir():
                        shutil.rmtree(tmp)  # a quantizer's work folder
                    else:
                        tmp.unlink()
                    log.info("removed %s left by a build that died", tmp.name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SourceDigests:
    """sha256 of model and calibration files, remembered by (size, mtime, inode) so a warm boot
    does not re-hash hundreds of megabytes of models."""

    def __init__(self, directory: Path, hasher: Callable[[str], str] = file_digest) -> None:
        self.path = directory / "digests.json"
        self._known: dict[str, dict[str, Any]] | None = None
        self._dirty = False
        self._hasher = hasher
        # Resolving runs in worker threads (never on the event loop); one lock keeps the index whole.
        self._lock = threading.Lock()

    def _load(self) -> dict[str, dict[str, Any]]:
        if self._known is None:
            try:
                data = json.loads(self.path.read_bytes())
                self._known = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self._known = {}
        return self._known

    def digest(self, path: str) -> str:
        st = os.stat(path)
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        with self._lock:
            hit = self._load().get(path)
        if hit and hit.get("stamp") == stamp:
            return str(hit["sha256"])
        value = self._hasher(path)
        with self._lock:
            self._load()[path] = {"stamp": stamp, "sha256": value}
            self._dirty = True
        return value

    def forget(self, path: str) -> None:
        with self._lock:
            if self._load().pop(path, None) is not None:
                self._dirty = True

    def prune(self) -> int:
        """Drop the digests of files that no longer exist (the index never grows without bound)."""
        with self._lock:
            known = self._load()
            gone = [p for p in known if not os.path.exists(p)]
            for p in gone:
                del known[p]
            self._dirty = self._dirty or bool(gone)
        return len(gone)

    def save(self) -> None:
        """Blocking (fsync): call it from a worker thread, never on the event loop."""
        with self._lock:
            if not self._dirty or self._known is None:
                return
            data = json.dumps(self._known, sort_keys=True).encode()
            self._dirty = False
        try:
            atomic_write(self.path, data)
        except OSError as e:
            with self._lock:
                self._dirty = True
            log.warning("cannot save source digests: %s", e)
