"""What a relayed gRPC connection makes grpcio hold: the bytes of request messages begun and not
yet whole.

grpcio grants a stream the flow-control window its message's length prefix announces and buffers
the message whole before any handler sees it, and its Python server takes no memory quota. So the
Unix relay reads the HTTP/2 frames it passes (RFC 9113 §4: a 9-byte header each; a DATA frame's
payload, less its padding, carries gRPC's length-prefixed messages) and counts, stream by stream,
the bytes of the message under way. Those bytes are taken from ``server.bodies_in_flight``, the
budget HTTP's request bodies draw on, and a message must arrive whole within
``server.read_timeout_s`` of its first byte, as an HTTP request must. The relay closes a
connection past either; grpcio then drops all it held for it.

Only what the client sends is counted; what grpcio answers is read for the frames that end a
stream (RST_STREAM, trailers), after which grpcio holds nothing of it, and for the flow-control
windows it grants (SETTINGS_INITIAL_WINDOW_SIZE, WINDOW_UPDATE; RFC 9113 §6.9). A message's time
stops while its client may send nothing more of it, its stream's or the connection's window
spent, for at most ``max_paused_s`` in all; it runs whenever the relay is not reading what grpcio
sends (a client that takes no answers holds back the windows grpcio grants too). grpcio lets a
large stream message in only as the stream's handler reads, so one behind a busy handler waits
on grpcio, not on its client (measured: of a 64 MiB message sent while the handler was busy, a
bare grpcio server took 18 MiB at once and the rest once it read; edged's, about 4.5 MiB).
"""

from __future__ import annotations

import struct
import time

from edged.errors import BodyBudgetError
from edged.transports.budget import BodyBudget

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what a client sends before its first frame
DATA, HEADERS, RST_STREAM, SETTINGS, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x8
INITIAL_WINDOW_SIZE = 0x4  # the SETTINGS parameter
DEFAULT_WINDOW = 65_535  # a window's size until SETTINGS or WINDOW_UPDATE say otherwise
END_STREAM, PADDED = 0x1, 0x8
PREFIX = 5  # gRPC's message prefix: a compressed flag and a 4-byte length
# A frame header: a 24-bit length (as 8 + 16 bits), its type, flags and stream id.
_HEADER = struct.Struct(">BHBBI")
_LENGTH = struct.Struct(">I")  # a message prefix's length, after its flag byte
_SETTING = struct.Struct(">HI")  # a SETTINGS parameter: its id and value
# Frames and messages one read may carry: each costs the loop a step of Python (a few hundred
# ns), and a flood of empty frames or 5-byte messages would otherwise be 30,000-50,000 steps per
# read, 15-40 ms. The walk stops at the step past this, and the connection is closed. A read of
# whole 16 KiB DATA frames takes 16 frames; 2,048 small pipelined requests take about 4,096 (a
# HEADERS and a DATA frame each).
STEPS_PER_READ = 8192


class _Message:
    """The message under way on one stream."""

    __slots__ = ("blocked_at", "first", "held", "left", "need", "prefix", "since")

    def __init__(self) -> None:
        self.need = PREFIX  # prefix bytes still to come (0: the body is coming)
        self.prefix = b""
        self.left = 0  # body bytes still to come
        self.held = 0  # bytes of it received
        self.first = 0.0  # when its first byte came
        self.since = 0.0  # the same, moved on by the time its client was blocked
        self.blocked_at = 0.0  # since when its client may send nothing (0: it may)


