"""The descriptor socket: clients hand sealed memfds to the daemon (SCM_RIGHTS), one per message.

HTTP cannot carry a file descriptor, and the event loop's stream transports read with recv(),
which drops any that arrive. So registering a region by descriptor has a socket of its own, next
to the API's (``<socket>.fd``, same mode and group; or a SOCK_SEQPACKET socket passed by socket
activation). SOCK_SEQPACKET keeps each message and its descriptor together:

    request: {"name": "cam0", "byte_size": 4915200, "offset": 0}  + exactly one descriptor
    answer:  {"registered": "cam0"}  or  {"error": "...", "code": "shm_invalid"}

The region then belongs to the sending process (SO_PEERCRED) exactly like one registered over
HTTP: the same process names it in requests, unregisters it over HTTP, and loses it when it
exits. Every client is untrusted: a message is at most 4 KiB; every descriptor received is
closed, those that are not shmem on a thread (fd_message.py), and the connections of a user with
too many of them still to close are not read until they are; a message with several is refused whole; the
connections are capped in total and per user, idle ones closed after IDLE_S; a client that does
not read its answers is disconnected rather than waited on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field

import orjson

from edged.errors import EdgedError
from edged.ratelog import RateLimitedLog
from edged.thread_to_loop import to_loop
from edged.transports.peer import Peer, close_peer, peer_of
from edged.transports.shm.copies import populate_region
from edged.transports.shm.fd_message import ANCILLARY, MAX_MESSAGE, Received, close_all, descriptors, parse
from edged.transports.shm.regions import Region, SharedMemoryRegistry

log = logging.getLogger(__name__)

# A client connects, registers and goes: an idle connection is closed after this long.
IDLE_S = 10.0
# Connections one user may hold open, so that one user cannot take every slot from the others.
MAX_PER_UID = 16
# Descriptors of one user still waiting for the closer thread before its connections are read
# again (a close can hang on a FUSE file): what one user can leave open in the daemon is bounded
# by this plus one message (16) per connection it may hold.
MAX_PENDING_CLOSES = 64
ACCEPT_RETRY_S = 1.0  # after EMFILE and the like: the listening socket stays readable


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: Peer | None
    idle: asyncio.TimerHandle | None = field(default=None)
    populating: bool = False
    paused: bool = False  # not read: populating, or too many descriptors to close


class FdSocket:
    def __init__(
        self, sock: socket.socket, registry: SharedMemoryRegistry, max_connections: int, owned_path: str | None = None
    ) -> None:
        self.sock = sock
        self.registry = registry
        self.max_connections = max_connections
        self.owned_path = owned_path
        self._conns: dict[int, _Conn] = {}
        self._per_uid: dict[int, int] = {}
        self._closing_uid: dict[int, int] = {}  # descriptors waiting for the closer, per user
        self._waiting: dict[int, set[_Conn]] = {}  # connections not read until their user's are closed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refusals = RateLimitedLog(log)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.sock.setblocking(False)
        loop.add_reader(self.sock.fileno(), self._accept)
        log.info("registering memfd regions on %s", self.owned_path or f"activated socket fd {self.sock.fileno()}")

    def close(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock.fileno())
        for conn in list(self._conns.values()):
            self._drop(conn)
        self.sock.close()
        if self.owned_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.owned_path)

    @property
    def connections(self) -> int:
        return len(self._conns)

    def _accept(self) -> None:
        assert self._loop is not None
        try:
            sock, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as e:  # EMFILE, ENFILE, ENOBUFS: the socket stays readable; do not spin on it
            self._refusals.note(logging.WARNING, "accept", "descriptor socket: accept failed: %s", e)
            self._loop.remove_reader(self.sock.fileno())
            self._loop.call_later(ACCEPT_RETRY_S, self._loop.add_reader, self.sock.fileno(), self._accept)
            return
        try:
            peer = peer_of(sock)
        except OSError:
            sock.close()
            return
        uid = peer.uid if peer is not None else -1
        if len(self._conns) >= self.max_connections or self._per_uid.get(uid, 0) >= MAX_PER_UID:
            self._refusals.note(
                logging.WARNING,
                "limit",
                "descriptor socket: %d connections open (%d of uid %d), the limit is %d (server.max_connections) "
                "and %d per user; refused one",
                len(self._conns),
                self._per_uid.get(uid, 0),
                uid,
                self.max_connections,
                MAX_PER_UID,
            )
            sock.close()
            close_peer(peer)
            return
        sock.setblocking(False)
        conn = _Conn(sock, peer)
        self._conns[sock.fileno()] = conn
        self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        self._loop.add_reader(sock.fileno(), self._readable, conn)
        self._touch(conn)

    def _touch(self, conn: _Conn) -> None:
        if conn.idle is not None:
            conn.idle.cancel()
        assert self._loop is not None
        conn.idle = self._loop.call_later(IDLE_S, self._drop, conn)

    def _live(self, conn: _Conn) -> bool:
        return self._conns.get(conn.sock.fileno()) is conn

    def _drop(self, conn: _Conn) -> None:
        if not self._live(conn):
            return
        del self._conns[conn.sock.fileno()]
        uid = _uid(conn)
        self._waiting.get(uid, set()).discard(conn)
        self._per_uid[uid] -= 1
        if not self._per_uid[uid]:
            del self._per_uid[uid]
        if conn.idle is not None:
            conn.idle.cancel()
        if self._loop is not None and not conn.paused:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(conn.sock.fileno())
        conn.sock.close()
        close_peer(conn.peer)

    def _pause(self, conn: _Conn) -> None:
        assert self._loop is not None
        if not conn.paused:
            conn.paused = True
            self._loop.remove_reader(conn.sock.fileno())
            if conn.idle is not None:  # waiting on the daemon is not idling
                conn.idle.cancel()
                conn.idle = None

    def _resume(self, conn: _Conn) -> None:
        assert self._loop is not None
        if conn.paused and self._live(conn):
            conn.paused = False
            self._loop.add_reader(conn.sock.fileno(), self._readable, conn)
            self._touch(conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            msg, ancillary, flags, _ = conn.sock.recvmsg(MAX_MESSAGE, ANCILLARY, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        received = descriptors(ancillary)
        try:
            if not msg and not received.count:  # the client closed its end
                self._drop(conn)
                return
            answer, region = self._answer(conn.peer, msg, flags, received)
        finally:
            self._close(conn, received)  # registered regions hold a mapping of their own
        if region is None:
            self._send(conn, answer)
            return
        # Answered once its pages are faulted in: the client's first frame then costs no faults.
        # No other message of this connection is read meanwhile, so answers keep their order.
        conn.populating = True
        self._pause(conn)
        populate_region(region, lambda error: self._populated(conn, region, answer, error))

    def _close(self, conn: _Conn, received: Received) -> None:
        if not received.others:
            close_all(received, lambda n: None)
            return
        assert self._loop is not None
        loop = self._loop
        uid = _uid(conn)
        self._closing_uid[uid] = self._closing_uid.get(uid, 0) + len(received.others)

        def done(n: int) -> None:  # on the closer thread
            to_loop(loop, self._closed, uid, n)

        close_all(received, done)
        if self._closing_uid[uid] > MAX_PENDING_CLOSES:
            self._waiting.setdefault(uid, set()).add(conn)
            self._pause(conn)

    def _closed(self, uid: int, n: int) -> None:
        self._closing_uid[uid] -= n
        if self._closing_uid[uid] > MAX_PENDING_CLOSES:
            return
        if not self._closing_uid[uid]:
            del self._closing_uid[uid]
        for conn in self._waiting.pop(uid, ()):
            if not conn.populating:
                self._resume(conn)

    def _populated(self, conn: _Conn, region: Region, answer: bytes, error: BaseException | None) -> None:
        conn.populating = False
        if error is not None:  # the region works without it; its first request pays the faults
            self._refusals.note(
                logging.WARNING, "populate", "descriptor socket: faulting a region in failed: %s", error
            )
        if not self._live(conn):  # gone before its answer: nobody knows the region is there
            self.registry.unregister_for(conn.peer, region.name)
            return
        if conn not in self._waiting.get(_uid(conn), ()):
            self._resume(conn)
        self._send(conn, answer)

    def _send(self, conn: _Conn, answer: bytes) -> None:
        try:
            conn.sock.send(answer)
        except OSError:  # not reading its answers (EAGAIN), or gone: it gets no more
            self._drop(conn)
            return
        if not conn.paused:
            self._touch(conn)

    def _answer(self, peer: Peer | None, msg: bytes, flags: int, received: Received) -> tuple[bytes, Region | None]:
        try:
            name, offset, byte_size, fd, seals = parse(msg, flags, received)
            region = self.registry.register_fd(peer, name, fd, seals, offset, byte_size)
        except EdgedError as e:
            return orjson.dumps(e.to_dict()), None
        except Exception:  # a bug must cost this message, not the daemon
            log.exception("descriptor socket: registering a region failed")
            return orjson.dumps(EdgedError("registering the region failed inside edged; see its log").to_dict()), None
        return orjson.dumps({"registered": name}), region


def _uid(conn: _Conn) -> int:
    return conn.peer.uid if conn.peer is not None else -1
