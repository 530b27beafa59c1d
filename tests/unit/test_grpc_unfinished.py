"""The gRPC relay's count of request messages under way (edged/transports/grpc/unfinished.py),
fed real HTTP/2 frames (hyperframe, h2's framing library) in every split a socket may deliver."""

from __future__ import annotations

import itertools
import random
import time

import pytest
from hyperframe.frame import DataFrame, HeadersFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame

from edged.transports.budget import BodyBudget
from edged.transports.grpc import unfinished
from edged.transports.grpc.unfinished import PREFACE, Unfinished


def message(n: int, announced: int | None = None) -> bytes:
    """A gRPC message of ``n`` body bytes whose prefix announces ``announced`` (default n)."""
    return b"\0" + (n if announced is None else announced).to_bytes(4, "big") + b"m" * n


def data(sid: int, payload: bytes, end: bool = False, pad: int = 0) -> bytes:
    f = DataFrame(sid, payload)
    if end:
        f.flags.add("END_STREAM")
    if pad:
        f.flags.add("PADDED")
        f.pad_length = pad
    return bytes(f.serialize())


def headers(sid: int, end: bool = False) -> bytes:
    f = HeadersFrame(sid, b"\x82\x86\x84")  # a header block: HPACK is not read
    f.flags.add("END_HEADERS")
    if end:
        f.flags.add("END_STREAM")
    return bytes(f.serialize())


def opening() -> bytes:
    return PREFACE + bytes(SettingsFrame(0).serialize())


def feed_split(track: Unfinished, stream: bytes, size: int) -> bool:
    return all(track.client_sent(stream[i : i + size]) for i in range(0, len(stream), size))


@pytest.mark.parametrize("size", [1, 2, 7, 9, 10, 64, 1 << 20])
def test_whole_messages_hold_nothing_in_any_split(size: int) -> None:
    budget = BodyBudget(1 << 20)
    track = Unfinished(budget)
    stream = opening() + headers(1) + data(1, message(3000) + message(0) + message(10), end=True)
    stream += headers(3) + data(3, message(100)[:40]) + data(3, message(100)[40:], pad=17)
    assert feed_split(track, stream, size)
    assert track.held == 0 and budget.used == 0 and track.oldest() is None


def test_a_message_under_way_is_held_until_it_ends_however_it_ends() -> None:
    budget = BodyBudget(1 << 20)
    track = Unfinished(budget)
    part = message(100_000, announced=500_000)
    assert track.client_sent(opening() + headers(1) + data(1, part[:16384]) + data(1, part[16384:50000], pad=200))
    assert track.held == budget.used == 50_000 and track.oldest() is not None
    assert track.client_sent(headers(3) + data(3, message(10, announced=99)))
    assert track.held == 50_015
    track.client_sent(bytes(RstStreamFrame(1).serialize()))  # the client gave it up
    assert track.held == budget.used == 15
    track.server_sent(headers(3, end=True))  # grpcio answered the stream with its trailers
    assert track.held == budget.used == 0


def test_a_connection_past_the_budget_is_told_to_close() -> None:
    budget = BodyBudget(100_000)
    budget.take(60_000)  # what HTTP's bodies hold meanwhile
    track = Unfinished(budget)
    assert track.client_sent(opening() + headers(1) + data(1, message(30_000, announced=1 << 20)))
    assert not track.client_sent(data(1, b"m" * 16_000))
    assert "server.bodies_in_flight" in track.over
    track.release()  # the relay closed it
    assert budget.used == 60_000


def test_the_oldest_unfinished_message_dates_from_its_first_byte() -> None:
    track = Unfinished(BodyBudget(1 << 20))
    before = time.monotonic()
    track.client_sent(opening() + headers(1) + data(1, message(10, announced=20)))
    began = track.oldest()
    assert began is not None and before <= began <= time.monotonic()
    track.client_sent(data(1, b"m" * 10, end=True))
    assert track.oldest() is None


def test_data_on_a_stream_already_ended_is_not_counted() -> None:
    budget = BodyBudget(1 << 20)
    track = Unfinished(budget)
    track.client_sent(opening() + headers(1) + data(1, message(100, announced=70_000)))
    track.server_sent(bytes(RstStreamFrame(1).serialize()))  # grpcio ended the call
    assert track.client_sent(data(1, b"mmmm" * 8192))  # the client's bytes still in flight
    assert track.held == budget.used == 0 and track.oldest() is None


def test_a_refused_read_takes_nothing_and_gives_back_only_what_was_taken() -> None:
    budget = BodyBudget(100_000)
    budget.take(95_000)
    track = Unfinished(budget)
    ok = track.client_sent(
        opening() + headers(1) + data(1, message(16_000, announced=50_000)) + bytes(RstStreamFrame(1).serialize())
    )
    assert not ok and budget.used == 95_000
    track.release()
    assert budget.used == 95_000


