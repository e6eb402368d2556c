"""The capacity window (worker/_window.py): the worker reports every handler slot it has, less
the stuck ones, and a new report (the next sequence) only when that or the drain flag changes."""

from __future__ import annotations

import threading

import pytest
from _scripted import WAIT, ScriptedServer, open_pair, welcome_body

from orbit_sync.errors import WorkerClosed
from orbit_sync.models import CapacityReport
from orbit_sync.worker.runtime._window import CapacityWindow, SentReport


@pytest.mark.parametrize("capacity", [1, 8, 32, 256])
def test_the_whole_capacity_is_reported_and_the_report_stays_the_same(capacity: int) -> None:
    """The first report offers every slot, whatever the capacity (no window below the queue's
    8); asking again builds no new report."""
    window = CapacityWindow(capacity)
    first = window.report()
    assert (first.sequence, first.capacity, first.drain) == (1, capacity, False)
    assert window.report() is first
    assert window.offered == capacity


def test_a_drain_makes_a_new_report_with_the_next_sequence() -> None:
    """request_drain(): the next report carries drain, under a new sequence; acked() records
    the newest answered one."""
    window = CapacityWindow(4)
    first = window.report()
    assert window.unacked()
    window.acked(first)
    assert not window.unacked()
    window.request_drain()
    drained = window.report()
    assert drained.drain and drained.sequence == first.sequence + 1
    assert window.unacked()
    window.acked(drained)
    window.acked(first)  # an older answer does not undo a newer one
    assert not window.unacked()


def test_stuck_slots_are_never_offered_and_come_back_once_freed() -> None:
    """Capacity 4: one slot stuck lowers the report to 3, a second to 2; freed again, the next
    report offers them, each change under the next sequence; a drain keeps the capacity."""
    window = CapacityWindow(4)
    assert window.report().capacity == 4
    for sequence, (stuck, capacity) in enumerate([(1, 3), (2, 2), (0, 4)], start=2):
        with window.lock:
            window.stuck = stuck
        report = window.report()
        assert (report.sequence, report.capacity) == (sequence, capacity)
    window.request_drain()
    assert window.offered == 0 and window.report().capacity == 4


def test_a_sent_report_is_over_once_answered_and_wakes_its_thread() -> None:
    """A report goes out in its own slot: not over before its answer; the answer sets the
    wake-up the connection thread sleeps on, and wait() records the server's welcome."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            wake = threading.Event()
            sent = SentReport(conn, CapacityReport(sequence=1, capacity=4), 0.0, None, wake)
            frame = peer.recv()
            assert frame["type"] == "worker.capacity" and frame["body"]["capacity"] == 4
            assert not sent.over and not wake.is_set()
            peer.ack(frame, welcome_body())
            assert wake.wait(WAIT) and sent.over
            sent.wait()
            assert sent.error is None and sent.value.session_id == conn.session_id
        finally:
            conn.close()


def test_a_sent_report_whose_connection_ends_is_over_with_that_error() -> None:
    """A connection that ends before the report's answer ends the report too: its waiter is
    woken and wait() records the connection's error, bound to the report's message_id."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        wake = threading.Event()
        sent = SentReport(conn, CapacityReport(sequence=1, capacity=4), 0.0, None, wake)
        frame = peer.recv()
        conn.close()
        assert wake.wait(WAIT) and sent.over
        sent.wait()
        assert isinstance(sent.error, WorkerClosed)
        assert sent.error.message_id == frame["message_id"]