class Frames:
    """Walks one direction's HTTP/2 frames as they pass, in any split; ``on_frame`` hears each
    frame's header, ``on_data`` each piece of a DATA frame's payload that is not padding."""

    __slots__ = ("data_left", "flags", "head", "kind", "left", "padded", "payload", "sid", "skip")

    def __init__(self, preface: bool) -> None:
        self.payload: bytearray | None = None  # a window-setting frame's payload, as it comes
        self.skip = len(PREFACE) if preface else 0
        self.head = b""  # a frame header split across reads
        self.left = 0  # payload bytes of the current frame still to come
        self.data_left = 0  # of those, DATA bytes (not its pad length nor its padding)
        self.padded = False  # a padded DATA frame whose pad length byte is still to come
        self.kind = self.flags = self.sid = 0

    def feed(self, data: bytes, conn: Unfinished, inbound: bool) -> None:
        i, n = 0, len(data)
        if self.skip:
            i = min(self.skip, n)
            self.skip -= i
        while i < n:
            if inbound and conn.stepped > STEPS_PER_READ:
                return  # refused (client_sent): the rest of the read is not worth walking
            if not self.left and not self.padded and not self.head and n - i >= 9:
                # A frame that begins here: read whole in one step where its payload is here too
                # (a unary call's frames come in one read each way), else begun as in _step.
                hi, lo, kind, flags, sid = _HEADER.unpack_from(data, i)
                length, sid = hi << 16 | lo, sid & 0x7FFFFFFF
                end = i + 9 + length
                if end > n:
                    i = self._begin(data, i + 9, (length, kind, flags, sid), conn, inbound)
                    continue
                if inbound:
                    conn.stepped += 1
                if kind == DATA:
                    if inbound:
                        conn.consumed(sid, length)  # padding counts against the windows too
                        start, stop = i + 9, end
                        if flags & PADDED and length:  # the pad length, then the data, then the padding
                            start, stop = i + 10, max(end - data[i + 9], i + 10)
                        if stop > start:
                            conn.data(sid, data, start, stop)
                        if flags & END_STREAM:
                            conn.end(sid)  # the client's last message: whole, or never to be
                        else:
                            conn.check_blocked(sid)
                elif not inbound and (kind == WINDOW_UPDATE or (kind == SETTINGS and not flags & 0x1)):
                    conn.granted(kind, sid, data[i + 9 : end])
                elif kind == RST_STREAM or (kind == HEADERS and flags & END_STREAM and not inbound):
                    conn.end(sid)
                elif kind == HEADERS and inbound and not flags & END_STREAM:
                    conn.opened(sid)
                i = end
                continue
            i = self._step(data, i, n, conn, inbound)

    def _step(self, data: bytes, i: int, n: int, conn: Unfinished, inbound: bool) -> int:
        """One step of a frame split across reads: its header, its pad length, or a piece of its
        payload. Returns where the next step begins."""
        if not self.left and not self.padded:  # a header split across reads
            need = 9 - len(self.head)
            self.head += data[i : i + need]
            i += need
            if len(self.head) < 9:
                return i
            hi, lo, kind, flags, sid = _HEADER.unpack(self.head)
            self.head = b""
            return self._begin(data, i, (hi << 16 | lo, kind, flags, sid & 0x7FFFFFFF), conn, inbound)
        if self.padded:  # the pad length: the payload's last bytes are padding
            self.padded = False
            self.left -= 1
            self.data_left = max(self.left - data[i], 0)
            i += 1
            if not self.left:
                self._frame_done(conn, inbound)
            return i
        take = min(self.left, n - i)
        if self.payload is not None:
            self.payload += data[i : i + take]
        if self.data_left and inbound:
            d = min(self.data_left, take)
            conn.data(self.sid, data, i, i + d)
            self.data_left -= d
        i += take
        self.left -= take
        if not self.left:
            self._frame_done(conn, inbound)
        return i

    def _begin(self, data: bytes, i: int, frame: tuple[int, int, int, int], conn: Unfinished, inbound: bool) -> int:
        """A frame whose header has been read (its length, type, flags and stream) and whose
        payload begins at ``i``, taken a piece at a time by _step."""
        self.left, self.kind, self.flags, self.sid = frame
        kind, flags = self.kind, self.flags
        if inbound:
            conn.stepped += 1
        if kind == DATA:
            self.padded = bool(flags & PADDED) and self.left > 0
            self.data_left = 0 if self.padded else self.left
            if inbound:
                conn.consumed(self.sid, self.left)  # padding counts against the windows too
        elif not inbound and (kind == WINDOW_UPDATE or (kind == SETTINGS and not flags & 0x1)):
            self.payload = bytearray()  # grpcio's own frames: a few bytes each
        elif kind == RST_STREAM or (kind == HEADERS and flags & END_STREAM and not inbound):
            conn.end(self.sid)  # reset by either side, or answered with its trailers
        elif kind == HEADERS and inbound and not flags & END_STREAM:
            conn.opened(self.sid)
        if not self.left:
            self._frame_done(conn, inbound)
        return i

    def _frame_done(self, conn: Unfinished, inbound: bool) -> None:
        if self.payload is not None:
            payload, self.payload = bytes(self.payload), None
            conn.granted(self.kind, self.sid, payload)
        elif inbound and self.kind == DATA:
            if self.flags & END_STREAM:
                conn.end(self.sid)  # the client's last message: whole, or never to be
            else:
                conn.check_blocked(self.sid)


