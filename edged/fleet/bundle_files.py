"""A bundle's folder walked and hashed: regular files and folders only, within the limits.

The walk never follows a link and refuses one, as it refuses a device, a fifo or a socket: a
bundle is data, and a link could point the model's path or a calibration folder at a file of
the device that the signature never covered.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from edged.fleet.bundle_base import BundleLimits, BundleRefused

_CHUNK = 1 << 20


def scan_tree(root: Path, limits: BundleLimits) -> list[str]:
    """Every regular file under ``root``, as sorted POSIX paths relative to it."""
    try:
        top = os.lstat(root)
    except FileNotFoundError:
        raise BundleRefused(f"{root}: no such bundle", "not_found") from None
    if not stat.S_ISDIR(top.st_mode):
        raise BundleRefused(f"{root}: not a folder", "not_found")
    files: list[str] = []
    entries = 0
    total = 0
    stack = [root]
    while stack:
        folder = stack.pop()
        with os.scandir(folder) as it:
            for entry in it:
                entries += 1
                if entries > limits.max_files:
                    raise BundleRefused(
                        f"{root}: more than {limits.max_files} files and folders (fleet.max_bundle_files)", "too_large"
                    )
                rel = Path(entry.path).relative_to(root).as_posix()
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(Path(entry.path))
                elif stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    if total > limits.max_bytes:
                        raise BundleRefused(
                            f"{root}: more than {limits.max_bytes} bytes (fleet.max_bundle_size)", "too_large"
                        )
                    files.append(rel)
                else:
                    raise BundleRefused(
                        f"{rel}: {_kind(st.st_mode)}; a bundle holds regular files only", "archive_unsafe"
                    )
    return sorted(files)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, hex: what model-signing records for each file."""
    h = hashlib.sha256()
    # O_NOFOLLOW: a file swapped for a link after the walk is refused, not followed.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest_files(root: Path, rels: Iterable[str]) -> dict[str, str]:
    return {rel: file_digest(root / rel) for rel in rels}
