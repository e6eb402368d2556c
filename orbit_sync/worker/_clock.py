"""An ``Event`` whose timed wait runs on any :class:`~orbit_sync.Clock` (the worker's waits for
its next due moment), so a test's ``ManualClock`` ends them when it moves past their deadline."""

from __future__ import annotations

import threading

from ..clock import Clock

__all__ = ["Wakeup"]


class Wakeup:
    """An ``Event`` whose timed :meth:`wait` runs on a :class:`~orbit_sync.Clock`."""

    __slots__ = ("_clock", "_cond", "_flag")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._flag = False

    def set(self) -> None:
        """Set the flag and wake every waiter."""
        with self._cond:
            self._flag = True
            self._cond.notify_all()

    def clear(self) -> None:
        """Reset the flag."""
        with self._cond:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the flag is set or *timeout* (clock seconds) passes; return the flag."""
        deadline = None if timeout is None else self._clock.now() + max(0.0, timeout)
        with self._cond:
            while True:
                if self._flag:
                    return True
                if deadline is not None and self._clock.now() >= deadline:
                    return False
                self._clock.wait(self._cond, deadline)
