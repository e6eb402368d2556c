"""Time for the client and the worker: one :class:`Clock` protocol and its real-time clock.

``Client.dial_worker(clock=...)`` (it anchors each lease's local deadline) and
``Worker(clock=...)`` (lease deadlines, heartbeats, retry delays, drain and idle periods) take the
same kind of object, so one clock drives a connection and a worker alike. Leave it out for real
time (:class:`WorkerClock`); in tests pass ``orbit_sync.testing.ManualClock`` (the mock server's
clock: ``server.advance(30)`` then moves the server's time and yours together) or
``orbit_sync.testing.FakeClock`` (moved by hand, or following a ``ManualClock``).

Network bounds (dial, call and read-idle timeouts) always run in real time: they measure the
network, not the worker's schedule.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "WorkerClock"]


@runtime_checkable
class Clock(Protocol):
    """A monotonic clock and the timed waits that run on it."""

    def now(self) -> float:
        """Seconds on a clock that never goes back (its origin means nothing)."""

    def wait(self, cond: threading.Condition, deadline: float | None) -> None:
        """Wait on *cond* (held by the caller) until notified or until *deadline* (clock time,
        ``None``: no deadline). May return early: callers re-check what they wait for."""

    def park(self, lock: threading.Lock, deadline: float) -> bool:
        """Acquire *lock*, waiting until *deadline* (clock time); False when the deadline came
        first. The lock is released through :meth:`unpark`."""

    def unpark(self, lock: threading.Lock) -> None:
        """Release *lock*, waking the thread parked on it."""


class WorkerClock:
    """Real time: ``time.monotonic`` and the condition variable's own timeout (the default)."""

    def now(self) -> float:
        """Seconds on a monotonic clock."""
        return time.monotonic()

    def park(self, lock: threading.Lock, deadline: float) -> bool:
        """Acquire *lock* (held by the caller's parking place), waiting until *deadline* (clock
        time); False when the deadline came first.

        In real time this is the lock's own timed acquire: :meth:`unpark` wakes exactly this
        thread and takes no Python-level lock (the idle pool threads' hot path).
        """
        return lock.acquire(timeout=max(0.0, deadline - self.now()))

    def unpark(self, lock: threading.Lock) -> None:
        """Release *lock*, waking the thread parked on it."""
        lock.release()

    def wait(self, cond: threading.Condition, deadline: float | None) -> None:
        """Wait on *cond* (held by the caller) until notified or until *deadline* (clock time).

        May return early (a notification, or spuriously): callers re-check what they wait for.
        """
        if deadline is None:
            cond.wait()
        else:
            remaining = deadline - self.now()
            if remaining > 0:
                cond.wait(remaining)

    def __repr__(self) -> str:
        return "WorkerClock()"


def now_reader(clock: Clock | Callable[[], float] | None) -> Callable[[], float]:
    """What reads *clock*'s time: ``time.monotonic`` itself for real time (no extra call on the
    hot paths that stamp every request), else the clock's ``now``.

    A bare function returning seconds was the old form of a clock: it still works for one
    release, with a DeprecationWarning pointing at the caller of the function that took it.
    """
    if clock is None or type(clock) is WorkerClock:
        return time.monotonic
    if isinstance(clock, Clock):
        return clock.now
    if callable(clock):
        warnings.warn(
            "a function as clock is deprecated and goes in the next release: pass an "
            "orbit_sync.Clock (orbit_sync.testing.ManualClock or FakeClock in tests)",
            DeprecationWarning,
            stacklevel=3,
        )
        return clock
    raise TypeError("clock must be an orbit_sync.Clock")
