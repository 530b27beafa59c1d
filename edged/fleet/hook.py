"""The daemon's one entry into the fleet agent: None unless ``[fleet] follow = true``, so a
single device loads none of it (edged/lifecycle/daemon.py calls this before the registry
exists, so that the bundles that served before a restart serve again from the boot on)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from edged.config import Config

if TYPE_CHECKING:
    from edged.fleet.agent import FleetAgent
    from edged.fleet.bundle import Bundle


async def fleet_agent(cfg: Config) -> FleetAgent | None:
    fleet = cfg.fleet
    if not fleet.follow:
        return None
    from edged.fleet.agent import FleetAgent
    from edged.fleet.bundle import open_bundle

    trust = fleet.trust_paths

    def verify(archive: Path, dest: Path) -> Bundle:
        return open_bundle(archive, trust, require_signed=fleet.require_signed, extract_to=dest)

    return await FleetAgent.create(cfg, verify)
