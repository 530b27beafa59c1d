"""Connection slots shared fairly: no peer can take every slot, and health checks always get in.

Every listener draws on one pool of ``max_connections`` slots. A peer (a uid on a Unix socket, a
remote address on TCP) holds at most ``max_connections_per_peer`` of them, so one process holding
any number of connections leaves the rest to the others. A TCP connection to a listener with a
token is *pending* until its first request carries the token: pending connections are the first to
go, oldest first, when a new connection finds its peer's share or the pool full (many loopback
addresses are one local user's, so unauthenticated connections must never keep anyone out).

Beyond the pool, ``reserved_connections`` slots (at most ``RESERVE_PER_PEER`` per peer) take a
connection that found no room: it may make one request, to ``/v2/health/*`` or ``/metrics``,
and is closed after its answer. Anything else there is a 503, like a connection refused outright.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import Enum

from edged.config import Config, parse_size
from edged.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

RESERVE_PER_PEER = 2


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_size: int = 16 * 1024
    max_headers: int = 100
    read_timeout_s: float = 30.0
    max_connections: int = 512
    max_connections_per_peer: int = 64
    reserved_connections: int = 16

    @classmethod
    def from_config(cls, cfg: Config) -> ConnectionLimits:
        s = cfg.server
        return cls(
            parse_size(s.max_header_size),
            s.max_headers,
            s.read_timeout_s,
            s.max_connections,
            min(s.max_connections_per_peer, s.max_connections),
            s.reserved_connections,
        )


class Slot(Enum):
    POOL = "pool"  # a connection like any other
    RESERVE = "reserve"  # one health or metrics request, then closed


class Holder:
    """What the slots know of a connection: its peer, its slot, and how to close it."""

    __slots__ = ("close", "key", "pending", "slot")

    def __init__(self, key: Hashable, close: Callable[[], None]) -> None:
        self.key = key
        self.close = close
        self.slot: Slot | None = None
        self.pending = False


class ConnectionSlots:
    """Open connections across every listener, per peer, and the log of refusals: at most one line
    per kind every ratelog.EVERY_S seconds (with the count since), so a flood cannot fill the journal."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open = 0  # in the pool
        self.reserved = 0
        self._per_peer: dict[Hashable, int] = {}
        self._reserved_per_peer: dict[Hashable, int] = {}
        # Pending connections (no token shown yet), oldest first: all of them, and per peer, so
        # that making room costs the same however many are pending.
        self._pending: OrderedDict[Holder, None] = OrderedDict()
        self._pending_of: dict[Hashable, OrderedDict[Holder, None]] = {}
        self._log = RateLimitedLog(log)

    def note(self, kind: str, message: str) -> None:
        self._log.note(logging.WARNING, kind, "%s", message)

    def admit(self, holder: Holder, pending: bool) -> Slot | None:
        """A slot for a new connection, evicting a pending one where that makes room; None: refused."""
        lim, key = self.limits, holder.key
        if self._per_peer.get(key, 0) >= lim.max_connections_per_peer:
            self._evict(self._pending_of.get(key))
        if self.open >= lim.max_connections and self._per_peer.get(key, 0) < lim.max_connections_per_peer:
            self._evict(self._pending)
        if self.open < lim.max_connections and self._per_peer.get(key, 0) < lim.max_connections_per_peer:
            self.open += 1
            self._per_peer[key] = self._per_peer.get(key, 0) + 1
            holder.slot = Slot.POOL
            if pending:
                holder.pending = True
                self._pending[holder] = None
                self._pending_of.setdefault(key, OrderedDict())[holder] = None
            return Slot.POOL
        if self.reserved < lim.reserved_connections and self._reserved_per_peer.get(key, 0) < RESERVE_PER_PEER:
            self.reserved += 1
            self._reserved_per_peer[key] = self._reserved_per_peer.get(key, 0) + 1
            holder.slot = Slot.RESERVE
            return Slot.RESERVE
        return None

    def authenticated(self, holder: Holder) -> None:
        """The connection's first request carried the token: it is no longer the first to go."""
        if holder.pending:
            holder.pending = False
            self._pending.pop(holder, None)
            of_peer = self._pending_of.get(holder.key)
            if of_peer is not None:
                of_peer.pop(holder, None)
                if not of_peer:
                    del self._pending_of[holder.key]

    def release(self, holder: Holder) -> None:
        """The connection's slot back (once: a second call does nothing)."""
        slot, key = holder.slot, holder.key
        holder.slot = None
        self.authenticated(holder)
        if slot is Slot.POOL:
            self.open -= 1
            _drop(self._per_peer, key)
        elif slot is Slot.RESERVE:
            self.reserved -= 1
            _drop(self._reserved_per_peer, key)

    def _evict(self, pending: OrderedDict[Holder, None] | None) -> None:
        """Close the oldest of ``pending`` connections, if any, its slot freed at once."""
        victim = next(iter(pending), None) if pending else None
        if victim is None:
            return
        self.release(victim)
        self.note("evicted", "closed the oldest connection that had shown no token, to make room for a new one")
        victim.close()

    def held_by(self, key: Hashable) -> int:
        return self._per_peer.get(key, 0)


def _drop(counts: dict[Hashable, int], key: Hashable) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
