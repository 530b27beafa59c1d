"""When MQTT messages are run and acknowledged (mqtt_acks.py) and what survives a restart
(mqtt_journal.py). Pure logic: the acknowledgements are recorded by a list, the journal is a real
file in tmp_path."""

from __future__ import annotations

from pathlib import Path

from edged.transports.mqtt.acks import Deliveries, Verdict
from edged.transports.mqtt.journal import Journal


def make(tmp_path: Path | None = None, remember: int = 8) -> tuple[Deliveries, list[int]]:
    acked: list[int] = []
    path = tmp_path / "edged-x.running" if tmp_path is not None else None
    return Deliveries(lambda mid, qos: acked.append(mid), remember, Journal(path, 8)), acked


def test_acks_go_out_in_arrival_order_once_answered() -> None:
    d, acked = make()
    d.connected(False)
    a, b, c = (d.receive("t", mid, 1, False, 10, 0) for mid in (1, 2, 3))
    for x in (a, b, c):
        d.started(x)
    d.finish(c)
    d.finish(b)
    assert acked == []  # 1 is still running: nothing may overtake it
    d.finish(a)
    assert acked == [1, 2, 3]


def test_qos0_is_neither_tracked_nor_acknowledged() -> None:
    d, acked = make()
    x = d.receive("t", 0, 0, False, 10, 0)
    d.started(x)
    d.finish(x)
    assert x.verdict is Verdict.NEW and acked == [] and d.unacknowledged == 0


def test_redelivery_while_running_is_acknowledged_with_the_first() -> None:
    d, acked = make()
    d.connected(False)
    first = d.receive("t", 7, 1, False, 10, 0)
    d.started(first)
    d.connected(True)  # the connection dropped: its owed ack is void
    again = d.receive("t", 7, 1, True, 10, 0)
    assert again.verdict is Verdict.RUNNING
    d.finish(first)
    assert acked == [7]  # on the new connection, once


def test_redelivery_of_an_answered_message_is_acknowledged_not_rerun() -> None:
    d, acked = make()
    d.connected(False)
    x = d.receive("t", 5, 1, False, 10, 0)
    d.started(x)
    d.finish(x)
    d.connected(True)  # the ack was lost with the connection
    again = d.receive("t", 5, 1, True, 10, 0)
    assert again.verdict is Verdict.DUPLICATE
    d.finish(again)
    assert acked == [5, 5]


def test_a_dup_never_seen_is_run_unless_a_previous_run_died_on_it(tmp_path: Path) -> None:
    d, acked = make(tmp_path)
    d.connected(False)
    poison = d.receive("t/poison", 3, 1, False, 999, 4)
    d.started(poison)  # edged dies while it runs: never finished, never acknowledged
    idle = d.receive("t/idle", 4, 1, False, 5, 0)  # received, never started
    d.journal.close()
    later, acked2 = make(tmp_path)  # the next start
    later.connected(True)
    again = later.receive("t/poison", 3, 1, True, 999, 4)
    in_pipe = later.receive("t/idle", 4, 1, True, 5, 0)
    assert again.verdict is Verdict.REDELIVERED
    assert in_pipe.verdict is Verdict.NEW  # DUP alone is not a failure
    assert idle.verdict is Verdict.NEW and acked == []
    later.finish(again)
    assert acked2 == [3]
    # Its acknowledgement lost again: still not run.
    later.connected(True)
    assert later.receive("t/poison", 3, 1, True, 999, 4).verdict is Verdict.DUPLICATE


def test_finished_messages_leave_the_journal(tmp_path: Path) -> None:
    d, _ = make(tmp_path)
    d.connected(False)
    x = d.receive("t", 1, 1, False, 10, 0)
    d.started(x)
    d.finish(x)
    d.journal.close()
    assert (tmp_path / "edged-x.running").read_bytes() == bytes(8 * 16)


def test_a_reused_packet_id_is_a_new_message_and_keeps_its_own_record() -> None:
    d, acked = make()
    d.connected(False)
    old = d.receive("t", 1, 1, False, 10, 0)
    d.started(old)
    d.connected(False)  # the session was lost: the broker starts packet ids afresh
    new = d.receive("t", 1, 1, False, 10, 0)
    d.started(new)
    d.finish(old)  # the old message ending must not acknowledge the new one
    assert acked == []
    d.finish(new)
    assert acked == [1]


def test_the_done_set_is_bounded() -> None:
    d, _ = make(remember=2)
    d.connected(False)
    for mid in range(1, 5):
        x = d.receive("t", mid, 1, False, 10, 0)
        d.started(x)
        d.finish(x)
    d.connected(True)
    assert d.receive("t", 4, 1, True, 10, 0).verdict is Verdict.DUPLICATE
    assert d.receive("t", 1, 1, True, 10, 0).verdict is Verdict.NEW  # forgotten: run again


def test_a_full_journal_still_runs_messages(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j", 1)
    assert j.start(b"a" * 16) == 0
    assert j.start(b"b" * 16) == -1
    j.end(-1)
    j.end(0)
    assert j.start(b"c" * 16) == 0
