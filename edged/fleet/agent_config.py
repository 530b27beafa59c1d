"""The device agent's keys of the ``[fleet]`` table (docs/configuration.md#fleet).

The bundle keys (``trust``, ``require_signed``) live in edged/fleet/config.py; these say whether
the device follows a desired state over MQTT, in which group, and the limits and margins of
each step. The connection is ``[mqtt]``'s (host, port, TLS, credentials, topic prefix, device id).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from edged.config import parse_size
from edged.errors import ConfigError
from edged.fleet.protocol import topic_part

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class FleetAgentConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Follow {prefix}/fleet/{group}/desired and {prefix}/{device}/fleet/desired.
    follow: bool = False
    group: str = ""
    # Largest bundle archive fetched (announced or received) and unpacked.
    max_bundle_size: str = "4GiB"
    # Largest desired-state message read, and most models it may name.
    max_desired_bytes: Annotated[int, msgspec.Meta(ge=256, le=1 << 20)] = 65536
    max_models: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 64
    # A read from the bundle server that takes longer fails the download (it resumes later).
    download_timeout_s: PositiveFloat = 30.0
    # A failed download is tried again after this long (doubling up to 16 times as long).
    retry_s: PositiveFloat = 5.0
    # The first watch_s seconds of a new version's traffic decide whether it stays.
    watch_s: NonNegFloat = 300.0
    min_requests: Annotated[int, msgspec.Meta(ge=1)] = 50
    max_error_rate_increase: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.02
    max_p99_increase: NonNegFloat = 0.5
    # The compact heartbeat on {prefix}/fleet/{group}/heartbeat/{device}; 0 turns it off.
    heartbeat_interval_s: NonNegFloat = 60.0

    @property
    def max_bundle_bytes(self) -> int:
        return parse_size(self.max_bundle_size)

    def check(self) -> None:
        """Raise ConfigError for values the types cannot say are wrong."""
        try:
            self.max_bundle_bytes  # noqa: B018 - parsed for its error
        except ValueError as e:
            raise ConfigError(f"fleet.max_bundle_size: {e}") from None
        if self.follow:
            if not self.group:
                raise ConfigError("fleet.group: a device that follows a desired state needs its group")
            topic_part(self.group, "fleet.group")
