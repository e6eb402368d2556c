"""The capacity window (worker/_window.py): the worker reports every handler slot it has, less
the stuck ones, and a new report (the next sequence) only when that or the drain flag changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest

from orbit_sync.models import CapacityReport
from orbit_sync.worker._window import CapacityWindow, SentReport


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


def _sent(answered: Callable[[SentReport], None]) -> SentReport:
    """A report as sent, its completion not run yet (no connection: nothing reads it here)."""
    return SentReport(cast(Any, None), CapacityReport(sequence=1, capacity=4), 0.0, None, answered)


def test_a_sent_report_is_over_before_its_answer_is_recorded_and_set_after() -> None:
    """A report's completion marks it over before the answered callback runs (a thread that
    callback wakes finds it answered, never a lost wake-up) and sets its event only after (a
    thread waiting on the event sees what the callback recorded)."""
    seen: list[tuple[bool, bool]] = []

    def answered(sent: SentReport) -> None:
        seen.append((sent.over, sent.event.is_set()))

    sent = _sent(answered)
    assert not sent.over and not sent.event.is_set()
    welcome = object()
    sent.submission.on_done(welcome, None)
    assert seen == [(True, False)]
    assert sent.over and sent.event.is_set() and sent.value is welcome and sent.error is None


def test_a_sent_report_whose_callback_fails_still_releases_its_waiter() -> None:
    """A failing answered callback (a bug) still sets the report's event: the connection thread
    waiting on it is never left hanging; the error goes to the connection, which logs it."""

    def answered(sent: SentReport) -> None:
        raise RuntimeError("bug")

    sent = _sent(answered)
    with pytest.raises(RuntimeError):
        sent.submission.on_done(object(), None)
    assert sent.over and sent.event.is_set()
