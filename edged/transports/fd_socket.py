"""The descriptor socket: clients hand sealed memfds to the daemon (SCM_RIGHTS), one per message.

HTTP cannot carry a file descriptor, and the event loop's stream transports read with recv(),
which drops any that arrive. So registering a region by descriptor has a socket of its own, next
to the API's (``<socket>.fd``, same mode and group; or a SOCK_SEQPACKET socket passed by socket
activation). SOCK_SEQPACKET keeps each message and its descriptor together:

    request: {"name": "cam0", "byte_size": 4915200, "offset": 0}  + exactly one descriptor
    answer:  {"registered": "cam0"}  or  {"error": "...", "code": "shm_invalid"}

The region then belongs to the sending process (SO_PEERCRED) exactly like one registered over
HTTP: the same process names it in requests, unregisters it over HTTP, and loses it when it
exits. Every client is untrusted: a message is at most 4 KiB, every descriptor received is
closed (a message with several is refused whole), the connections are capped and idle ones
closed, and a client that does not read its answers is disconnected rather than waited on.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field

import orjson

from edged.errors import BadRequestError, EdgedError
from edged.ratelog import RateLimitedLog
from edged.transports.peer import Peer, close_peer, peer_of
from edged.transports.shm import Region, SharedMemoryRegistry
from edged.transports.shm_io import populate_region

log = logging.getLogger(__name__)

MAX_MESSAGE = 4096
# Room for more descriptors than allowed, so that extra ones arrive (and are closed) instead of
# being cut off silently: the answer can then say what was wrong.
_FD_ROOM = 16
_ANCILLARY = socket.CMSG_SPACE(_FD_ROOM * array.array("i").itemsize)
SUFFIX = ".fd"


def path_for(api_socket: str) -> str:
    """Where the descriptor socket lives when the daemon binds it itself (and where clients look)."""
    return api_socket + SUFFIX


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: Peer | None
    idle: asyncio.TimerHandle | None = field(default=None)


class FdSocket:
    def __init__(
        self,
        sock: socket.socket,
        registry: SharedMemoryRegistry,
        max_connections: int,
        idle_s: float,
        owned_path: str | None = None,
    ) -> None:
        self.sock = sock
        self.registry = registry
        self.max_connections = max_connections
        self.idle_s = idle_s
        self.owned_path = owned_path
        self._conns: dict[int, _Conn] = {}
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
        try:
            sock, _ = self.sock.accept()
        except OSError:  # EAGAIN (another wake-up took it), EMFILE, ECONNABORTED
            return
        if len(self._conns) >= self.max_connections:
            self._refusals.note(
                logging.WARNING,
                "limit",
                "descriptor socket: %d connections open, the limit (server.max_connections); refused one",
                len(self._conns),
            )
            sock.close()
            return
        sock.setblocking(False)
        try:
            peer = peer_of(sock)
        except OSError:
            sock.close()
            return
        conn = _Conn(sock, peer)
        self._conns[sock.fileno()] = conn
        assert self._loop is not None
        self._loop.add_reader(sock.fileno(), self._readable, conn)
        self._touch(conn)

    def _touch(self, conn: _Conn) -> None:
        if conn.idle is not None:
            conn.idle.cancel()
        assert self._loop is not None
        conn.idle = self._loop.call_later(self.idle_s, self._drop, conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock.fileno(), None) is None:
            return
        if conn.idle is not None:
            conn.idle.cancel()
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(conn.sock.fileno())
        conn.sock.close()
        close_peer(conn.peer)

    def _readable(self, conn: _Conn) -> None:
        try:
            msg, ancillary, flags, _ = conn.sock.recvmsg(MAX_MESSAGE, _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        fds = _descriptors(ancillary)
        try:
            if not msg and not fds:  # the client closed its end
                self._drop(conn)
                return
            answer, region = self._answer(conn.peer, msg, flags, fds)
        finally:
            for fd in fds:  # registered regions hold a mapping of their own
                with contextlib.suppress(OSError):
                    os.close(fd)
        if region is None:
            self._send(conn, answer)
            return
        # Answered once its pages are faulted in: the client's first frame then costs no faults.
        # No other message of this connection is read meanwhile, so answers keep their order.
        assert self._loop is not None
        self._loop.remove_reader(conn.sock.fileno())
        populate_region(region, lambda error: self._populated(conn, answer, error))

    def _populated(self, conn: _Conn, answer: bytes, error: BaseException | None) -> None:
        if error is not None:  # the region works without it; its first request pays the faults
            self._refusals.note(
                logging.WARNING, "populate", "descriptor socket: faulting a region in failed: %s", error
            )
        if self._conns.get(conn.sock.fileno()) is not conn:
            return  # dropped meanwhile (idle timeout, daemon stop)
        assert self._loop is not None
        self._loop.add_reader(conn.sock.fileno(), self._readable, conn)
        self._send(conn, answer)

    def _send(self, conn: _Conn, answer: bytes) -> None:
        try:
            conn.sock.send(answer)
        except OSError:  # not reading its answers (EAGAIN), or gone: it gets no more
            self._drop(conn)
            return
        self._touch(conn)

    def _answer(self, peer: Peer | None, msg: bytes, flags: int, fds: list[int]) -> tuple[bytes, Region | None]:
        try:
            name, offset, byte_size = _parse(msg, flags, fds)
            region = self.registry.register_fd(peer, name, fds[0], offset, byte_size)
        except EdgedError as e:
            return orjson.dumps(e.to_dict()), None
        except Exception:  # a bug must cost this message, not the daemon
            log.exception("descriptor socket: registering a region failed")
            return orjson.dumps(EdgedError("registering the region failed inside edged; see its log").to_dict()), None
        return orjson.dumps({"registered": name}), region


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


def _parse(msg: bytes, flags: int, fds: list[int]) -> tuple[str, int, int]:
    if flags & socket.MSG_TRUNC:
        raise BadRequestError(f"a registration message is at most {MAX_MESSAGE} bytes")
    if flags & socket.MSG_CTRUNC or len(fds) != 1:
        raise BadRequestError(
            f"a registration message carries exactly one descriptor (SCM_RIGHTS), this one carried "
            f"{'more than ' + str(len(fds)) if flags & socket.MSG_CTRUNC else len(fds)}"
        )
    try:
        doc = orjson.loads(msg)
    except orjson.JSONDecodeError as e:
        raise BadRequestError(f"a registration message is a JSON object: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequestError("a registration message is a JSON object with 'name' and 'byte_size'")
    name, size, offset = doc.get("name"), doc.get("byte_size"), doc.get("offset", 0)
    if not isinstance(name, str):
        raise BadRequestError("'name' must be a string")
    if not isinstance(size, int) or not isinstance(offset, int) or isinstance(size, bool) or isinstance(offset, bool):
        raise BadRequestError("'byte_size' and 'offset' must be integers")
    unknown = set(doc) - {"name", "byte_size", "offset"}
    if unknown:
        raise BadRequestError(f"unknown keys in a registration message: {sorted(unknown)}")
    return name, offset, size
