"""What the agent's parts (worker, attempt, heartbeat, version metrics) use of the agent, as a
Protocol: they depend on this, and edged/fleet/agent.py, which imports them, implements it, so
no two modules import each other."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from edged.config import Config, ModelConfig
    from edged.fleet import desired, ledger, rollback
    from edged.fleet.bundle import Bundle
    from edged.fleet.config import FleetConfig
    from edged.fleet.refusals import Refusals
    from edged.serving.background import BackgroundBuilds
    from edged.serving.registry import Registry
    from edged.serving.service import Service
    from edged.transports.mqtt.link import Link


class Cancellable(Protocol):
    name: str
    t: desired.Target
    cancel: Any  # threading.Event


class Agent(Protocol):
    cfg: Config
    fleet: FleetConfig
    area: Path
    book: ledger.Ledger
    wanted: dict[str, desired.Target]
    overlay: dict[str, ModelConfig]
    max_bundle_bytes: int
    verify: Callable[[Path, Path], Bundle]
    changed: asyncio.Event
    current: Cancellable | None
    previous_windows: dict[str, rollback.Window]
    refusals: Refusals | None
    service: Service | None
    background: BackgroundBuilds | None
    link: Link | None
    prefix: str
    group: str
    device: str

    @property
    def registry(self) -> Registry: ...

    def set_phase(self, name: str, phase: str, reason: str = "", **fields: Any) -> None: ...

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...

    def from_thread(self, fn: Callable[..., Any], *args: Any) -> None: ...

    async def reload_now(self) -> tuple[bool, str]: ...

    def window_since_swap(self, name: str) -> rollback.Window: ...

    def swapped(self, name: str, before: rollback.Window) -> None: ...

    def version(self, name: str) -> str: ...
