"""Who is on the other end of a gRPC call on the Unix socket.

grpcio exposes no peer credentials and takes no accepted descriptor, so edged accepts on the
public Unix socket itself, reads the client's SO_PEERCRED (transports/peer.py) and relays the
connection's bytes to grpcio's own socket in a private directory (mode 0700). Each relayed
connection is bound to a path of its own there before it connects: grpcio reports that path as
the call's peer (``context.peer()`` = ``unix:<path>``), which names the client's credentials
here. A path is unlinked once connected (the name stays the socket's) and forgotten when the
connection closes, so a call's identity is the kernel's record of its client, as on HTTP.
The relay applies back-pressure both ways (a side whose buffer fills pauses reading the other).
It holds the connections to ``server.max_connections``, and each user (uid) to its share,
``server.max_connections_per_peer``, as HTTP's Unix socket does: one user cannot take them all.
It also reads the frames it passes, to hold what grpcio buffers of request messages under way
within ``server.bodies_in_flight`` and ``server.read_timeout_s`` (unfinished.py): a connection past
either is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from edged.ratelog import RateLimitedLog
from edged.transports.budget import BodyBudget
from edged.transports.grpc.unfinished import Unfinished
from edged.transports.peer import Peer, close_peer, peer_of

log = logging.getLogger(__name__)
_noisy = RateLimitedLog(log)


# What one side may send before the other is connected: an HTTP/2 preface and its first frames
# are a few KiB; more waits in the kernel's socket buffer.
_EARLY_MAX = 256 << 10


class _Pipe(asyncio.Protocol):
    """One direction's reader; it writes into the other side's transport. ``track``: the
    connection's unfinished messages, fed what this side reads (``inbound``: the client's side)."""

    def __init__(self, track: Unfinished, inbound: bool, refused: Callable[[str, str], None]) -> None:
        self.track, self.inbound, self.refused = track, inbound, refused
        # uvloop's transports are not asyncio.Transport subclasses: typed by what is used.
        self.transport: Any = None
        self.other: _Pipe | None = None
        self.early: list[bytes] = []  # bytes read before the other side was connected
        self.early_bytes = 0
        self.on_close: list[object] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.inbound:
            self.track.server_sent(data)
        elif not self.track.client_sent(data):
            # Closed here, not through the relay's table: the first read may come before the
            # connection is entered there.
            for side in (self, self.other):
                if side is not None and side.transport is not None:
                    side.transport.close()
            self.refused(self.track.over, self.track.reason)
            return
        other = self.other.transport if self.other is not None else None
        if other is None:
            self.early.append(data)
            self.early_bytes += len(data)
            if self.early_bytes >= _EARLY_MAX and self.transport is not None:
                # A client that floods before grpcio's side is connected is held, not buffered.
                self.transport.pause_reading()
        else:
            other.write(data)

    def pause_writing(self) -> None:  # our writes pile up: stop reading what feeds them
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()
        for done in self.on_close:
            done()  # type: ignore[operator]
        self.on_close.clear()

    def flush_to(self, other: Any) -> None:
        for data in self.early:
            other.write(data)
        self.early.clear()
        if self.early_bytes >= _EARLY_MAX and self.transport is not None:
            self.transport.resume_reading()
        self.early_bytes = 0


class UnixRelay:
    """The public gRPC Unix socket: accepts, records the peer, relays to grpcio's socket."""

    def __init__(
        self,
        sock: socket.socket,
        max_connections: int,
        per_peer: int,
        bodies: BodyBudget,
        read_timeout_s: float,
        closed: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.sock = sock
        self.counted = closed  # a connection closed for passing a bound, by reason (the metric)
        self.bodies = bodies
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.per_peer = min(per_peer, max_connections)
        self._by_uid: Counter[int] = Counter()  # connections relayed or being set up, per user
        self.dir = tempfile.mkdtemp(prefix="edged-grpc-")  # mode 0700: only this user reaches grpcio
        self.inner = os.path.join(self.dir, "s")
        self.peers: dict[str, Peer] = {}
        self._names = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._open: set[Any] = set()
        self._pipes: dict[str, _Pipe] = {}  # by path: the client's side of each connection

    def peer(self, name: str) -> Peer | None:
        """The client of a call whose ``context.peer()`` is ``name``."""
        if not name.startswith("unix:"):
            return None
        return self.peers.get(name[5:])

    def cut(self, name: str) -> bool:
        """Close the connection of the call whose ``context.peer()`` is ``name``: grpcio then
        ends every call of it, pending writes included (it has no other way to drop a call whose
        answer a peer does not take). False if ``name`` is no connection of this relay."""
        pipe = self._pipes.get(name[5:]) if name.startswith("unix:") else None
        if pipe is None:
            return False
        for side in (pipe, pipe.other):
            if side is not None and side.transport is not None:
                side.transport.close()
        return True

    def cut_stalled(self, name: str) -> bool:
        """``cut`` for a call whose peer took no answer within server.grpc_write_timeout_s."""
        done = self.cut(name)
        if done:
            self.counted("answer_not_taken")
        return done

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._task = loop.create_task(self._accept(loop))
        self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close the connections whose oldest unfinished message began read_timeout_s ago."""
        every = min(1.0, self.read_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            try:
                late = time.monotonic() - self.read_timeout_s
                for path, pipe in list(self._pipes.items()):
                    began = pipe.track.oldest()
                    if began is not None and began < late:
                        self._refuse(
                            path,
                            f"a request message did not arrive whole within {self.read_timeout_s:g} s "
                            "(server.read_timeout_s)",
                            "read_timeout",
                        )
            except Exception as e:  # the sweep outlives any one connection's trouble
                _noisy.note(logging.ERROR, "sweep", "gRPC socket: sweeping unfinished messages failed: %r", e)

    def _refuse(self, path: str, why: str, reason: str) -> None:
        peer = self.peers.get(path)
        uid = peer.uid if peer is not None else "?"
        self.cut("unix:" + path)
        self.counted(reason)
        _noisy.note(logging.WARNING, "unfinished", "gRPC socket: closed a connection of uid %s: %s", uid, why)

    async def _accept(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                client, _ = await loop.sock_accept(self.sock)
            except OSError as e:  # EMFILE and the like: pause a little rather than spin
                _noisy.note(logging.WARNING, "accept", "gRPC socket accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            held = self._by_uid.total()  # set up or being set up
            if held >= self.max_connections:
                _noisy.note(logging.WARNING, "full", "gRPC socket: %d connections, refusing more", held)
                client.close()
                continue
            loop.create_task(self._relay(loop, client))

    async def _relay(self, loop: asyncio.AbstractEventLoop, client: socket.socket) -> None:
        peer = None
        a: _Pipe | None = None
        path = os.path.join(self.dir, f"c{next(self._names)}")
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            peer = peer_of(client)
            assert peer is not None
            if self._by_uid[peer.uid] >= self.per_peer:
                _noisy.note(
                    logging.WARNING,
                    "share",
                    "gRPC socket: uid %d holds %d connections, its share (server.max_connections_per_peer); "
                    "refusing more",
                    peer.uid,
                    self._by_uid[peer.uid],
                )
                close_peer(peer)
                client.close()
                inner.close()
                return
            self._by_uid[peer.uid] += 1  # before any await: concurrent accepts see it
            inner.setblocking(False)
            inner.bind(path)
            await loop.sock_connect(inner, self.inner)
            os.unlink(path)
            self.peers[path] = peer
            track = Unfinished(self.bodies)
            a = _Pipe(track, True, lambda why, reason: self._refuse(path, why, reason))
            b = _Pipe(track, False, a.refused)
            a.other, b.other = b, a
            # Entered before the client's side starts reading: its first read may close it.
            self._pipes[path] = a
            a.on_close.append(lambda: self._closed(path, peer, a))
            a.on_close.append(track.release)
            await loop.create_unix_connection(lambda: b, sock=inner)
            await loop.connect_accepted_socket(lambda: a, client)
        except Exception as e:
            _noisy.note(logging.WARNING, "relay", "gRPC socket: cannot relay a connection: %s", e)
            if a is not None and self._pipes.get(path) is a:
                del self._pipes[path]
                a.track.release()
            self._forget(path, peer)
            inner.close()
            client.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            return
        assert a.transport is not None and b.transport is not None
        if a.transport.is_closing():  # refused on its first read
            return
        b.flush_to(a.transport)
        a.flush_to(b.transport)
        self._open.add(a.transport)

    def _closed(self, path: str, peer: Peer | None, pipe: _Pipe) -> None:
        if pipe.transport is not None:
            self._open.discard(pipe.transport)
        if self._pipes.get(path) is pipe:
            del self._pipes[path]
        self._forget(path, peer)

    def _forget(self, path: str, peer: Peer | None) -> None:
        """Once per connection that got past its share: on its close, or when it could not be set up."""
        if self.peers.get(path) is peer:
            self.peers.pop(path, None)
        if peer is not None:
            self._by_uid[peer.uid] -= 1
            if not self._by_uid[peer.uid]:
                del self._by_uid[peer.uid]
        close_peer(peer)

    def close(self) -> None:
        for task in (self._task, self._sweeper):
            if task is not None:
                task.cancel()
        self.sock.close()
        for transport in list(self._open):
            transport.close()
        shutil.rmtree(self.dir, ignore_errors=True)
