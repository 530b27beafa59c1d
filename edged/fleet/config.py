"""The ``[fleet]`` table: which keys and certificates a bundle may be signed with, and whether an
unsigned bundle is accepted.

``edged.config`` holds this table in its ``Config``, so this module imports nothing of edged
(``edged.config`` imports it); sizes are checked and paths resolved there, with the others.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated

import msgspec

# A bundle holds a model file or two, calibration samples and a few small files: a bound on what
# one download can make the device read, hash and keep (an archive's members are counted before
# anything is written).
DEFAULT_MAX_BUNDLE_SIZE = "16GiB"
DEFAULT_MAX_BUNDLE_FILES = 10_000
# A topic level and a file name (edged/fleet/protocol.py NAME_RE, which this leaf cannot import).
_GROUP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class FleetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # PEM files: EC public keys (P-256/384/521) and CA certificates a bundle's signature may chain
    # to; relative paths are resolved against the config file's folder.
    trust: list[str] = msgspec.field(default_factory=list)
    # false: a bundle without a signature opens as unsigned (a single device's local models);
    # true: every bundle must be signed by a key or certificate of ``trust``.
    require_signed: bool = False
    max_bundle_size: str = DEFAULT_MAX_BUNDLE_SIZE
    max_bundle_files: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = DEFAULT_MAX_BUNDLE_FILES
    # The device agent (edged/fleet/agent.py): follow {prefix}/fleet/{group}/desired and
    # {prefix}/{device}/fleet/desired over [mqtt]'s broker, and report the fleet state.
    follow: bool = False
    group: str = ""
    # The largest desired-state message read, and the most models it may name.
    max_desired_bytes: Annotated[int, msgspec.Meta(ge=256, le=1 << 20)] = 65536
    max_models: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 64
    # A read from the bundle server slower than this breaks the download off (resumed later,
    # after retry_s, doubling up to 16 times as long).
    download_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    retry_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # A new version's first watch_s seconds of traffic (once it has min_requests) against the
    # previous version's: more errors or a slower p99 than these margins roll it back.
    watch_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    min_requests: Annotated[int, msgspec.Meta(ge=1)] = 50
    max_error_rate_increase: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.02
    max_p99_increase: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    # The compact heartbeat on {prefix}/fleet/{group}/heartbeat/{device}; 0 turns it off.
    heartbeat_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0

    def __post_init__(self) -> None:
        # msgspec turns this into a ValidationError naming `fleet`.
        if self.require_signed and not self.trust:
            raise ValueError("require_signed = true needs at least one path in fleet.trust")
        if self.follow and not _GROUP_RE.match(self.group):
            raise ValueError(
                f"group {self.group!r}: a device that follows a desired state needs a group name "
                "of letters, digits, '_', '.', '-' (at most 64)"
            )

    def resolved(self, base: Path) -> FleetConfig:
        """The table with each trust path made absolute against ``base``."""
        trust = [str(p if p.is_absolute() else (base / p).resolve()) for p in map(_expand, self.trust)]
        return msgspec.structs.replace(self, trust=trust)

    @property
    def trust_paths(self) -> list[Path]:
        return [Path(p) for p in self.trust]


def _expand(value: str) -> Path:
    return Path(os.path.expanduser(value))
