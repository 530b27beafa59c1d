"""One message of the descriptor socket (memfd_socket.py): its descriptors and its JSON, checked.

Pure functions apart from the closer: a descriptor that cannot carry seals may be anything (a
socket with a long SO_LINGER, a file on a FUSE mount that never answers), and closing it can
block, so it is closed on a thread of its own, never on the event loop.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from edged.errors import BadRequestError, SharedMemoryError
from edged.transports.shm.memfd import sealable
from edged.wire.jsondoc import load_object

MAX_MESSAGE = 4096
# Room for more descriptors than allowed, so that extra ones arrive (and are closed) instead of
# being cut off silently: the answer can then say what was wrong.
FD_ROOM = 16
ANCILLARY = socket.CMSG_SPACE(FD_ROOM * array.array("i").itemsize)

_closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edged-fd-close")


@dataclass(frozen=True)
class Received:
    """The descriptors of one message: shmem ones (with their seals) and all the others."""

    memfds: list[tuple[int, int]]  # (descriptor, seals)
    others: list[int]

    @property
    def count(self) -> int:
        return len(self.memfds) + len(self.others)


def descriptors(ancillary: list[tuple[int, int, bytes]]) -> Received:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    memfds, others = [], []
    for fd in fds:
        seals = sealable(fd)
        if seals is None:
            others.append(fd)
        else:
            memfds.append((fd, seals))
    return Received(memfds, others)


def close_all(received: Received, done: Callable[[int], None]) -> None:
    """Shmem descriptors now (their close never waits on anything); the others on the closer
    thread, ``done(n)`` called from that thread after each batch of ``n``."""
    for fd, _ in received.memfds:
        with contextlib.suppress(OSError):
            os.close(fd)
    if received.others:
        _closer.submit(_close, list(received.others), done)


def _close(fds: list[int], done: Callable[[int], None]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    done(len(fds))


def parse(msg: bytes, flags: int, received: Received) -> tuple[str, int, int, int, int]:
    """(name, offset, byte_size, the descriptor, its seals) of a registration, or the error."""
    if flags & socket.MSG_TRUNC:
        raise BadRequestError(f"a registration message is at most {MAX_MESSAGE} bytes")
    if flags & socket.MSG_CTRUNC or received.count != 1:
        carried = f"more than {received.count}" if flags & socket.MSG_CTRUNC else str(received.count)
        raise BadRequestError(
            f"a registration message carries exactly one descriptor (SCM_RIGHTS), this one carried {carried}"
        )
    if not received.memfds:
        raise SharedMemoryError(
            "the descriptor is not a memfd that can be sealed (memfd_create with MFD_ALLOW_SEALING); "
            "register a POSIX shared memory object by its key instead"
        )
    doc = load_object(
        msg,
        "a registration message is a JSON object with 'name' and 'byte_size'",
        "a registration message is a JSON object",
    )
    name, size, offset = doc.get("name"), doc.get("byte_size"), doc.get("offset", 0)
    if not isinstance(name, str):
        raise BadRequestError("'name' must be a string")
    if not isinstance(size, int) or not isinstance(offset, int) or isinstance(size, bool) or isinstance(offset, bool):
        raise BadRequestError("'byte_size' and 'offset' must be integers")
    unknown = set(doc) - {"name", "byte_size", "offset"}
    if unknown:
        raise BadRequestError(f"unknown keys in a registration message: {sorted(unknown)}")
    fd, seals = received.memfds[0]
    return name, offset, size, fd, seals
