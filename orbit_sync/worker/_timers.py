"""One-shot timers on the worker's clock: the handlers' time limits and their cancel grace.

:class:`Timers` is a heap of callbacks due at a clock time; :meth:`Timers.run_due` calls those
that are due (outside its lock) and says when to come back. The lease watchdog's thread runs it
beside the leases (:class:`~._watchdog.WatchdogThread`): time limits are rare, short work, and a
thread of their own would be one more to start, wake and join. A callback must not block (it
steps an attempt's machine); one that raises is logged and the others still run.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable

__all__ = ["Timers"]

_LOG = logging.getLogger("orbit_sync.worker")


class Timers:
    """Callbacks due at times of *clock*; *on_change* is called when one is set earlier than
    what the thread running them sleeps until."""

    def __init__(self, clock: Callable[[], float], on_change: Callable[[], None]) -> None:
        self.clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int]] = []
        self._due: dict[int, Callable[[], None]] = {}
        self._seq = itertools.count(1)

    def call_at(self, at: float, fn: Callable[[], None]) -> int:
        """Call *fn* once, at clock time *at* (at once if past); return its handle."""
        with self._lock:
            handle = next(self._seq)
            self._due[handle] = fn
            earliest = not self._heap or at < self._heap[0][0]
            heapq.heappush(self._heap, (at, handle))
        if earliest:
            self._on_change()
        return handle

    def cancel(self, handle: int) -> None:
        """Forget the timer *handle* (nothing happens if it already ran)."""
        with self._lock:
            self._due.pop(handle, None)

    def run_due(self) -> float | None:
        """Call every timer due now; return when the next one is due (clock time) or ``None``."""
        now = self.clock()
        due: list[Callable[[], None]] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                _, handle = heapq.heappop(self._heap)
                fn = self._due.pop(handle, None)
                if fn is not None:
                    due.append(fn)
            while self._heap and self._heap[0][1] not in self._due:
                heapq.heappop(self._heap)  # cancelled
            nxt = self._heap[0][0] if self._heap else None
        for fn in due:
            try:
                fn()
            except Exception:
                _LOG.exception("worker timer failed")
        return nxt
