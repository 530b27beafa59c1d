"""Which MQTT messages to run, and when to acknowledge them, so that no message can poison the
session.

A QoS 1/2 message is acknowledged only once it is answered or deliberately dropped, never on
arrival: a message that was still running when the connection dropped (or when edged died) is
then redelivered by the broker instead of lost. Acknowledgements go out in the order the messages
arrived, as MQTT requires (MQTT 5.0 section 4.6), so an early slow request holds back the acks of
later quick ones, never their answers.

A redelivery carries the DUP flag and the packet id of the first delivery. This session
remembers, for a bounded number of recent messages (``mqtt.dedup_window``), whether each is still
running or done, and the journal (journal.py) what the previous run of edged was running
when it ended:

  * running here: the redelivered copy waits for the first and is acknowledged with it;
  * done here: it was answered (or dropped) and only the acknowledgement was lost: acknowledged
    again, counted as 'duplicate', not run twice;
  * running when the previous run ended: edged was killed, crashed, froze or gave up on it.
    Running it again could do the same at every start, so it is acknowledged and dropped,
    counted as 'redelivered';
  * otherwise (it was still in the socket when a connection dropped): run, as a new message.

QoS 0 messages are never redelivered and never acknowledged: they pass through untracked.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from edged.transports.mqtt.journal import Journal, digest

# A message's identity within its session: the broker keeps the packet id of a message that it
# redelivers; the lengths guard against a packet id reused by a later message.
Key = tuple[str, int, int, int]  # topic, packet id, payload length, property block length


class Verdict(enum.Enum):
    NEW = "new"  # run it
    RUNNING = "running"  # a redelivery of a message still running here: acknowledged with it
    DUPLICATE = "duplicate"  # a redelivery of a message answered here: acknowledge, do not run
    REDELIVERED = "redelivered"  # delivered to an earlier run that never answered: drop


@dataclass(eq=False)
class Delivery:
    """One PUBLISH as received on one connection."""

    key: Key
    mid: int
    qos: int
    generation: int
    verdict: Verdict = Verdict.NEW
    done: bool = False
    slot: int = -1  # in the journal while it runs


@dataclass(eq=False)
class _Record:
    waiting: list[Delivery] = field(default_factory=list)


class Deliveries:
    """The received and not yet acknowledged messages of one session, and the recently done."""

    def __init__(self, ack: Callable[[int, int], object], remember: int, journal: Journal) -> None:
        self._ack = ack
        self.journal = journal
        self._remember = max(1, remember)
        self.generation = 0
        self._order: collections.deque[Delivery] = collections.deque()  # this connection's, in arrival order
        self._running: dict[Key, _Record] = {}
        self._done: collections.OrderedDict[Key, None] = collections.OrderedDict()

    @property
    def unacknowledged(self) -> int:
        return len(self._order)

    def connected(self, session_present: bool) -> None:
        """A new connection: acknowledgements owed on the old one are void; the broker
        redelivers those messages (with DUP) on this one if the session survived. A new session
        starts packet ids afresh, so nothing remembered of the old one applies."""
        self.generation += 1
        self._order.clear()
        if not session_present:
            self._running.clear()
            self._done.clear()

    def receive(self, topic: str, mid: int, qos: int, dup: bool, payload_len: int, props_len: int) -> Delivery:
        d = Delivery((topic, mid, payload_len, props_len), mid, qos, self.generation)
        if qos == 0:
            return d
        self._order.append(d)
        key = d.key
        if dup and key in self._running:
            d.verdict = Verdict.RUNNING
            self._running[key].waiting.append(d)
            return d
        if dup and key in self._done:
            d.verdict = Verdict.DUPLICATE
            return d
        if dup and self.journal.failed_before(digest(key)):
            d.verdict = Verdict.REDELIVERED
            return d
        self._done.pop(key, None)  # a packet id freed and reused for a new message
        self._running[key] = _Record([d])
        return d

    def started(self, d: Delivery) -> None:
        """The message begins to run: from now on a restart counts it as having failed."""
        if d.qos:
            d.slot = self.journal.start(digest(d.key))

    def finish(self, d: Delivery) -> None:
        """The message is answered or dropped: acknowledge it (and any redelivered copy), in
        arrival order. A delivery of an earlier connection is only remembered as done."""
        if d.qos == 0:
            return
        self.journal.end(d.slot)
        d.slot = -1
        record = self._running.get(d.key) if d.verdict is Verdict.NEW else None
        owner = record is not None and record.waiting[0] is d  # not a record of a later message
        if owner:
            assert record is not None
            del self._running[d.key]
        for w in record.waiting if owner and record is not None else [d]:
            w.done = True
        if owner or d.verdict is Verdict.REDELIVERED:  # a further redelivery is a duplicate
            self._done[d.key] = None
            self._done.move_to_end(d.key)
            while len(self._done) > self._remember:
                self._done.popitem(last=False)
        while self._order and self._order[0].done:
            head = self._order.popleft()
            self._ack(head.mid, head.qos)
