"""Server time for the mock Orbit server.

The state machine never reads the system clock: it asks a clock object for ``now()`` (POSIX
seconds). Two clocks ship with the package:

* :class:`SystemClock` — real time (the default). Anchored once to the wall clock, then driven by
  the monotonic clock so NTP steps cannot move server time backwards (both read as at import:
  freezegun's frozen time does not reach it, see :mod:`orbit_sync._realtime`); ``advance()`` adds an
  offset, so a test can jump over a lease window without waiting.
* :class:`ManualClock` — time moves only when told to. ``MockOrbitServer.advance()`` steps it
  through every due moment (lease expiry, recovery scans, backoff) before returning. With
  ``follow=`` it moves with freezegun's frozen time instead (see :meth:`ManualClock._follow`).

Any :class:`ServerClock` (``now() -> float`` and ``advance(seconds) -> None``) works; one whose
``real_time`` attribute is true is treated as moving by itself (the server then wakes on its own
to run due work). A :class:`ManualClock` is also an :class:`orbit_sync.Clock`, the clock the
client and the worker take, so one object can drive the server and the worker under test.
"""

from __future__ import annotations

import calendar
import datetime as _dt
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .._realtime import monotonic, wall
from .._seconds import seconds as check_seconds
from ..worker._clock import ManualWaits

if TYPE_CHECKING:
    from freezegun.api import FrozenDateTimeFactory

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
        self._wall0 = wall()
        self._mono0 = monotonic()
        self._offset = 0.0

    def now(self) -> float:
        """Wall time at creation plus monotonic progress plus the advanced offset."""
        # One attribute read is atomic; the lock only serializes advance()'s read-modify-write.
        return self._wall0 + (monotonic() - self._mono0) + self._offset

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

    With *follow* (what freezegun's ``freeze_time()`` returns), the clock starts at the frozen
    time and moves with it: each ``tick()`` or ``move_to()`` of that object advances this clock
    too, waking its timed waits and running the server's due work. freezegun alone changes what
    ``time.time()`` and ``time.monotonic()`` return, but cannot end a wait already sleeping
    towards a deadline; this is the bridge.
    """

    real_time = False

    def __init__(
        self,
        start: float | _dt.datetime | None = None,
        *,
        follow: FrozenDateTimeFactory | None = None,
    ) -> None:
        if follow is not None:
            if start is not None:
                raise TypeError("pass start or follow, not both: a followed clock starts there")
            start = _frozen_seconds(_check_frozen(follow))
        elif start is None:
            start = DEFAULT_START
        if isinstance(start, _dt.datetime):
            if start.utcoffset() is None:
                raise ValueError("start must be an aware datetime")
            start = start.timestamp()
        if isinstance(start, bool) or not isinstance(start, int | float):
            raise TypeError("start must be POSIX seconds or an aware datetime")
        super().__init__()
        self._now = float(start)
        self._listeners: list[Callable[[], None]] = []
        if follow is not None:
            self._follow(follow)

    def _follow(self, frozen: FrozenDateTimeFactory) -> None:
        """Make *frozen*'s ``tick`` and ``move_to`` advance this clock after moving freezegun's
        time (freezegun offers no hook; its ``move_to`` itself calls ``tick``, so wrapping both
        catches every move, and a repeated catch advances by zero). Moving back is refused: the
        frozen time is put back and ``ValueError`` raised, since this clock never goes back."""
        tick, move_to = frozen.tick, frozen.move_to

        def catch_up(before: _dt.datetime) -> None:
            step = _frozen_seconds(frozen) - self.now()
            if step < 0:
                move_to(before)
                raise ValueError("frozen time cannot move back while a ManualClock follows it")
            if step > 0:
                self.advance(step)

        def ticked(delta: _dt.timedelta | float = _dt.timedelta(seconds=1)) -> _dt.datetime:
            before = frozen()
            tick(delta)
            catch_up(before)
            return frozen()

        def moved(target: _dt.datetime | _dt.date | str) -> None:
            before = frozen()
            move_to(target)
            catch_up(before)

        # Instance attributes shadow the class's methods, for this one frozen time only.
        frozen.tick = ticked  # type: ignore[method-assign]
        frozen.move_to = moved  # type: ignore[assignment, method-assign]

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


def _check_frozen(frozen: object) -> FrozenDateTimeFactory:
    """*frozen* if it is freezegun's frozen time (``freeze_time()`` without ``tick`` or
    ``auto_tick_seconds``: time that moves by itself cannot be followed move by move)."""
    try:
        from freezegun.api import FrozenDateTimeFactory
    except ImportError:
        raise TypeError("follow takes what freezegun's freeze_time() returns") from None
    if not isinstance(frozen, FrozenDateTimeFactory):
        raise TypeError(
            "follow takes what freezegun's freeze_time() returns, without tick=True or "
            "auto_tick_seconds (time that moves by itself)"
        )
    return frozen


def _frozen_seconds(frozen: FrozenDateTimeFactory) -> float:
    """POSIX seconds of freezegun's frozen time (a naive UTC datetime), computed as freezegun's
    own ``time.time()`` computes them, so both read the same float."""
    when = frozen()
    return calendar.timegm(when.timetuple()) + when.microsecond / 1e6
