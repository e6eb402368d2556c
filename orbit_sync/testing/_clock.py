"""The clock for tests, :class:`ManualClock`, and how the mock server reads time.

:class:`ManualClock` is the test implementation of :class:`orbit_sync.Clock` (the real one is
:class:`orbit_sync.SystemClock`): time moves only when told to, by :meth:`ManualClock.advance`,
by ``MockOrbitServer.advance()`` (which steps it through every due moment: lease expiry,
recovery scans, backoff) or, with ``follow=``, by freezegun's frozen time. One object serves the
mock server, a connection and a worker, so a test moves all their times at once.

The mock server speaks POSIX time on the wire; :class:`ServerTime` reads it from the server's
clock: a ``ManualClock``'s readings as they are (POSIX seconds, from ``start``), any other clock
anchored once to the wall clock (so NTP steps cannot move server time backwards), with
``server.advance()`` then adding an offset.

The deprecated forms of this module's old names (``FakeClock``, ``SystemClock`` with
``advance``) live here too, reachable through ``orbit_sync.testing`` with a DeprecationWarning.
"""

from __future__ import annotations

import calendar
import collections
import datetime as _dt
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._realtime import monotonic, wall
from .._seconds import seconds as check_seconds
from ..clock import Clock, SystemClock

if TYPE_CHECKING:
    from freezegun.api import FrozenDateTimeFactory

__all__ = ["DEFAULT_START", "ManualClock", "ServerTime", "moves_by_itself"]

#: Where a :class:`ManualClock` starts unless told otherwise: a fixed, readable instant.
DEFAULT_START = _dt.datetime(2026, 1, 1, tzinfo=_dt.timezone.utc)


class ManualClock:
    """A clock that moves only when :meth:`advance` is called: the :class:`orbit_sync.Clock`
    for tests.

    Its readings are POSIX seconds from *start* (an aware datetime, or seconds: ``0.0`` for a
    clock counting from zero; 2026-01-01T00:00:00Z when left out). Pass the same object to
    ``MockOrbitServer(clock=...)``, ``dial_worker(clock=...)`` and ``Worker(clock=...)``: every
    timed wait on it re-checks its deadline after each move, and listeners (the mock server
    subscribes one) are called after each move, so time advanced directly on the clock still runs
    the server's due work, on the server's scheduler thread.

    With *follow* (what freezegun's ``freeze_time()`` returns), the clock starts at the frozen
    time and moves with it: each ``tick()`` or ``move_to()`` of that object advances this clock
    too, waking its timed waits and running the server's due work. freezegun alone changes what
    ``time.time()`` and ``time.monotonic()`` return, but cannot end a wait already sleeping
    towards a deadline; this is the bridge.
    """

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
        if not math.isfinite(start):
            raise ValueError("start must be a finite number of seconds")
        self._lock = threading.Lock()
        self._now = float(start)
        self._listeners: list[Callable[[], None]] = []
        #: Conditions someone waits on with a deadline, with how many waiters each.
        self._waiting: dict[threading.Condition, int] = {}
        #: Threads in a timed wait on this clock (notified on every change).
        self._sleepers: collections.Counter[str] = collections.Counter()
        self._sleep_change = threading.Condition(self._lock)
        #: Notified by unpark(), so that parked threads re-check their locks.
        self._park_change = threading.Condition()
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
        """The current manual time (POSIX seconds)."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move forward by *seconds*, notify listeners and wake every timed waiter to re-check
        its deadline."""
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

    # ------------------------------------------------------------------ timed waits

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

    def __repr__(self) -> str:
        when = _dt.datetime.fromtimestamp(self.now(), tz=_dt.timezone.utc)
        return f"ManualClock({when.isoformat()})"


class ServerTime:
    """The mock server's time in POSIX seconds, read from its :class:`orbit_sync.Clock`.

    A clock with an ``advance`` of its own (a :class:`ManualClock`, or a deprecated server clock)
    is read as POSIX seconds, and :meth:`advance` moves it; any other clock
    (:class:`orbit_sync.SystemClock` by default) is read from the wall-clock time at creation
    on, and :meth:`advance` adds an offset.
    """

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        own = getattr(clock, "advance", None)
        self._advance: Callable[[float], None] | None = own if callable(own) else None
        self._lock = threading.Lock()
        self._offset = 0.0 if self._advance is not None else wall() - clock.now()

    def now(self) -> float:
        """Server time, POSIX seconds."""
        # One attribute read is atomic; the lock only serializes advance()'s read-modify-write.
        return self.clock.now() + self._offset

    def advance(self, seconds: float) -> None:
        """Move server time forward by *seconds*."""
        step = check_seconds(seconds, "seconds")
        if self._advance is not None:
            self._advance(step)
            return
        with self._lock:
            self._offset += step


def moves_by_itself(clock: object) -> bool:
    """Whether *clock*'s time passes without anyone moving it (the mock server then wakes on its
    own for due work): all but a :class:`ManualClock`, unless the clock says otherwise with a
    ``real_time`` attribute (as the deprecated server clocks do)."""
    return bool(getattr(clock, "real_time", not isinstance(clock, ManualClock)))


# ---------------------------------------------------------------------- deprecated forms


class FakeClock(ManualClock):
    """Deprecated: ``ManualClock(0.0)`` (or ``ManualClock(start)``); instead of following the
    server's ``ManualClock``, pass that clock itself. Counts from *start* (default 0); with
    *follow*, reads that clock minus where it stood at creation and cannot be advanced itself."""

    #: What the deprecation warning of the old name says to use.
    INSTEAD = (
        "use orbit_sync.testing.ManualClock (ManualClock(0.0) counts from zero; pass the server's "
        "ManualClock itself instead of following it)"
    )

    def __init__(self, start: float = 0.0, *, follow: ManualClock | None = None) -> None:
        if isinstance(start, bool) or not isinstance(start, int | float):
            raise TypeError("start must be a number of seconds")
        super().__init__(start)
        self._followed = follow
        self._origin = 0.0 if follow is None else follow.now() - float(start)
        if follow is not None:
            follow.subscribe(self._wake_all)

    def now(self) -> float:
        """The fake time."""
        if self._followed is not None:
            return self._followed.now() - self._origin
        return super().now()

    def advance(self, seconds: float) -> None:
        """Move forward by *seconds* (not while following another clock)."""
        check_seconds(seconds, "seconds")
        if self._followed is not None:
            raise RuntimeError("this clock follows another: advance that one")
        super().advance(seconds)

    def __repr__(self) -> str:
        return f"FakeClock(now={self.now():.3f})"


class AdvancingSystemClock(SystemClock):
    """Deprecated (the old ``orbit_sync.testing.SystemClock``): real time in POSIX seconds,
    anchored once to the wall clock, plus an offset that :meth:`advance` grows. Use
    :class:`orbit_sync.SystemClock`, and ``server.advance()`` to move a real-time server."""

    #: What the deprecation warning of the old name says to use.
    INSTEAD = "use orbit_sync.SystemClock, and server.advance() to move a real-time server"

    real_time = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = wall() - monotonic()
        self._offset = 0.0

    def now(self) -> float:
        """Wall time at creation plus monotonic progress plus the advanced offset."""
        return monotonic() + self._epoch + self._offset

    def advance(self, seconds: float) -> None:
        """Jump forward by *seconds*."""
        step = check_seconds(seconds, "seconds")
        with self._lock:
            self._offset += step

    def __repr__(self) -> str:
        return f"SystemClock(offset={self._offset:.3f})"


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
