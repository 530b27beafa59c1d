"""Which messages a run of edged was processing when it ended: a small file, memory-mapped.

The broker redelivers an unacknowledged QoS 1 message after a reconnect with the DUP flag set.
DUP alone does not say the message is harmful: messages still in the socket when a connection
drops come back with DUP too, and running them is right. What marks a poison message is that a
run of edged *started* it and never finished: it was running when edged was killed, crashed,
froze or stopped without finishing it. So each message gets a slot in this file (a 16-byte digest
of its identity) while it runs, cleared when it ends; a write to a shared mapping is a memory
store (no system call) and survives the process, so the next start reads what was running and
drops those messages when they are redelivered instead of running them again.

A power cut may lose the last writes (no fsync per message): such a message is run once more.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger(__name__)

SLOT = 16
_EMPTY = bytes(SLOT)


def digest(key: tuple[str, int, int, int]) -> bytes:
    topic, mid, payload_len, props_len = key
    return hashlib.blake2b(f"{topic}\0{mid}\0{payload_len}\0{props_len}".encode(), digest_size=SLOT).digest()


class Journal:
    """``slots`` messages at most are recorded at once (the transport's in-flight limit)."""

    def __init__(self, path: Path | None, slots: int) -> None:
        self.slots = slots
        self.previous: set[bytes] = set()  # running when the previous run ended
        self._free = list(range(slots - 1, -1, -1))
        self._map: mmap.mmap | bytearray = bytearray(slots * SLOT)
        if path is not None:
            try:
                self._map = self._open(path, slots)
            except OSError as e:  # still correct within this run; only a restart forgets
                log.warning("MQTT: cannot keep %s (%s); redeliveries after a restart are not recognised", path, e)

    def _open(self, path: Path, slots: int) -> mmap.mmap:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            old = os.pread(fd, 1 << 20, 0)
            self.previous = {old[i : i + SLOT] for i in range(0, len(old) - SLOT + 1, SLOT)} - {_EMPTY}
            os.ftruncate(fd, 0)
            os.ftruncate(fd, slots * SLOT)
            return mmap.mmap(fd, slots * SLOT)
        finally:
            os.close(fd)

    def failed_before(self, d: bytes) -> bool:
        """Whether the previous run was processing this message when it ended (asked once)."""
        if d in self.previous:
            self.previous.discard(d)
            return True
        return False

    def start(self, d: bytes) -> int:
        """Record a running message; -1 when every slot is taken (then it is not recorded)."""
        if not self._free:
            return -1
        slot = self._free.pop()
        self._map[slot * SLOT : (slot + 1) * SLOT] = d
        return slot

    def end(self, slot: int) -> None:
        if slot < 0:
            return
        self._map[slot * SLOT : (slot + 1) * SLOT] = _EMPTY
        self._free.append(slot)

    def close(self) -> None:
        """Keep what still runs (left unacknowledged) for the next start."""
        if isinstance(self._map, mmap.mmap):
            self._map.close()
