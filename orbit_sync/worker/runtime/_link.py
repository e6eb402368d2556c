"""The worker's current connection, shared by its threads: *opened* for the resumes only,
*published* for every request once they went out (:class:`Resumes`), *retracted* when it breaks.
A failed start or finish waits in its thread for a newer connection or its retry delay
(:meth:`Link.wait_for`) and is re-sent with its ``message_id`` (PROTOCOL §7); a resume answered
with a transient error is *kept* (:meth:`Link.keep`) for the connection thread. Closing the link
ends every such wait (how shutdown is bounded). :class:`Intake`: whose assignments are taken.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Hashable
from typing import Any, Protocol, TypeAlias

from ..._realtime import monotonic
from ...clock import Clock, SystemClock
from ...connection import WorkerConnection
from ...models import CancelNotice, Registration

__all__ = ["Connection", "Dialer", "Gate", "GaveUp", "Intake", "Link", "Resumes", "Wakeup"]

#: The worker's connection (what :meth:`Dialer.dial_worker` returns).
Connection: TypeAlias = WorkerConnection


class Dialer(Protocol):
    """What the worker uses of :class:`orbit_sync.client.Client`."""

    def dial_worker(
        self,
        registration: Registration,
        timeout: float = ...,
        *,
        on_cancel: Callable[[CancelNotice], None] | None = ...,
    ) -> Any: ...


class GaveUp(Exception):
    """The link was closed for good while waiting for a connection: shutdown is over."""


class Gate:
    """A counting semaphore for the attempts' requests (starts, finishes, resumes), so renewals and
    capacity reports always find a request slot free. Once closed, none is taken (:class:`GaveUp`):
    nothing waits past shutdown."""

    def __init__(self, slots: int) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._free = slots
        self._closed = False

    def acquire(self, most: int = 1, *, wait: bool = True) -> int:
        """Take 1 to *most* slots (not *wait*: maybe 0), waiting for one; GaveUp once closed."""
        with self._cond:
            while wait and not self._closed and self._free <= 0:
                self._cond.wait()
            if self._closed:
                raise GaveUp("worker stopped")
            taken = max(0, min(most, self._free))
            self._free -= taken
            return taken

    def release(self, count: int = 1) -> None:
        """Give *count* slots back."""
        with self._cond:
            self._free += count
            self._cond.notify(count)

    def close(self) -> None:
        """Refuse new requests and wake every waiter (calls in flight end by their deadline)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Intake:
    """The connection whose assignments the handler threads take (the newest), and how many of
    them they recorded (the connection thread waits for all). Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._conn: Connection | None = None
        self._recorded = 0
        self._closed = False

    def offer(self, conn: Connection) -> None:
        """From now on the threads take *conn*'s assignments (the connection thread)."""
        with self._cond:
            self._conn, self._recorded = conn, 0
            self._cond.notify_all()

    def next(self, after: Connection | None) -> Connection | None:
        """The newest connection once it is not *after* (taken to the end); ``None`` once closed."""
        with self._cond:
            while not self._closed and (self._conn is None or self._conn is after):
                self._cond.wait()
            return None if self._closed else self._conn

    def recorded(self, conn: Connection) -> None:
        """A handler thread recorded one of *conn*'s assignments as an attempt (or refused it)."""
        with self._cond:
            if conn is self._conn:
                self._recorded += 1
                self._cond.notify_all()

    def all_recorded(self, conn: Connection) -> bool:
        """Has every assignment *conn* received so far been recorded?"""
        with self._cond:
            return conn is self._conn and self._recorded >= conn.assignments_received

    def wait_recorded(self, conn: Connection, timeout: float) -> bool:
        """Wait (real time) until :meth:`all_recorded`, at most *timeout* seconds."""
        deadline = monotonic() + timeout
        with self._cond:
            while not self._closed and conn is self._conn:
                if self._recorded >= conn.assignments_received:
                    return True
                left = deadline - monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return False

    def close(self) -> None:
        """No more assignments are taken: release every waiting thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Link:
    """The current connection and its generation, and the gate bounding the requests on it."""

    def __init__(self, clock: Clock | None = None, *, slots: int = 24) -> None:
        self._clock = clock or SystemClock()
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._conn: Connection | None = None
        self._gen = 0
        #: May every request use ``_conn`` (or only the early ones: see :meth:`open`)?
        self._published = False
        self._closed = False
        #: Kept requests: (not before, tie-breaker, newer than generation, early, job).
        self._kept: list[tuple[float, int, int, bool, Callable[[], None]]] = []
        self._order = itertools.count()
        self._on_close: list[Callable[[], None]] = []
        self.gate = Gate(slots)

    def is_closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def open(self, conn: Connection) -> int:
        """Make *conn* newest, for *early* requests until :meth:`publish`; return its generation."""
        with self._lock:
            self._gen += 1
            self._conn, self._published = conn, False
            self._cond.notify_all()
            return self._gen

    def publish(self, conn: Connection) -> int:
        """Make *conn* current for every request; return its generation (:meth:`open`'s, if any)."""
        with self._lock:
            if conn is not self._conn:
                self.open(conn)
            self._published = True
            self._cond.notify_all()
            return self._gen

    def retract(self, gen: int) -> None:
        """Connection *gen* is gone."""
        with self._lock:
            if self._gen == gen:
                self._conn, self._published = None, False
            self._cond.notify_all()

    def close(self) -> list[Callable[[], None]]:
        """No connection will come: wake every waiter; return the kept jobs (each then gives up)."""
        with self._lock:
            self._closed, self._conn = True, None
            kept, self._kept = self._kept, []
            callbacks, self._on_close = self._on_close, []
            self._cond.notify_all()
        self.gate.close()
        for callback in callbacks:
            callback()
        return [k[4] for k in sorted(kept)]

    def on_close(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call quick *callback* once the link is closed (at once if it is); return unsubscribe."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._on_close.append(callback)
        if closed:
            callback()

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._on_close:
                    self._on_close.remove(callback)

        return unsubscribe

    def keep(
        self,
        job: Callable[[], None],
        *,
        newer_than: int = 0,
        delay: float = 0.0,
        early: bool = False,
    ) -> bool:
        """Keep *job* (a re-send) for the connection thread until a connection newer than
        *newer_than* is current (*early*: or opened) and *delay* has passed; False once closed."""
        with self._lock:
            if self._closed:
                return False
            not_before = self._clock.now() + delay if delay > 0 else 0.0
            self._kept.append((not_before, next(self._order), newer_than, early, job))
            return True

    def wait_for(self, *, newer_than: int = 0, delay: float = 0.0) -> bool:
        """Wait until a published connection newer than *newer_than* is current and *delay* (link
        clock) has passed: True to re-send; False once the link is closed."""
        with self._lock:
            until = self._clock.now() + delay if delay > 0 else 0.0
            while not self._closed:
                ready = self._conn is not None and self._published and self._gen > newer_than
                now = self._clock.now()
                if ready and now >= until:
                    return True
                self._clock.wait(self._cond, until if ready else None)
            return False

    def take_due(self) -> tuple[list[Callable[[], None]], float]:
        """The kept jobs due now (in order kept), and when the next is (``inf``: not yet known)."""
        with self._lock:
            if self._conn is None or self._closed or not self._kept:
                return [], math.inf
            now = self._clock.now()
            ready = [k for k in self._kept if self._gen > k[2] and (self._published or k[3])]
            due = [k for k in ready if k[0] <= now]
            if due:  # each entry is unique (its tie-breaker)
                self._kept = [k for k in self._kept if k not in due]
            next_at = min((k[0] for k in ready if k[0] > now), default=math.inf)
        return [k[4] for k in sorted(due)], next_at

    def current(self, *, early: bool = False) -> tuple[Connection, int] | None:
        """The current (published; *early*: or opened) connection, without waiting."""
        with self._lock:
            if self._conn is None or self._closed or not (self._published or early):
                return None
            return self._conn, self._gen

    def broken(self, gen: int) -> None:
        """A request left connection *gen* unusable: close it (the connection thread reconnects)."""
        with self._lock:
            conn = self._conn if self._gen == gen else None
        if conn is not None:
            conn.close()

    def pause(self, seconds: float) -> None:
        """Sleep *seconds* (link clock), waking early if the link is closed."""
        with self._lock:
            until = self._clock.now() + seconds
            while not self._closed and self._clock.now() < until:
                self._clock.wait(self._cond, until)


class Resumes:
    """The newest connection's resumes: all sent (publish), all over, or one *cut*. Thread-safe."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._wake = wake
        self._unsent: set[Hashable] = set()
        self._open: set[Hashable] = set()
        self._cut = False

    def begin(self) -> None:
        """A new connection: forget the older one's resumes (machines ignore late outcomes)."""
        with self._lock:
            self._unsent.clear()
            self._open.clear()
            self._cut = False

    def add(self, request: Hashable) -> None:
        """The resume *request* is about to be (re-)sent."""
        with self._lock:
            self._unsent.add(request)
            self._open.add(request)

    def sent(self, request: Hashable) -> None:
        """*request* went out, or was refused before the wire."""
        with self._lock:
            self._unsent.discard(request)
            last = not self._unsent
        if last:
            self._wake()

    def ended(self, request: Hashable, *, cut: bool = False) -> None:
        """*request* is over; *cut*: its connection failed before it was answered."""
        with self._lock:
            # An older connection's resume says nothing of this one.
            self._cut |= cut and request in self._open
            # Answered means it was on the wire, even if its sender has not said so yet.
            self._unsent.discard(request)
            self._open.discard(request)

    def all_sent(self) -> bool:
        with self._lock:
            return not self._unsent

    def all_over(self) -> bool:
        with self._lock:
            return not self._open

    def cut(self) -> bool:
        with self._lock:
            return self._cut


class Wakeup:
    """An ``Event`` whose timed :meth:`wait` runs on a :class:`~orbit_sync.Clock` (a test's
    ``ManualClock`` ends it by moving past its deadline)."""

    __slots__ = ("_clock", "_cond", "_flag")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._flag = False

    def set(self) -> None:
        with self._cond:
            self._flag = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the flag is set or *timeout* (clock seconds) passes; return the flag."""
        deadline = None if timeout is None else self._clock.now() + max(0.0, timeout)
        with self._cond:
            while not self._flag:
                if deadline is not None and self._clock.now() >= deadline:
                    return False
                self._clock.wait(self._cond, deadline)
            return True
