"""Server time for the mock Orbit server.

The state machine never reads the system clock: it asks a clock object for ``now()`` (POSIX
seconds). Two clocks ship with the package:

* :class:`SystemClock` — real time (the default). Anchored once to the wall clock, then driven by
  ``time.monotonic()`` so NTP steps cannot move server time backwards; ``advance()`` adds an
  offset, so a test can jump over a lease window without waiting.
* :class:`ManualClock` — time moves only when told to. ``MockOrbitServer.advance()`` steps it
  through every due moment (lease expiry, recovery scans, backoff) before returning.

Any :class:`ServerClock` (``now() -> float`` and ``advance(seconds) -> None``) works; one whose
``real_time`` attribute is true is treated as moving by itself (the server then wakes on its own
to run due work). A :class:`ManualClock` is also an :class:`orbit_sync.Clock`, the clock the
client and the worker take, so one object can drive the server and the worker under test.
"""

from __future__ import annotations

import datetime as _dt
import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .._seconds import seconds as check_seconds
from ..worker._clock import ManualWaits

__all__ = ["DEFAULT_START", "ManualClock", "ServerClock", "SystemClock"]

#: Where a :class:`ManualClock` starts unless told otherwise: a fixed, readable instant.
DEFAULT_START = _dt.datetime(2026, 1, 1, tzinfo=_dt.timezone.utc)


@runtime_checkable
class ServerClock(Protocol):
    """What the mock server needs from a clock (the client and the worker take an
    :class:`orbit_sync.Clock`, which :class:`ManualClock` also is)."""

    def now(self) -> float:
        """Current server time in POSIX seconds."""

    def advance(self, seconds: float) -> None:
        """Move server time forward by *seconds* (>= 0)."""


class SystemClock:
    """Real time plus an offset that :meth:`advance` grows."""

    real_time = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wall0 = time.time()
        self._mono0 = time.monotonic()
        self._offset = 0.0

    def now(self) -> float:
        """Wall time at creation plus monotonic progress plus the advanced offset."""
        # One attribute read is atomic; the lock only serializes advance()'s read-modify-write.
        return self._wall0 + (time.monotonic() - self._mono0) + self._offset

    def advance(self, seconds: float) -> None:
        """Jump forward by *seconds*."""
        step = check_seconds(seconds, "seconds")
        with self._lock:
            self._offset += step

    def __repr__(self) -> str:
        return f"SystemClock(offset={self._offset:.3f})"


class ManualClock(ManualWaits):
    """A clock that moves only when :meth:`advance` is called.

    Listeners (the mock server subscribes one) are called after each move, so time advanced
    directly on the clock still runs the server's due work, on the server's scheduler thread.
    It is also an :class:`orbit_sync.Clock`: pass the same object to ``dial_worker(clock=...)``
    and ``Worker(clock=...)``, and their timed waits end when server time passes their deadlines.
    """

    real_time = False

    def __init__(self, start: float | _dt.datetime = DEFAULT_START) -> None:
        if isinstance(start, _dt.datetime):
            if start.utcoffset() is None:
                raise ValueError("start must be an aware datetime")
            start = start.timestamp()
        if isinstance(start, bool) or not isinstance(start, int | float):
            raise TypeError("start must be POSIX seconds or an aware datetime")
        super().__init__()
        self._now = float(start)
        self._listeners: list[Callable[[], None]] = []

    def now(self) -> float:
        """The current manual time."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move forward by *seconds* and notify listeners."""
        step = check_seconds(seconds, "seconds")
        with self._lock:
            self._now += step
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
        self._wake_all()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call *listener* after every move; returns a function that unsubscribes it."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def __repr__(self) -> str:
        when = _dt.datetime.fromtimestamp(self._now, tz=_dt.timezone.utc)
        return f"ManualClock({when.isoformat()})"
