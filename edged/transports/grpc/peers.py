"""Who is on the other end of a gRPC call, and what its connection may hold.

grpcio exposes no peer credentials, takes no accepted descriptor and takes no memory quota, so
edged accepts every gRPC connection itself, on the public Unix socket and on the ``grpc_tcp``
addresses, and relays its bytes to grpcio's own socket in a private directory (mode 0700). Each
relayed connection is bound to a path of its own there before it connects: grpcio reports that
path as the call's peer (``context.peer()`` = ``unix:<path>``), which names the connection's
client here: on the Unix socket the kernel's record of it (SO_PEERCRED, transports/peer.py), as
on HTTP; on TCP its address, whose calls must then carry the listener's token. A path is unlinked
once connected (the name stays the socket's) and forgotten when the connection closes.

The relay applies back-pressure both ways (a side whose buffer fills pauses reading the other).
It holds each listener to ``server.max_connections`` connections (peers of a TCP port show their
token only with a call, so they cannot be let take the Unix socket's), and each peer (a uid on the
Unix socket, a remote address on TCP) to its share, ``server.max_connections_per_peer``: one peer
cannot take them all. A TCP connection must make its first authorised call within
``server.read_timeout_s`` of connecting, as an HTTP connection must send its first request: peers
without the token cannot hold a listener's connections. It also reads the frames it passes, to hold what
grpcio buffers of request messages under way within ``server.bodies_in_flight`` and
``server.read_timeout_s`` (unfinished.py): a connection past either is closed. grpcio itself
would grant each of a connection's streams the whole message its prefix announces.
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
from dataclasses import dataclass
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
# How long the side left of a connection whose other side closed may take to write what it
# holds before it is dropped: a peer that reads nothing keeps no descriptor.
_CLOSE_GRACE_S = 5.0
# A message's read time-out may stop, while grpcio holds it back, for this many times
# server.read_timeout_s in all (unfinished.py).
_PAUSE_FACTOR = 3


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
            # Dropped here, not through the relay's table: the first read may come before the
            # connection is entered there.
            self.drop()
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
            if self.inbound:  # grpcio's side unread: its window grants unseen too
                self.track.reading_server(False)

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()
            if self.inbound:
                self.track.reading_server(True)

    def drop(self) -> None:
        """Both sides closed at once, what they hold unwritten dropped: a peer past a bound, or
        one that takes no data, would otherwise keep its connection while its buffer waits."""
        for side in (self, self.other):
            if side is not None and side.transport is not None:
                side.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        other = self.other.transport if self.other is not None else None
        if other is not None and not other.is_closing():
            other.close()  # what it holds is written first, within the grace
            asyncio.get_running_loop().call_later(_CLOSE_GRACE_S, other.abort)
        # Shared by both sides: whichever goes first frees what the connection held.
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


@dataclass(frozen=True, slots=True)
class Client:
    """Who a relayed connection serves: its Unix peer (None on TCP), a name for the logs, the
    key of its share of the connections (the uid, or the TCP address's host), and the listener
    it came through (each holds its own ``max_connections``)."""

    peer: Peer | None
    label: str
    share: tuple[str, object]
    listener: int


class Relay:
    """The public gRPC listeners: accepts, records the client, relays to grpcio's socket."""

    def __init__(
        self,
        max_connections: int,
        per_peer: int,
        bodies: BodyBudget,
        read_timeout_s: float,
        closed: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.counted = closed  # a connection closed for passing a bound, by reason (the metric)
        self.bodies = bodies
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.per_peer = min(per_peer, max_connections)
        self.listeners: list[socket.socket] = []
        self._held: Counter[tuple[str, object]] = Counter()  # connections relayed or being set up, per share
        self._pools: Counter[int] = Counter()  # the same, per listener
        self.dir = tempfile.mkdtemp(prefix="edged-grpc-")  # mode 0700: only this user reaches grpcio
        self.inner = os.path.join(self.dir, "s")
        self.clients: dict[str, Client] = {}
        self._names = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._open: set[Any] = set()
        self._pipes: dict[str, _Pipe] = {}  # by path: the client's side of each connection
        # TCP connections that have made no authorised call yet, by path: when each opened.
        self._untried: dict[str, float] = {}

    def listen(self, sock: socket.socket) -> None:
        """Relay the connections of ``sock`` (a listening Unix or TCP socket) once started."""
        self.listeners.append(sock)

    def client(self, name: str) -> Client | None:
        """The client of a call whose ``context.peer()`` is ``name``."""
        return self.clients.get(name[5:]) if name.startswith("unix:") else None

    def label(self, name: str) -> str:
        client = self.client(name)
        return client.label if client is not None else name

    def cut(self, name: str) -> bool:
        """Drop the connection of the call whose ``context.peer()`` is ``name``: grpcio then
        ends every call of it, pending writes included (it has no other way to drop a call whose
        answer a peer does not take). False if ``name`` is no connection of this relay, or one
        being dropped already."""
        pipe = self._pipes.get(name[5:]) if name.startswith("unix:") else None
        if pipe is None or pipe.transport is None or pipe.transport.is_closing():
            return False
        pipe.drop()
        return True

    def called(self, name: str) -> None:
        """The connection of ``name`` made an authorised call (its first, on TCP, lets it stay)."""
        if self._untried:
            self._untried.pop(name[5:], None)

    def cut_stalled(self, name: str) -> bool:
        """``cut`` for a call whose peer took no answer within server.grpc_write_timeout_s."""
        done = self.cut(name)
        if done:
            self.counted("answer_not_taken")
        return done

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._tasks = [loop.create_task(self._accept(loop, sock, i)) for i, sock in enumerate(self.listeners)]
        self._tasks.append(loop.create_task(self._sweep()))

    def stop_listening(self) -> None:
        """No new connections (the calls in flight go on)."""
        for sock in self.listeners:
            sock.close()

    async def _sweep(self) -> None:
        """Close the connections whose oldest unfinished message began read_timeout_s ago, and
        the TCP ones that have made no authorised call read_timeout_s after they opened."""
        every = min(1.0, self.read_timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            try:
                late = time.monotonic() - self.read_timeout_s
                for path, opened in list(self._untried.items()):
                    if opened >= late:
                        break  # the rest opened later still (a dict keeps their order)
                    pipe = self._pipes.get(path)
                    # One whose message is under way is the read time-out's (below) to judge.
                    if pipe is not None and pipe.track.oldest() is None and self.cut("unix:" + path):
                        self._refused(
                            path,
                            f"no authorised call within {self.read_timeout_s:g} s of connecting "
                            "(server.read_timeout_s)",
                            "no_call",
                        )
                for path, pipe in list(self._pipes.items()):
                    began = pipe.track.oldest()
                    if began is not None and began < late and self.cut("unix:" + path):
                        self._refused(
                            path,
                            f"a request message did not arrive whole within {self.read_timeout_s:g} s "
                            "(server.read_timeout_s)",
                            "read_timeout",
                        )
            except Exception as e:  # the sweep outlives any one connection's trouble
                _noisy.note(logging.ERROR, "sweep", "gRPC: sweeping unfinished messages failed: %r", e)

    def _refused(self, path: str, why: str, reason: str) -> None:
        """A connection dropped for passing a bound: counted and logged."""
        client = self.clients.get(path)
        self.counted(reason)
        who = client.label if client is not None else "a client"
        _noisy.note(logging.WARNING, "unfinished", "gRPC: closed the connection of %s: %s", who, why)

    async def _accept(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, listener: int) -> None:
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:  # EMFILE and the like: pause a little rather than spin
                if sock.fileno() < 0:
                    return  # stopped listening
                _noisy.note(logging.WARNING, "accept", "gRPC accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            # Each listener its own pool, as grpcio's own listeners had: peers of a TCP port, who
            # show their token only with a call, cannot take the Unix socket's connections.
            held = self._pools[listener]  # set up or being set up
            if held >= self.max_connections:
                _noisy.note(logging.WARNING, "full", "gRPC: %d connections on one listener, refusing more", held)
                conn.close()
                continue
            loop.create_task(self._relay(loop, conn, listener))

    def _admitted(self, conn: socket.socket, listener: int) -> Client | None:
        """The connection's client, its share taken; None (logged) past its share."""
        if conn.family == socket.AF_UNIX:
            peer = peer_of(conn)
            assert peer is not None
            client = Client(peer, f"uid {peer.uid} (pid {peer.pid})", ("uid", peer.uid), listener)
        else:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # answers are small writes
            host, port = conn.getpeername()[:2]
            client = Client(None, f"tcp {host}:{port}", ("host", host), listener)
        if self._held[client.share] >= self.per_peer:
            _noisy.note(
                logging.WARNING,
                "share",
                "gRPC: %s %s holds %d connections, its share (server.max_connections_per_peer); refusing more",
                *client.share,
                self._held[client.share],
            )
            close_peer(client.peer)
            return None
        self._held[client.share] += 1  # before any await: concurrent accepts see it
        self._pools[listener] += 1
        return client

    async def _relay(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, listener: int) -> None:
        client = None
        a: _Pipe | None = None
        path = os.path.join(self.dir, f"c{next(self._names)}")
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            client = self._admitted(conn, listener)
            if client is None:
                conn.close()
                inner.close()
                return
            inner.setblocking(False)
            inner.bind(path)
            await loop.sock_connect(inner, self.inner)
            os.unlink(path)
            self.clients[path] = client
            if client.peer is None:  # TCP: a token is shown only with a call
                self._untried[path] = time.monotonic()
            track = Unfinished(self.bodies, _PAUSE_FACTOR * self.read_timeout_s)
            a = _Pipe(track, True, lambda why, reason: self._refused(path, why, reason))
            b = _Pipe(track, False, a.refused)
            a.other, b.other = b, a
            b.on_close = a.on_close  # whichever side goes first frees what the connection held
            # Entered before the client's side starts reading: its first read may close it.
            self._pipes[path] = a
            a.on_close.append(lambda: self._closed(path, client, a))
            a.on_close.append(track.release)
            await loop.create_unix_connection(lambda: b, sock=inner)
            await loop.connect_accepted_socket(lambda: a, conn)
        except Exception as e:
            _noisy.note(logging.WARNING, "relay", "gRPC: cannot relay a connection: %s", e)
            if a is not None:
                # Freed here, once: a side already connected must not free it again as it goes.
                a.on_close.clear()
                a.track.release()
                if self._pipes.get(path) is a:
                    del self._pipes[path]
                a.drop()
            self._forget(path, client)
            with contextlib.suppress(OSError):  # a transport may own (and have closed) them already
                inner.close()
                conn.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            return
        assert a.transport is not None and b.transport is not None
        if a.transport.is_closing():  # refused on its first read
            return
        b.flush_to(a.transport)
        a.flush_to(b.transport)
        self._open.add(a.transport)

    def _closed(self, path: str, client: Client | None, pipe: _Pipe) -> None:
        if pipe.transport is not None:
            self._open.discard(pipe.transport)
        if self._pipes.get(path) is pipe:
            del self._pipes[path]
        self._forget(path, client)

    def _forget(self, path: str, client: Client | None) -> None:
        """Once per connection that got past its share: on its close, or when it could not be set up."""
        self._untried.pop(path, None)
        if client is None:
            return
        if self.clients.get(path) is client:
            self.clients.pop(path, None)
        self._held[client.share] -= 1
        if not self._held[client.share]:
            del self._held[client.share]
        self._pools[client.listener] -= 1
        close_peer(client.peer)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.stop_listening()
        for transport in list(self._open):
            transport.close()
        shutil.rmtree(self.dir, ignore_errors=True)
