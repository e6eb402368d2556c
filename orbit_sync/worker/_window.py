"""The capacity the worker reports (PROTOCOL §5.6, §5.7): every handler slot it has, less the
slots held by handlers that could not be stopped (``stuck``), with the reports' sequence and
drain flag. The server counts every attempt it holds against that capacity across the
process's sessions, so it never assigns more than the handlers that are free. A burst of up to
the whole capacity in one TCP read does not overflow the connection's queue of 8: the reader
waits for room (``orbit_sync.connection.ASSIGNMENT_WAIT``) while the intake takes each one.
Every report goes out pipelined under :attr:`CapacityWindow.lock`, held across its write, so
reports reach the wire in sequence order from whichever thread sends them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..connection import Submission
from ..errors import OrbitError
from ..models import CapacityReport
from ._link import Connection

__all__ = ["CapacityWindow", "SentReport"]


class CapacityWindow:
    """The worker's capacity reports: sequence, drain flag, and the capacity offered."""

    def __init__(self, capacity: int) -> None:
        #: Held across building a report and writing it (reentrant: a refused request's
        #: completion may run inside the write).
        self.lock = threading.RLock()
        self._capacity = capacity
        #: Slots held by handlers that could not be stopped (past their time limit): never
        #: offered (set under the lock).
        self.stuck = 0
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
        """The Worker's slots, stuck ones included; 0 once it drains."""
        with self.lock:
            return 0 if self._drain else self._capacity

    def request_drain(self) -> None:
        """Every report from now on carries ``drain: true``."""
        with self.lock:
            self._drain = True

    def report(self) -> CapacityReport:
        """The report in force: the last one built, or a new one (the next sequence) when the
        capacity it reports must change (a slot got stuck or came free) or a drain was asked
        for since."""
        with self.lock:
            report = self._report
            capacity = max(0, self._capacity - self.stuck)
            if report is None or report.capacity != capacity or report.drain != self._drain:
                self._sequence += 1
                report = CapacityReport(
                    sequence=self._sequence, capacity=capacity, drain=self._drain
                )
                self._report = report
            return report

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
