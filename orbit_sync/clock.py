"""Time: one :class:`Clock` protocol and its real-time implementation, :class:`SystemClock`.

``Client.dial_worker(clock=...)`` (it anchors each lease's local deadline),
``Worker(clock=...)`` (lease deadlines, heartbeats, retry delays, drain and idle periods),
``Lease.may_run(clock)`` / ``Lease.remaining(clock)``, ``TaskContext(clock=...)``,
``HandlerEnvironment(clock=...)``, ``HealthProbe(clock=...)`` and ``MockOrbitServer(clock=...)``
take the same kind of object, so one clock drives a server, a connection, a worker and what
observes them alike. Leave it out for real time (:class:`SystemClock`); in tests pass
``orbit_sync.testing.ManualClock``, the test implementation (``server.advance(30)``, or a
freezegun ``tick()`` with ``ManualClock(follow=frozen)``, then moves every holder's time).

Network bounds (dial, call and read-idle timeouts) always run in real time: they measure the
network, not the worker's schedule.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ._realtime import monotonic

__all__ = ["Clock", "SystemClock"]


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


class SystemClock:
    """Real time: the monotonic clock (out of freezegun's reach: freezing time does not stop
    it) and the condition variable's own timeout (the default)."""

    def now(self) -> float:
        """Seconds on a monotonic clock."""
        return monotonic()

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
        return "SystemClock()"


def as_clock(clock: Clock | Callable[[], float] | None, *, _frames: int = 0) -> Clock:
    """*clock* as a :class:`Clock`: real time (:class:`SystemClock`) when ``None``.

    A bare function returning seconds was the old form of a clock: it still works for one
    release, wrapped by :func:`orbit_sync._deprecated.function_clock`, with a DeprecationWarning
    pointing at the code that called the public function that took it (*_frames*: the calls
    between that function and this one). Anything else raises ``TypeError``.
    """
    if clock is None:
        return SystemClock()
    # A clock has a `now`; asked first because a protocol's isinstance() costs ~10 us for an
    # object that is not one, on paths that may still pass a function per call.
    if hasattr(clock, "now") and isinstance(clock, Clock):
        return clock
    if callable(clock):
        # Imported here: only the deprecated path needs it, and _deprecated builds on this module.
        from ._deprecated import function_clock

        return function_clock(clock, stacklevel=3 + _frames)
    raise TypeError("clock must be an orbit_sync.Clock")


def now_reader(clock: Clock | Callable[[], float] | None) -> Callable[[], float]:
    """What reads *clock*'s time (see :func:`as_clock`): the monotonic clock itself for real time
    (no extra call on the hot paths that stamp every request), else the clock's ``now``."""
    if clock is None or type(clock) is SystemClock:
        return monotonic
    return as_clock(clock, _frames=1).now


def __getattr__(name: str) -> Any:
    if name == "WorkerClock":
        # Imported here: _deprecated builds on this module.
        from ._deprecated import moved

        return moved(__name__, name, "orbit_sync", "SystemClock")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
