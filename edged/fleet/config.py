"""The ``[fleet]`` table: which keys and certificates a bundle may be signed with, and whether an
unsigned bundle is accepted.

``edged.config`` holds this table in its ``Config``, so this module imports nothing of edged
(``edged.config`` imports it); sizes are checked and paths resolved there, with the others.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import msgspec

# A bundle holds a model file or two, calibration samples and a few small files: a bound on what
# one download can make the device read, hash and keep (an archive's members are counted before
# anything is written).
DEFAULT_MAX_BUNDLE_SIZE = "16GiB"
DEFAULT_MAX_BUNDLE_FILES = 10_000


class FleetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # PEM files: EC public keys (P-256/384/521) and CA certificates a bundle's signature may chain
    # to; relative paths are resolved against the config file's folder.
    trust: list[str] = msgspec.field(default_factory=list)
    # false: a bundle without a signature opens as unsigned (a single device's local models);
    # true: every bundle must be signed by a key or certificate of ``trust``.
    require_signed: bool = False
    max_bundle_size: str = DEFAULT_MAX_BUNDLE_SIZE
    max_bundle_files: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = DEFAULT_MAX_BUNDLE_FILES

    def __post_init__(self) -> None:
        # msgspec turns this into a ValidationError naming `fleet`.
        if self.require_signed and not self.trust:
            raise ValueError("require_signed = true needs at least one path in fleet.trust")

    def resolved(self, base: Path) -> FleetConfig:
        """The table with each trust path made absolute against ``base``."""
        trust = [str(p if p.is_absolute() else (base / p).resolve()) for p in map(_expand, self.trust)]
        return msgspec.structs.replace(self, trust=trust)

    @property
    def trust_paths(self) -> list[Path]:
        return [Path(p) for p in self.trust]


def _expand(value: str) -> Path:
    return Path(os.path.expanduser(value))
