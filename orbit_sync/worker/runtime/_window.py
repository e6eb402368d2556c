"""The capacity the worker reports (PROTOCOL §5.6, §5.7): every handler slot less those held by
handlers that could not be stopped (``stuck``), with the reports' sequence and drain flag. The
server counts every attempt it holds against it across the process's sessions, so it never
assigns more than the free handlers; a burst in one TCP read waits for room in the connection's
queue (``orbit_sync.connection.ASSIGNMENT_WAIT``). Every report is written under
:attr:`CapacityWindow.lock`, so reports reach the wire in sequence order.
"""

from __future__ import annotations

import threading
from typing import Any

from ..._slots import Settable
from ...connection import BatchCall
from ...errors import OrbitError
from ...models import CapacityReport
from ._link import Connection

__all__ = ["CapacityWindow", "SentReport"]


class CapacityWindow:
    """The worker's capacity reports: sequence, drain flag, and the capacity offered."""

    def __init__(self, capacity: int) -> None:
        #: Held across building a report and writing it (reentrant: report() takes it too).
        self.lock = threading.RLock()
        self._capacity = capacity
        #: Slots of handlers that could not be stopped: never offered (set under the lock).
        self.stuck = 0
        self._drain = False
        self._sequence = 0
        #: The report in force (the last one built), and the last one the server acknowledged.
        self._report: CapacityReport | None = None
        self._acked: CapacityReport | None = None

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
        """The report in force: the last built, or the next if its capacity or drain changed."""
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
        with self.lock:
            if self._acked is None or report.sequence > self._acked.sequence:
                self._acked = report

    def unacked(self) -> bool:
        """Is a report due: none acknowledged, or the one in force (or due) is newer?"""
        with self.lock:
            report = self.report()
            return self._acked is None or report.sequence > self._acked.sequence


class SentReport:
    """A capacity report sent on *conn* and its answer: read once :attr:`over` (*wake* is set as
    it arrives) or waited for (:meth:`wait`)."""

    def __init__(
        self,
        conn: Connection,
        report: CapacityReport,
        sent_at: float,
        timeout: float | None,
        wake: Settable,
    ) -> None:
        self.conn = conn
        self.report = report
        self.sent_at = sent_at
        [self._call] = conn.send_many(
            [BatchCall("worker.capacity", report, None, timeout)], wake=wake
        )
        self.value: Any = None
        self.error: OrbitError | None = None
        self._read = False

    @property
    def over(self) -> bool:
        """Answered (or failed)?"""
        return self._call.done()

    def wait(self) -> None:
        """Wait for the answer (within the call's bound) into :attr:`value` or :attr:`error`."""
        if self._read:
            return
        self._read = True
        try:
            self.value = self._call.result()
        except OrbitError as exc:
            self.error = exc