def test_a_flood_of_empty_messages_or_frames_in_one_read_is_refused() -> None:
    track = Unfinished(BodyBudget(1 << 30))
    flood = message(0) * 9000
    assert not track.client_sent(opening() + headers(1) + data(1, flood[:16384]) + data(1, flood[16384:]))
    assert "frames and request messages in one read" in track.over and track.reason == "frames_per_read"
    frames = Unfinished(BodyBudget(1 << 30))
    assert not frames.client_sent(opening() + headers(1) + data(1, b"") * 9000)
    assert frames.reason == "frames_per_read"
    ok = Unfinished(BodyBudget(1 << 30))
    assert ok.client_sent(opening() + headers(1) + data(1, message(0) * 3000, end=True))
    assert ok.client_sent(headers(3) + data(3, b"") * 3000 + data(3, message(10), end=True))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def window_update(sid: int, increment: int) -> bytes:
    return bytes(WindowUpdateFrame(sid, increment).serialize())


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The clock unfinished.py reads, at 1000.0 until a test moves it."""
    fake = Clock()
    monkeypatch.setattr(unfinished.time, "monotonic", fake)
    return fake


def granting(initial: int, max_paused_s: float = float("inf")) -> Unfinished:
    """A connection's count, grpcio having set each stream's window to ``initial``."""
    track = Unfinished(BodyBudget(1 << 30), max_paused_s)
    track.server_sent(bytes(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: initial}).serialize()))
    return track


def test_a_message_waiting_on_grpcios_window_is_not_timed(clock: Clock) -> None:
    """grpcio lets a large stream message in only as its handler reads: while the client may send
    nothing more (its stream's window spent), the message's time stops, and goes on once grpcio
    opens the window again."""
    track = granting(1000)
    assert track.client_sent(opening() + headers(1) + data(1, message(995, announced=5000)))
    clock.now += 60
    assert track.oldest() == 1060.0  # the stream's window is spent: the client waits on grpcio
    track.server_sent(window_update(1, 2000))
    clock.now += 1
    assert track.oldest() == 1060.0  # its time goes on from where it stopped
    assert track.client_sent(data(1, b"m" * 500))
    clock.now += 5
    assert track.oldest() == 1060.0


def test_a_spent_connection_window_stops_every_message(clock: Clock) -> None:
    track = granting(1 << 20)
    one = message(40_000, announced=1 << 20)
    two = message(65_535 - len(one) - 5, announced=1 << 20)
    assert track.client_sent(opening() + headers(1) + data(1, one) + headers(3) + data(3, two))
    assert track.window == 0
    clock.now += 100
    assert track.oldest() == 1100.0  # both stopped
    track.server_sent(window_update(0, 1 << 20))
    clock.now += 1
    assert track.oldest() == 1100.0


def test_a_client_past_its_window_is_timed_as_ever(clock: Clock) -> None:
    track = granting(100)
    assert track.client_sent(opening() + headers(1) + data(1, message(200, announced=5000)))
    assert track.oldest() == 1000.0


def test_a_clock_stops_for_at_most_max_paused(clock: Clock) -> None:
    track = granting(1000, max_paused_s=90)
    assert track.client_sent(opening() + headers(1) + data(1, message(995, announced=5000)))
    clock.now += 60
    assert track.oldest() == 1060.0
    clock.now += 1000
    assert track.oldest() == 1090.0  # stopped for 90 s of the 1060, no more
    track.server_sent(window_update(1, 2000))
    assert track.oldest() == 1090.0


def test_a_clock_runs_while_the_relay_reads_nothing_from_grpcio(clock: Clock) -> None:
    """A client that takes no answers makes the relay stop reading grpcio's side, window grants
    included: a window seen spent then proves nothing, and the message is timed."""
    track = granting(1000)
    assert track.client_sent(opening() + headers(1) + data(1, message(995, announced=5000)))
    clock.now += 10
    assert track.oldest() == 1010.0
    track.reading_server(False)
    clock.now += 50
    assert track.oldest() == 1010.0  # its time runs again from here
    track.reading_server(True)
    clock.now += 5
    assert track.oldest() == 1015.0


def test_empty_frames_at_a_spent_window_cost_one_streams_check_each(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = Unfinished._block

    def counted(self: Unfinished, sid: int, msg: object, now: float) -> None:
        nonlocal calls
        calls += 1
        real(self, sid, msg, now)  # type: ignore[arg-type]

    monkeypatch.setattr(Unfinished, "_block", counted)
    track = granting(1 << 20)
    stream = opening()
    sids = range(1, 2 * 200, 2)
    for sid in sids:
        stream += headers(sid) + data(sid, message(100, announced=1 << 20))
    stream += data(1, b"m" * (65_535 - 105 * len(sids)))
    assert track.client_sent(stream) and track.window == 0
    calls = 0
    assert track.client_sent(b"".join(data(1, b"") for _ in range(4000)))
    assert calls <= 4000


def _state(track: Unfinished, budget: BodyBudget) -> tuple[object, ...]:
    # A stream's record of a message that arrived whole in pieces stays, empty (held 0): the same
    # as none.
    held = {sid: m for sid, m in track.streams.items() if m.held}
    streams = {sid: (m.need, m.left, m.held, m.first, m.since, m.blocked_at) for sid, m in held.items()}
    return (streams, set(track.open), dict(track.windows), track.window, track.initial, track.blocked)


def _random_exchange(rng: random.Random) -> list[tuple[bool, bytes]]:
    """(from the client, bytes) in the order sent: streams opened, messages whole, cut or padded,
    streams reset or answered, and grpcio's window grants and settings between them."""
    out: list[tuple[bool, bytes]] = [(True, opening())]
    for sid in range(1, 2 * 40, 2):
        out.append((True, headers(sid, end=rng.random() < 0.05)))
        for _ in range(rng.randint(0, 3)):
            body = message(rng.choice([0, 5, 300, 20_000]), announced=rng.choice([None, None, 70_000]))
            cut = rng.randint(0, len(body))
            pad = rng.choice([0, 0, 1, 40])
            out.append((True, data(sid, body[:cut], pad=pad) + data(sid, body[cut:], end=rng.random() < 0.3)))
        if rng.random() < 0.3:
            out.append((True, bytes(RstStreamFrame(sid).serialize())))
        if rng.random() < 0.5:
            out.append((False, headers(sid, end=True) + window_update(0, rng.randint(1, 100_000))))
        if rng.random() < 0.3:
            out.append((False, window_update(sid, rng.randint(1, 50_000))))
        if rng.random() < 0.1:
            setting = {SettingsFrame.INITIAL_WINDOW_SIZE: rng.randint(0, 200_000)}
            out.append((False, bytes(SettingsFrame(0, settings=setting).serialize())))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_frames_read_whole_and_frames_split_across_reads_count_the_same(clock: Clock, seed: int) -> None:
    """Frames whole in one read take a shorter path than frames split across reads: every
    exchange, read whole and read in random pieces, leaves the same count after each send."""
    rng = random.Random(seed)
    whole_budget, split_budget = BodyBudget(1 << 30), BodyBudget(1 << 30)
    whole, split = Unfinished(whole_budget), Unfinished(split_budget)
    most = 0
    for inbound, sent in _random_exchange(rng):
        clock.now += rng.random()
        cuts = sorted({0, len(sent), *(rng.randint(0, len(sent)) for _ in range(rng.randint(1, 6)))})
        pieces = [sent[a:b] for a, b in itertools.pairwise(cuts)]
        if inbound:
            assert whole.client_sent(sent) == all([split.client_sent(p) for p in pieces])
        else:
            whole.server_sent(sent)
            for p in pieces:
                split.server_sent(p)
        assert _state(whole, whole_budget) == _state(split, split_budget)
        assert whole.held == split.held == whole_budget.used == split_budget.used
        most = max(most, whole.held)
    assert most > 0  # the exchange held messages under way: the comparison saw some


def test_a_flood_is_walked_no_further_than_the_step_past_the_bound() -> None:
    """A read of 256 KiB (a socket read's most) of empty frames or 5-byte messages holds 29,000
    or 52,000 steps: the walk stops at the one past the bound, whatever follows in the read."""
    cap = unfinished.STEPS_PER_READ
    frames = Unfinished(BodyBudget(1 << 30))
    assert not frames.client_sent(opening() + headers(1) + data(1, b"") * (256 * 1024 // 9))
    assert frames.reason == "frames_per_read" and frames.stepped == cap + 1
    messages = Unfinished(BodyBudget(1 << 30))
    flood = data(1, message(0) * (256 * 1024 // 5 - 8))
    assert not messages.client_sent(opening() + headers(1) + flood)
    assert messages.reason == "frames_per_read" and messages.stepped == cap + 1
    held = Unfinished(BodyBudget(1 << 30))  # the flood behind a message under way on its stream
    assert held.client_sent(opening() + headers(1) + data(1, message(10)[:3]))
    assert not held.client_sent(data(1, message(10)[3:] + message(0) * 20_000))
    assert held.stepped == cap + 1 and held.held == held.budget.used
