"""The capacity the worker reports, windowed so that its connection's assignment queue never
overflows (PROTOCOL §5.6, §10; docs/architecture.md, "Why the queue never overflows", says how
and what it costs): at most the handlers it is running plus
:data:`~orbit_sync.connection.ASSIGNMENT_BUFFER`, never more than its capacity. A new report
leaves :data:`SETTLE_AT` free; the next comes once fewer than :data:`RAISE_BELOW` or more than 8
are. Every report goes out pipelined under :attr:`CapacityWindow.lock`, held across its write,
so reports reach the wire in sequence order from whichever thread sends them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..connection import ASSIGNMENT_BUFFER, Submission
from ..errors import OrbitError
from ..models import CapacityReport
from ._link import Connection

__all__ = ["RAISE_BELOW", "SETTLE_AT", "CapacityWindow", "Held", "SentReport"]

#: Free capacity a new report leaves (after the first): room for a few takes and a few finishes
#: before the next one.
SETTLE_AT = 5
#: A raise is asked for once fewer than this many are free (and the capacity allows more).
RAISE_BELOW = 2


class Held(Protocol):
    """An attempt as the window counts it: ``held`` from :meth:`CapacityWindow.take` until
    :meth:`CapacityWindow.release`."""

    held: bool


class CapacityWindow:
    """The worker's capacity reports: sequence, drain flag, and the windowed capacity."""

    def __init__(self, capacity: int) -> None:
        #: Held across building a report and writing it (reentrant: a refused request's
        #: completion may run inside the write).
        self.lock = threading.RLock()
        self._capacity = capacity
        #: Slots held by handlers that could not be stopped (past their time limit): never
        #: offered (set under the lock).
        self.stuck = 0
        #: Attempts whose handler started and whose finish has not gone out yet.
        self._held = 0
        self._count_lock = threading.Lock()  # guards _held and each attempt's held flag
        self._drain = False
        self._sequence = 0
        #: The report in force (the last one built), and the last one the server acknowledged.
        self._report: CapacityReport | None = None
        self._acked: CapacityReport | None = None
        #: Guards ``_acked`` alone: answers arrive on a connection's reader, which must never
        #: wait for a thread holding ``lock`` across a write.
        self._ack_lock = threading.Lock()
        #: Where every report's answer goes, on the reader (the connection thread's handling,
        #: which sets it; nobody listens to a window used alone).
        self.answered: Callable[[SentReport], None] = lambda sent: None

    @property
    def offered(self) -> int:
        """The Worker's slots, stuck ones included (whatever part of them the window reports
        free now); 0 once it drains."""
        with self.lock:
            return 0 if self._drain else self._capacity

    @property
    def held(self) -> int:
        """Attempts whose handler started and whose finish has not gone out."""
        return self._held

    def take(self, attempt: Held) -> bool:
        """*attempt*'s handler starts: it counts until :meth:`release`. True when a raise is due
        (the connection thread sends it)."""
        with self._count_lock:
            attempt.held = True
            self._held += 1
        with self.lock:
            return self._report is None or self._wanted() != self._report.capacity

    def release(self, attempt: Held) -> None:
        """*attempt* no longer counts (once, if it did): its finish goes out now, or it ended
        without one. Never waits for ``lock`` (it may run on a reader)."""
        with self._count_lock:
            if attempt.held:
                attempt.held = False
                self._held -= 1

    def request_drain(self) -> None:
        """Every report from now on carries ``drain: true``."""
        with self.lock:
            self._drain = True

    def report(self) -> CapacityReport:
        """The report in force: the last one built, or a new one (the next sequence) when the
        capacity it reports must change or a drain was asked for since."""
        with self.lock:
            report = self._report
            capacity = self._wanted()
            if report is None or report.capacity != capacity or report.drain != self._drain:
                self._sequence += 1
                report = CapacityReport(
                    sequence=self._sequence, capacity=capacity, drain=self._drain
                )
                self._report = report
            return report

    def lowering(self) -> CapacityReport | None:
        """The report that must precede a finish about to go out (call :meth:`release` for it
        first, under :attr:`lock`), or None when the report in force already bounds the queue."""
        with self.lock:
            if self._report is None or self._report.capacity <= self._held + ASSIGNMENT_BUFFER:
                return None
            return self.report()

    def acked(self, report: CapacityReport) -> None:
        """The server acknowledged *report*."""
        with self._ack_lock:
            if self._acked is None or report.sequence > self._acked.sequence:
                self._acked = report

    def unacked(self) -> bool:
        """Is a report due: none acknowledged, or the one in force (or due) is newer?"""
        report = self.report()
        with self._ack_lock:
            return self._acked is None or report.sequence > self._acked.sequence

    def _wanted(self) -> int:
        """The capacity to report now (under the lock)."""
        held = self._held
        report = self._report
        capacity = max(0, self._capacity - self.stuck)
        if report is None:
            return min(capacity, held + ASSIGNMENT_BUFFER)
        free = report.capacity - held
        # More than the slots left, more free than the queue holds, or (room to grow) almost
        # none left.
        if (
            report.capacity > capacity
            or free > ASSIGNMENT_BUFFER
            or (free < RAISE_BELOW and report.capacity < capacity)
        ):
            return min(capacity, held + SETTLE_AT)
        return report.capacity


class SentReport:
    """A capacity report sent pipelined on *conn*, and its answer: the completion records it,
    hands it to *answered* (on the reader: it must not block), then sets :attr:`event` for a
    thread that waits for it."""

    def __init__(
        self,
        conn: Connection,
        report: CapacityReport,
        sent_at: float,
        timeout: float | None,
        answered: Callable[[SentReport], None],
    ) -> None:
        self.conn = conn
        self.report = report
        self.sent_at = sent_at
        self.submission = Submission("worker.capacity", report, self._done, None, timeout)
        self._answered = answered
        self.event = threading.Event()
        self.value: Any = None
        self.error: OrbitError | None = None
        #: Answered (or failed): set before *answered* runs, so that a thread it wakes finds it
        #: set; :attr:`event` is set once *answered* has recorded the answer.
        self.over = False

    def _done(self, value: Any, error: OrbitError | None) -> None:
        self.value, self.error = value, error
        self.over = True
        try:
            self._answered(self)
        finally:  # a waiter is released even if the callback failed (a bug, logged by the caller)
            self.event.set()
