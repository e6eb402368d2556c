"""Clocks that move by hand, for tests (the :class:`~orbit_sync.Clock` protocol and its
real-time clock live in :mod:`orbit_sync.clock`).

:class:`ManualWaits` gives a hand-moved clock the protocol's timed waits; :class:`FakeClock` moves
only when told to (or when the mock server's ``ManualClock`` it follows moves), so a test can let
a lease window, a drain timeout or an idle period pass at once instead of sleeping through it.
:class:`Wakeup` is an ``Event`` whose timed wait runs on any clock.
"""

from __future__ import annotations

import abc
import collections
import math
import threading
from collections.abc import Callable
from typing import Protocol

from .._realtime import monotonic
from .._seconds import seconds as check_seconds
from ..clock import Clock, WorkerClock

__all__ = ["FakeClock", "ManualWaits", "Wakeup", "WorkerClock"]


class _Follows(Protocol):
    def now(self) -> float: ...

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]: ...


class ManualWaits(abc.ABC):
    """Timed waits for a clock that moves by hand: a subclass reads its time in :meth:`now` and
    calls :meth:`_wake_all` after every move, so each waiter re-checks its deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Conditions someone waits on with a deadline, with how many waiters each.
        self._waiting: dict[threading.Condition, int] = {}
        #: Threads in a timed wait on this clock (notified on every change).
        self._sleepers: collections.Counter[str] = collections.Counter()
        self._sleep_change = threading.Condition(self._lock)
        #: Notified by unpark(), so that parked threads re-check their locks.
        self._park_change = threading.Condition()

    @abc.abstractmethod
    def now(self) -> float:
        """The clock's time."""

    def wait(self, cond: threading.Condition, deadline: float | None) -> None:
        """Wait on *cond* until notified, or until the clock moves past *deadline*."""
        if deadline is None:
            cond.wait()
            return
        # Registered before time is read: a move after the read then finds us and
        # notifies (it needs cond, which we hold until cond.wait releases it), so no move is lost.
        name = threading.current_thread().name
        with self._lock:
            self._waiting[cond] = self._waiting.get(cond, 0) + 1
            self._sleepers[name] += 1
            self._sleep_change.notify_all()
        try:
            if self.now() < deadline:
                cond.wait()
        finally:
            with self._lock:
                left = self._waiting[cond] - 1
                if left:
                    self._waiting[cond] = left
                else:
                    del self._waiting[cond]
                self._sleepers[name] -= 1
                if not self._sleepers[name]:
                    del self._sleepers[name]
                self._sleep_change.notify_all()

    def sleepers(self, prefix: str = "") -> int:
        """How many threads (named with *prefix*) are in a timed wait on this clock now."""
        with self._lock:
            return sum(n for name, n in self._sleepers.items() if name.startswith(prefix))

    def wait_for_sleepers(self, count: int, prefix: str = "", timeout: float = 10.0) -> bool:
        """Wait (real time, at most *timeout*) until at least *count* threads named with
        *prefix* are in a timed wait on this clock: what a move of the clock will then wake."""
        deadline = monotonic() + timeout
        with self._lock:
            while sum(n for name, n in self._sleepers.items() if name.startswith(prefix)) < count:
                remaining = deadline - monotonic()
                if remaining <= 0:
                    return False
                self._sleep_change.wait(remaining)
            return True

    def _wake_all(self) -> None:
        with self._lock:
            conds = list(self._waiting)
        for cond in conds:
            with cond:
                cond.notify_all()

    def park(self, lock: threading.Lock, deadline: float) -> bool:
        """Acquire *lock*, or return False once the clock moves past *deadline*.

        The lock must be released through :meth:`unpark`: it and every move of the clock wake
        this wait.
        """
        with self._park_change:
            while not lock.acquire(blocking=False):
                if self.now() >= deadline:
                    return False
                self.wait(self._park_change, deadline)
            return True

    def unpark(self, lock: threading.Lock) -> None:
        """Release *lock* and wake the threads in :meth:`park`."""
        with self._park_change:
            lock.release()
            self._park_change.notify_all()


class FakeClock(ManualWaits):
    """A monotonic clock that moves only when :meth:`advance` is called, for tests.

    With *follow* (the mock server's ``ManualClock``), it reads that clock instead (minus where it
    stood at creation) and wakes waiters whenever it moves: ``server.advance(30)`` then moves the
    server's and the worker's time together.
    """

    def __init__(self, start: float = 0.0, *, follow: _Follows | None = None) -> None:
        if isinstance(start, bool) or not isinstance(start, int | float):
            raise TypeError("start must be a number of seconds")
        if not math.isfinite(start):
            raise ValueError("start must be a finite number of seconds")
        super().__init__()
        self._now = float(start)
        self._follow = follow
        self._origin = 0.0 if follow is None else follow.now() - float(start)
        if follow is not None:
            follow.subscribe(self._wake_all)

    def now(self) -> float:
        """The fake time."""
        if self._follow is not None:
            return self._follow.now() - self._origin
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move forward by *seconds* and wake every timed waiter to re-check its deadline."""
        step = check_seconds(seconds, "seconds")
        if self._follow is not None:
            raise RuntimeError("this clock follows another: advance that one")
        with self._lock:
            self._now += step
        self._wake_all()

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now():.3f})"


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

    def is_set(self) -> bool:
        """True while the flag is set."""
        return self._flag

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
