"""The capacity the worker reports, windowed so that its connection's assignment queue never
overflows (PROTOCOL §5.6, §10).

The reader of a connection puts each ``task.assign`` on a ``queue.Queue`` of
:data:`~orbit_sync.connection.ASSIGNMENT_BUFFER` (8); a 9th unread one ends the connection. The
server may send as many assignments as the reported capacity leaves free, all in one TCP read,
and the reader decodes them faster than the thread that takes them wakes (the GIL): with a
capacity of 32, a burst of 32 would overflow. So the report never leaves more than 8 free: the
worker reports ``capacity`` as at most the attempts whose handler is *running* (started, finish
not yet sent) plus 8, and never more than the Worker's capacity. The server counts what it has
assigned and not seen finished, which includes every running attempt; what it can still send is
the reported capacity minus that, never more than 8, so at most 8 are ever unread. Counting the
running handlers (not every attempt taken) keeps the report still while short tasks flow: 8 in
flight keep a worker busy, and the report grows only as handlers that last pile up.

The bound must hold in the server's order of frames: a finish frees a slot on the server, so a
finish that would leave more than 8 free goes out right behind a lowered report, in the same
write (:meth:`CapacityWindow.lowering`). Raising is never urgent for the bound: a starting
handler asks for it (:meth:`CapacityWindow.take`) and the connection thread sends it.
Hysteresis keeps reports rare: every new report leaves :data:`SETTLE_AT` free, and the next one
comes only once fewer than :data:`RAISE_BELOW` or more than 8 are free.

Every report goes out under :attr:`CapacityWindow.lock`, held across its write, so reports reach
the wire in sequence order from whichever thread sends them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from ..connection import ASSIGNMENT_BUFFER, Submission
from ..errors import OrbitError
from ..models import CapacityReport
from ._link import Connection

__all__ = ["RAISE_BELOW", "SETTLE_AT", "CapacityWindow", "Held"]

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
        #: Where the answer to a report sent ahead of a finish goes (``(connection, report,
        #: sent_at, value, error)``, on the reader): the connection thread's handling, which
        #: sets it.
        self.answered: Callable[
            [Connection, CapacityReport, float, Any, OrbitError | None], None
        ] = _ignored

    @property
    def offered(self) -> int:
        """The Worker's slots, stuck ones included (whatever part of them the window reports
        free now); 0 once it drains."""
        with self.lock:
            return 0 if self._drain else self._capacity

    @property
    def held(self) -> int:
        """Attempts whose handler started and whose finish has not gone out (what the window is
        counted from)."""
        return self._held

    def take(self, attempt: Held) -> bool:
        """*attempt*'s handler starts: it counts until :meth:`release`. True when a raise is due
        (the connection thread sends it)."""
        with self._count_lock:
            attempt.held = True
            self._held += 1
        with self.lock:
            return self._wanted() != self._current_capacity()

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

    def submission(
        self, conn: Connection, report: CapacityReport, sent_at: float, timeout: float | None
    ) -> Submission:
        """*report*, to send on *conn*, as a pipelined request whose answer goes to
        :attr:`answered`."""
        answered = partial(self.answered, conn, report, sent_at)
        return Submission("worker.capacity", report, answered, None, timeout)

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

    def _current_capacity(self) -> int | None:
        return None if self._report is None else self._report.capacity

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


def _ignored(
    conn: Connection, report: CapacityReport, sent_at: float, value: Any, error: OrbitError | None
) -> None:
    """No connection thread listens (a window used alone)."""