class Unfinished:
    """One relayed connection's unfinished request messages, held within the shared budget."""

    __slots__ = (
        "blocked",
        "budget",
        "held",
        "inbound",
        "initial",
        "max_paused",
        "open",
        "outbound",
        "over",
        "reason",
        "server_read",
        "stepped",
        "streams",
        "window",
        "windows",
    )

    def __init__(self, budget: BodyBudget, max_paused_s: float = float("inf")) -> None:
        self.budget = budget
        self.max_paused = max_paused_s  # how long a message's clock may stop, in all
        self.inbound = Frames(preface=True)
        self.outbound = Frames(preface=False)
        self.streams: dict[int, _Message] = {}
        # Streams the client opened and neither side has ended: DATA on any other stream is
        # dropped by grpcio (RFC 9113 5.1), so it is not counted either.
        self.open: set[int] = set()
        # What the client may still send, as grpcio grants it: on the connection, on each open
        # stream, and what a new stream starts with.
        self.window = self.initial = DEFAULT_WINDOW
        self.windows: dict[int, int] = {}
        self.blocked = False  # the connection's window is spent
        self.server_read = True  # the relay reads what grpcio sends (its window grants among it)
        self.stepped = 0  # frames and messages read in the current read
        self.held = 0  # taken from the budget
        self.over = ""  # why the connection must close ("" while it may stay)
        self.reason = ""  # which bound, for the metric: "bodies_in_flight" or "frames_per_read"

    def client_sent(self, data: bytes) -> bool:
        """Read what the client sent; False once the connection holds more than it may."""
        if self.over:
            return False
        self.stepped = 0
        self.inbound.feed(data, self, inbound=True)
        if self.stepped > STEPS_PER_READ and not self.over:
            self.over = f"more than {STEPS_PER_READ} frames and request messages in one read"
            self.reason = "frames_per_read"
        return not self.over

    def opened(self, sid: int) -> None:
        self.open.add(sid)
        self.windows[sid] = self.initial

    # --- flow control: a message's time stops while its client may send nothing ---

    def consumed(self, sid: int, n: int) -> None:
        """A DATA frame of ``n`` bytes (padding included) from the client on ``sid``."""
        self.window -= n
        if sid in self.windows:
            self.windows[sid] -= n

    def granted(self, kind: int, sid: int, payload: bytes) -> None:
        """grpcio's SETTINGS or WINDOW_UPDATE frame: the windows it opens."""
        if kind == SETTINGS:
            for j in range(0, len(payload) - 5, 6):
                key, value = _SETTING.unpack_from(payload, j)
                if key == INITIAL_WINDOW_SIZE:  # applies to every open stream (RFC 9113 §6.9.2)
                    delta, self.initial = value - self.initial, value
                    for open_sid in self.windows:
                        self.windows[open_sid] += delta
            self._block_all()
        elif len(payload) >= 4:
            increment = _LENGTH.unpack_from(payload)[0] & 0x7FFFFFFF
            if sid == 0:  # grpcio's own frame, a few per window's worth of data: every message re-checked
                self.window += increment
                self.blocked = self.window == 0
                self._block_all()
            elif sid in self.windows:
                self.windows[sid] += increment
                one = self.streams.get(sid)
                if one is not None:
                    self._block(sid, one, time.monotonic())

    def reading_server(self, reading: bool) -> None:
        """Whether the relay reads what grpcio sends: while it does not, no window it grants is
        seen, so no message's clock stops."""
        self.server_read = reading
        self._block_all()

    def _block_all(self) -> None:
        if self.streams:
            now = time.monotonic()
            for sid, msg in self.streams.items():
                self._block(sid, msg, now)

    def check_blocked(self, sid: int) -> None:
        """After a DATA frame: whether its stream's message may go on (every stream's, when the
        connection's window has just been spent: each frame costs one stream's check at most,
        whatever the number of streams)."""
        if self._connection_changed():
            return
        one = self.streams.get(sid)
        if one is not None:
            self._block(sid, one, time.monotonic())

    def _connection_changed(self) -> bool:
        """Every stream's message re-checked where the connection's window has just been spent
        or opened again (and only then: whatever the frames, a stream's check each at most)."""
        if (self.window == 0) == self.blocked:
            return False
        self.blocked = not self.blocked
        self._block_all()
        return True

    def _block(self, sid: int, msg: _Message, now: float) -> None:
        # Spent exactly: a client that sends past a window is not waiting on grpcio (which ends
        # such a connection), so its time runs on.
        blocked = self.server_read and (self.window == 0 or self.windows.get(sid, 1) == 0)
        if blocked and not msg.blocked_at and msg.held:
            msg.blocked_at = now
        elif not blocked and msg.blocked_at:
            msg.since = min(msg.since + now - msg.blocked_at, msg.first + self.max_paused)
            msg.blocked_at = 0.0

    def server_sent(self, data: bytes) -> None:
        self.outbound.feed(data, self, inbound=False)

    def data(self, sid: int, buf: bytes, j: int, m: int) -> None:
        """``buf[j:m]``: a piece of a DATA frame's payload on stream ``sid`` (not copied: only a
        message's 5-byte prefix is read)."""
        if sid not in self.open or self.over:
            return
        msg = self.streams.get(sid)
        if msg is None:
            # The common case: whole messages, each in one piece, and nothing to hold.
            while m - j >= PREFIX:
                size = PREFIX + _LENGTH.unpack_from(buf, j + 1)[0]
                if j + size > m:
                    break
                j += size
                self.stepped += 1
                if self.stepped > STEPS_PER_READ:
                    return  # refused: nothing of the rest is held
            if j == m:
                return
            msg = self.streams[sid] = _Message()
        added = 0
        while j < m:
            if not msg.held:
                msg.since = msg.first = time.monotonic()
            if msg.need:
                k = min(msg.need, m - j)
                msg.prefix += buf[j : j + k]
                msg.need -= k
                if not msg.need:
                    msg.left = _LENGTH.unpack_from(msg.prefix, 1)[0]
                    msg.prefix = b""
            else:
                k = min(msg.left, m - j)
                msg.left -= k
            j += k
            msg.held += k
            added += k
            if not msg.need and not msg.left:  # whole: grpcio hands it on
                added -= msg.held
                msg.held, msg.need = 0, PREFIX
                self.stepped += 1
                if self.stepped > STEPS_PER_READ:
                    break  # refused: what it took so far is counted, and freed as it closes
        if not self._count(added):
            msg.held -= added  # not taken: the connection closes, holding only what it took

    def end(self, sid: int) -> None:
        self.open.discard(sid)
        self.windows.pop(sid, None)
        msg = self.streams.pop(sid, None)
        if msg is not None and msg.held:
            self._count(-msg.held)

    def _count(self, added: int) -> bool:
        """Take (or give back) ``added`` bytes; False when the budget has no room for them."""
        if added > 0:
            try:
                self.budget.take(added)
            except BodyBudgetError as e:
                self.over, self.reason = e.message, "bodies_in_flight"
                return False
        elif added < 0:
            self.budget.give(-added)
        self.held += added
        return True

    def oldest(self) -> float | None:
        """When the oldest unfinished message began, less the time its client could send nothing
        more of it (at most ``max_paused_s``; None: there is none)."""
        now = time.monotonic()
        times = [
            min(m.since + now - m.blocked_at, m.first + self.max_paused) if m.blocked_at else m.since
            for m in self.streams.values()
            if m.held
        ]
        return min(times) if times else None

    def release(self) -> None:
        """The connection closed: grpcio dropped what it held."""
        if self.held:
            self.budget.give(self.held)
        self.held = 0
        self.streams.clear()
        self.open.clear()
        self.windows.clear()
