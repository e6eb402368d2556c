"""The capacity window (worker/_window.py): what the worker reports never leaves more than the
connection's 8-assignment queue free beyond the attempts it holds, and changes rarely."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, cast

import pytest

from orbit_sync.connection import ASSIGNMENT_BUFFER
from orbit_sync.models import CapacityReport
from orbit_sync.worker._window import RAISE_BELOW, SETTLE_AT, CapacityWindow, SentReport


class _Held:
    def __init__(self) -> None:
        self.held = False


def test_a_capacity_of_8_or_less_is_reported_as_is_and_never_changes() -> None:
    """Capacity 8: the first report says 8, and takes and finishes never make another."""
    window = CapacityWindow(8)
    first = window.report()
    assert (first.sequence, first.capacity, first.drain) == (1, 8, False)
    attempts = [_Held() for _ in range(8)]
    for attempt in attempts:
        assert not window.take(attempt)
    for attempt in attempts:
        with window.lock:
            window.release(attempt)
            assert window.lowering() is None
    assert window.report() is first


def test_the_report_follows_what_is_held_with_hysteresis() -> None:
    """Capacity 32: 8 at first; a raise once fewer than 2 are free; a finish that would leave
    more than 8 free brings a lowered report that goes out ahead of it; each new report leaves
    5 free."""
    window = CapacityWindow(32)
    assert window.report().capacity == ASSIGNMENT_BUFFER
    attempts = [_Held() for _ in range(7)]
    raises = [window.take(attempt) for attempt in attempts]
    assert raises == [False] * (ASSIGNMENT_BUFFER - RAISE_BELOW) + [True]
    raised = window.report()
    assert (raised.sequence, raised.capacity) == (2, 7 + SETTLE_AT)
    with window.lock:
        for attempt in attempts[:3]:
            window.release(attempt)
            window.release(attempt)  # once only
            assert window.lowering() is None  # at most 8 free
        assert window.held == 4
        window.release(attempts[3])
        lowered = window.lowering()
    assert lowered is not None
    assert (lowered.sequence, lowered.capacity) == (3, 3 + SETTLE_AT)


def test_no_interleaving_of_takes_and_finishes_leaves_more_than_8_free() -> None:
    """Random takes (within what the report leaves free) and finishes (each preceded by the
    lowering it asks for): the report in force never exceeds what is held plus 8, nor the
    capacity; reports are far fewer than tasks."""
    rng = random.Random(7)
    window = CapacityWindow(32)
    held: list[_Held] = []
    in_force = window.report()
    reports = 1
    for _ in range(5000):
        free = in_force.capacity - len(held)
        if free > 0 and (not held or rng.random() < 0.5):
            attempt = _Held()
            held.append(attempt)
            if window.take(attempt):
                new = window.report()
                reports += new is not in_force
                in_force = new
        elif held:
            with window.lock:
                window.release(held.pop(rng.randrange(len(held))))
                lowered = window.lowering()
            if lowered is not None:
                in_force, reports = lowered, reports + 1
        assert in_force.capacity <= min(32, len(held) + ASSIGNMENT_BUFFER)
    assert reports < 5000 / 4


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
    """Capacity 4 with 1 held: one slot stuck lowers the report to 3, a second to 2 even with
    room free; freed again, the next report offers them (at most what is held plus 5)."""
    window = CapacityWindow(4)
    held = _Held()
    window.take(held)
    assert window.report().capacity == 4
    for stuck, capacity in [(1, 3), (2, 2), (0, 4)]:
        with window.lock:
            window.stuck = stuck
        assert window.report().capacity == capacity


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
