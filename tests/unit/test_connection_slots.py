"""edged/transports/http/slots.py: fair shares of connection slots (pure logic; holders with a
recording close stand in for connections)."""

from __future__ import annotations

from edged.transports.http.slots import RESERVE_PER_PEER, ConnectionLimits, ConnectionSlots, Holder, Slot


def slots(total: int = 8, per_peer: int = 3, reserved: int = 4) -> ConnectionSlots:
    return ConnectionSlots(
        ConnectionLimits(max_connections=total, max_connections_per_peer=per_peer, reserved_connections=reserved)
    )


class Closed:
    def __init__(self) -> None:
        self.holders: list[Holder] = []


def holder(key: object, closed: Closed) -> Holder:
    h: Holder

    def close() -> None:
        closed.holders.append(h)

    h = Holder(key, close)
    return h


def test_a_peer_takes_its_share_then_the_reserve_then_nothing() -> None:
    s, closed = slots(), Closed()
    got = [s.admit(holder("a", closed), pending=False) for _ in range(3 + RESERVE_PER_PEER + 1)]
    assert got == [Slot.POOL] * 3 + [Slot.RESERVE] * RESERVE_PER_PEER + [None]
    assert s.open == 3 and s.reserved == RESERVE_PER_PEER
    # Another peer still finds room in the pool.
    assert s.admit(holder("b", closed), pending=False) is Slot.POOL
    assert closed.holders == []


def test_release_gives_the_slot_back_once() -> None:
    s, closed = slots(per_peer=1), Closed()
    h = holder("a", closed)
    assert s.admit(h, pending=False) is Slot.POOL
    s.release(h)
    s.release(h)  # connection_lost after an eviction: nothing more
    assert s.open == 0 and s.held_by("a") == 0
    assert s.admit(holder("a", closed), pending=False) is Slot.POOL


def test_pending_connections_of_the_same_peer_make_room_oldest_first() -> None:
    s, closed = slots(per_peer=2), Closed()
    first, second = holder("a", closed), holder("a", closed)
    assert s.admit(first, pending=True) is Slot.POOL
    assert s.admit(second, pending=True) is Slot.POOL
    third = holder("a", closed)
    assert s.admit(third, pending=True) is Slot.POOL
    assert closed.holders == [first] and first.slot is None
    assert s.held_by("a") == 2


def test_an_authenticated_connection_is_not_evicted() -> None:
    s, closed = slots(per_peer=1), Closed()
    h = holder("a", closed)
    s.admit(h, pending=True)
    s.authenticated(h)
    assert s.admit(holder("a", closed), pending=True) is Slot.RESERVE
    assert closed.holders == []


def test_a_full_pool_evicts_any_peers_pending_connection_for_another_peer() -> None:
    s, closed = slots(total=4, per_peer=4, reserved=0), Closed()
    flood = [holder(("address", f"127.0.0.{i}"), closed) for i in range(4)]
    for h in flood:
        assert s.admit(h, pending=True) is Slot.POOL
    local = holder(("uid", 1000), closed)
    assert s.admit(local, pending=False) is Slot.POOL
    assert closed.holders == [flood[0]] and s.open == 4


def test_held_connections_that_showed_their_token_keep_others_out_only_of_their_share() -> None:
    s, closed = slots(total=6, per_peer=3, reserved=0), Closed()
    for _ in range(3):
        h = holder("a", closed)
        s.admit(h, pending=False)
    assert s.admit(holder("a", closed), pending=False) is None
    assert [s.admit(holder("b", closed), pending=False) for _ in range(3)] == [Slot.POOL] * 3
