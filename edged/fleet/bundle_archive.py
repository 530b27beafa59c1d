"""A bundle's tar archive (plain, gzip, bzip2 or xz) extracted without trusting it.

Every member is checked before anything is written: a relative name without ``..``, a regular
file or a folder (no link of either kind, no device, no fifo, no sparse file), no name twice,
and the members and their bytes within the limits. Only then does tarfile's ``data`` filter
extract them, into a new folder beside the destination that is renamed into place once whole,
so a failed extraction leaves nothing a later open could take for a bundle.
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import tarfile
from pathlib import Path

from edged.fleet.bundle_base import BundleLimits, BundleRefused

log = logging.getLogger(__name__)


def extract_archive(archive: Path, dest: Path, limits: BundleLimits) -> Path:
    """Extract ``archive`` into ``dest`` (which must not exist); returns ``dest``."""
    if not hasattr(tarfile, "data_filter"):  # Python before 3.10.12 / 3.11.4
        raise BundleRefused(
            f"{archive}: this Python's tarfile has no data filter; use 3.10.12 or newer", "archive_unsafe"
        )
    if dest.exists() or dest.is_symlink():
        raise BundleRefused(f"{dest}: already exists; a bundle is extracted into a new folder", "archive_unsafe")
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(mode=0o755)
    try:
        with _open(archive) as tf:
            members = _checked_members(tf, archive, limits)
            tf.extractall(partial, members=members, filter="data")
        os.replace(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log.info("extracted bundle %s into %s", archive, dest, extra={"phase": "bundle"})
    return dest


def _open(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:*")
    except FileNotFoundError:
        raise BundleRefused(f"{archive}: no such bundle", "not_found") from None
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BundleRefused(f"{archive}: not a tar archive: {e}", "archive_unreadable") from None


def _checked_members(tf: tarfile.TarFile, archive: Path, limits: BundleLimits) -> list[tarfile.TarInfo]:
    members: list[tarfile.TarInfo] = []
    seen: set[str] = set()
    total = 0
    try:
        # Iterating reads one header at a time: a bomb of members stops at the limit.
        for m in tf:
            if len(members) >= limits.max_files:
                raise BundleRefused(
                    f"{archive}: more than {limits.max_files} members (fleet.max_bundle_files)", "too_large"
                )
            name = _safe_name(m.name, archive)
            if not (m.isreg() or m.isdir()) or m.issparse():
                raise BundleRefused(
                    f"{archive}: {m.name}: {_kind(m)}; a bundle holds regular files only", "archive_unsafe"
                )
            if name in seen:
                raise BundleRefused(f"{archive}: {m.name}: appears twice", "archive_unsafe")
            seen.add(name)
            total += m.size
            if total > limits.max_bytes:
                raise BundleRefused(
                    f"{archive}: more than {limits.max_bytes} bytes (fleet.max_bundle_size)", "too_large"
                )
            members.append(m)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BundleRefused(f"{archive}: unreadable after {len(members)} members: {e}", "archive_unreadable") from None
    return members


def _safe_name(name: str, archive: Path) -> str:
    if not name or "\x00" in name or name.startswith("/") or "\\" in name:
        raise BundleRefused(f"{archive}: {name!r}: not a relative POSIX path", "archive_unsafe")
    norm = posixpath.normpath(name)
    if norm == ".":
        return norm
    if any(part == ".." for part in name.split("/")) or norm.startswith("../"):
        raise BundleRefused(f"{archive}: {name}: leaves the bundle ('..')", "archive_unsafe")
    return norm


def _kind(m: tarfile.TarInfo) -> str:
    if m.issym():
        return f"a symbolic link to {m.linkname}"
    if m.islnk():
        return f"a hard link to {m.linkname}"
    if m.ischr() or m.isblk():
        return "a device file"
    if m.isfifo():
        return "a fifo"
    if m.issparse():
        return "a sparse file"
    return "not a regular file"
