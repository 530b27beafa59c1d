"""Fetching a bundle: resumable, digest-checked, bounded, placed atomically.

Blocking code, run in a worker thread (the agent never calls it on the event loop). A bundle is
an archive (tar, optionally compressed; edged/fleet/bundle.py unpacks and verifies it) named by
an http(s) URL or an absolute local path; the desired state gives its SHA-256, and nothing is
unpacked before the whole file matches it.

The bytes received so far stay in ``{area}/partial/{sha256}.part`` (flushed as they arrive), so a
device that reboots or loses its link mid-download asks for the rest with a Range request
(``Range: bytes=N-``); a server that answers 200 instead of 206 sends it whole again and the
partial file starts over. Every download is bounded by ``max_bytes`` (announced and received),
and every read by a time-out, so a hostile or stuck server costs a bounded amount of disk and time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from edged.fleet.desired import Target

log = logging.getLogger(__name__)

CHUNK = 1 << 16
Progress = Callable[[int, int], None]  # bytes so far, bytes expected (0: unknown)


class DownloadError(Exception):
    def __init__(self, reason: str, code: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class Cancelled(Exception):
    """The desired state moved on while this download ran."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    read_timeout_s: float = 30.0


def archive_path(area: Path, sha256: str) -> Path:
    return area / "archives" / f"{sha256}.bundle"


def fetch(t: Target, area: Path, limits: Limits, cancel: threading.Event, progress: Progress) -> Path:
    """The verified archive for ``t`` under ``area``, downloading (or resuming) it if needed."""
    final = archive_path(area, t.sha256)
    if final.exists():
        return final  # placed only after its digest matched
    part = area / "partial" / f"{t.sha256}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    cap = min(limits.max_bytes, t.size) if t.size else limits.max_bytes
    if t.url.startswith("/"):
        _copy_local(Path(t.url), part, cap, cancel, progress)
    else:
        _download(t.url, part, cap, limits.read_timeout_s, cancel, progress)
    digest = _sha256(part)
    if digest != t.sha256:
        part.unlink(missing_ok=True)  # a wrong file is never resumed
        raise DownloadError(
            f"the download's sha256 is {digest[:16]}…, the desired state says {t.sha256[:16]}…", "digest"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, final)
    _fsync_dir(final.parent)
    return final


def _copy_local(src: Path, part: Path, cap: int, cancel: threading.Event, progress: Progress) -> None:
    if not src.is_file():
        raise DownloadError(f"{src} is not a file (a bundle is fetched as one archive)", "not_found")
    size = src.stat().st_size
    if size > cap:
        raise DownloadError(f"{src} has {size} bytes, over the limit of {cap}", "too_large")
    with open(src, "rb") as f, open(part, "wb") as out:
        _pump(f, out, 0, cap, size, cancel, progress)


def _download(url: str, part: Path, cap: int, timeout: float, cancel: threading.Event, progress: Progress) -> None:
    have = part.stat().st_size if part.exists() else 0
    if have > cap:
        part.unlink()
        have = 0
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the partial file is already whole: the digest decides
            return
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}", "http") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DownloadError(f"{url}: {getattr(e, 'reason', e)}", "unreachable") from None
    with resp:
        start = _resume_offset(resp.status, resp.headers.get("Content-Range", ""), have, url)
        length = resp.headers.get("Content-Length")
        expected = start + int(length) if length and length.isdigit() else 0
        if expected > cap:
            raise DownloadError(f"{url}: {expected} bytes announced, over the limit of {cap}", "too_large")
        if start:
            log.info("resuming %s at byte %d", url, start)
        with open(part, "r+b" if start else "wb") as out:
            out.seek(start)
            out.truncate()
            try:
                _pump(resp, out, start, cap, expected, cancel, progress)
            except (OSError, TimeoutError) as e:
                raise DownloadError(f"{url}: the transfer broke off: {e}", "unreachable") from None


def _resume_offset(status: int, content_range: str, have: int, url: str) -> int:
    if status == 200:
        return 0  # the server ignored the Range: it sends the whole file again
    if status == 206:
        # "bytes START-END/TOTAL": the server must resume where the partial file ends.
        try:
            start = int(content_range.split()[1].split("-")[0])
        except (IndexError, ValueError):
            raise DownloadError(f"{url}: unreadable Content-Range {content_range[:80]!r}", "http") from None
        if start != have:
            raise DownloadError(f"{url}: asked to resume at {have}, the server sent from {start}", "http")
        return start
    raise DownloadError(f"{url}: HTTP {status}", "http")


def _pump(
    src: BinaryIO, out: BinaryIO, done: int, cap: int, expected: int, cancel: threading.Event, progress: Progress
) -> None:
    while True:
        if cancel.is_set():
            raise Cancelled()
        chunk = src.read(CHUNK)
        if not chunk:
            break
        done += len(chunk)
        if done > cap:
            raise DownloadError(f"more than {cap} bytes received: over the limit", "too_large")
        out.write(chunk)
        out.flush()  # what arrived survives a restart: the next run resumes after it
        progress(done, expected)
    out.flush()
    os.fsync(out.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(area: Path, keep: set[str]) -> None:
    """Remove the archives and unpacked bundles whose digest is not in ``keep`` (the versions
    serving and the previous ones), and partial downloads of other digests."""
    for folder, suffix in (("archives", ".bundle"), ("partial", ".part")):
        for p in (area / folder).glob(f"*{suffix}"):
            if p.name[: -len(suffix)] not in keep:
                p.unlink(missing_ok=True)
    for p in (area / "bundles").glob("*"):
        if p.name.startswith("."):
            continue  # an archive being unpacked (edged/fleet/bundle_archive.py names it so)
        if p.is_dir() and p.name.rsplit("-", 1)[-1] not in {k[:16] for k in keep}:
            shutil.rmtree(p, ignore_errors=True)


def bundle_dir(area: Path, name: str, t: Target) -> Path:
    return area / "bundles" / f"{name}-{t.sha256[:16]}"
