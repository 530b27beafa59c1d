"""What every part of a bundle's checks shares: the refusal, the file names and the limits."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from edged.config import parse_size
from edged.fleet.config import DEFAULT_MAX_BUNDLE_FILES, DEFAULT_MAX_BUNDLE_SIZE, FleetConfig

# The files every bundle has, at its top level. The signature covers every other file, these
# two included, so the name, the version and the model's table are signed with the model.
METADATA = "bundle.toml"
MODEL_TABLE = "model.toml"
SIGNATURE = "bundle.sig"

# Small files read whole before they are trusted: a bound on what a hostile one can cost.
MAX_METADATA_BYTES = 64 * 1024
MAX_MODEL_TABLE_BYTES = 1024 * 1024
# The signature lists every file's digest (about 150 bytes each) under base64.
MAX_SIGNATURE_BYTES = 16 * 1024 * 1024


class BundleRefused(Exception):
    """A bundle that is not used: ``reason`` names the file or the key, ``code`` is stable
    (the metric's label, the MQTT event's field)."""

    def __init__(self, reason: str, code: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code

    def __str__(self) -> str:
        return f"{self.reason} ({self.code})"


# Every code a refusal carries: the metric has a zero sample of each from the first scrape.
REFUSAL_CODES = (
    "not_found",  # no such directory or archive
    "archive_unsafe",  # an absolute path, '..', a link, a device or fifo, a duplicate member
    "archive_unreadable",  # not a tar archive, or a truncated one
    "too_large",  # beyond fleet.max_bundle_size or fleet.max_bundle_files
    "not_a_bundle",  # bundle.toml or model.toml missing
    "metadata_invalid",  # bundle.toml: name, version or created wrong
    "config_invalid",  # model.toml: a key edged refuses, a path outside the bundle
    "unsigned",  # no bundle.sig and fleet.require_signed = true
    "trust_invalid",  # a fleet.trust file that is not a usable key or certificate
    "untrusted_signer",  # signed by a key or certificate that fleet.trust does not accept
    "signature_malformed",  # bundle.sig is not a model-signing signature edged reads
    "signature_invalid",  # the signature does not verify
    "file_modified",  # a file's digest differs from the signed one
    "file_added",  # a file the signature does not list
    "file_missing",  # a file the signature lists is absent
    # The agent's, against the desired state: the bundle verified but is not the one asked for.
    "digest_mismatch",  # the download's digest differs from the desired one
    "version_mismatch",  # the signed version differs from the desired one
    "version_replayed",  # the signed version is older than the one already serving
)


def read_bounded(path: Path, limit: int, label: str, code: str) -> bytes:
    """A small file read whole, never through a link; a refusal naming ``label`` when it cannot
    be read or holds more than ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise BundleRefused(f"{label}: cannot read: {e.strerror}", code) from None
    if len(data) > limit:
        raise BundleRefused(f"{label}: larger than {limit} bytes", code)
    return data


@dataclass(frozen=True)
class BundleLimits:
    """What one bundle may hold: files and folders together, and their bytes."""

    max_bytes: int
    max_files: int

    @classmethod
    def from_config(cls, fleet: FleetConfig) -> BundleLimits:
        return cls(max_bytes=parse_size(fleet.max_bundle_size), max_files=fleet.max_bundle_files)


DEFAULT_LIMITS = BundleLimits(max_bytes=parse_size(DEFAULT_MAX_BUNDLE_SIZE), max_files=DEFAULT_MAX_BUNDLE_FILES)
