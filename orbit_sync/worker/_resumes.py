"""The resumes of a new connection, as its connection thread waits for them.

When the session opens a connection it steps every held attempt's machine with ``reconnected``
(:mod:`._machine`); each machine that holds a lease sends a resume through the one request path
(:mod:`._requests`). :class:`Resumes` is what the connection thread needs to know of them: when
every one has gone out (the connection may be published: the kept starts and finishes, the
renewals due and the first capacity report follow them on the wire) and when every one is over
(the session counts as established, unless one of them was cut: its connection failed before
its answer). It decides nothing: what an answer, a refusal or a failure
means is the machine's; the in-flight count is the gate's.

The outcomes of resumes (answers and failures arrive on the connection's reader) are queued here and
stepped by the connection thread (:meth:`Resumes.take`): what a lost lease does (listeners, log
lines, counters) then runs on that thread, never on the reader, and never behind a handler holding a
pool thread.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from ._machine import Request
from ._requests import Event

__all__ = ["Resumes"]

T = TypeVar("T")


class Resumes(Generic[T]):
    """The current connection's resumes (see the module's docstring); thread-safe."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        #: Wakes the connection thread (an outcome is queued, or a resume went out).
        self._wake = wake
        self._unsent: set[Request] = set()
        self._open: set[Request] = set()
        #: Did a resume of the connection end unanswered, its connection failed (see cut())?
        self._cut = False
        self._events: collections.deque[tuple[T, Event]] = collections.deque()

    def begin(self) -> None:
        """A new connection: forget the older one's resumes (a late outcome of one of them is
        still stepped; its machine ignores it)."""
        with self._lock:
            self._unsent.clear()
            self._open.clear()
            self._cut = False

    def add(self, request: Request) -> None:
        """*request*, a resume, is about to be sent (or re-sent after a transient answer)."""
        with self._lock:
            self._unsent.add(request)
            self._open.add(request)

    def sent(self, request: Request) -> None:
        """*request* went out, or was refused before the wire."""
        with self._lock:
            self._unsent.discard(request)
            last = not self._unsent
        if last:
            self._wake()

    def ended(self, request: Request, *, cut: bool = False) -> None:
        """*request* is over (its machine said so); *cut*: its connection failed before it was
        answered."""
        with self._lock:
            # An older connection's resume says nothing of this one.
            self._cut |= cut and request in self._open
            # Answered means it was on the wire, even if its sender has not said so yet.
            self._unsent.discard(request)
            self._open.discard(request)

    def all_sent(self) -> bool:
        """Has every resume of the connection gone out (or ended)?"""
        with self._lock:
            return not self._unsent

    def all_over(self) -> bool:
        """Is every resume of the connection over?"""
        with self._lock:
            return not self._open

    def cut(self) -> bool:
        """Did a resume of the connection end unanswered, its connection failed? Then the
        session is not established, however the others ended."""
        with self._lock:
            return self._cut

    def deliver(self, subject: T, event: Event) -> None:
        """Queue *event*, a resume's outcome, for the connection thread (any thread)."""
        self._events.append((subject, event))
        self._wake()

    def take(self) -> list[tuple[T, Event]]:
        """The queued outcomes, in arrival order (the connection thread steps them)."""
        taken: list[tuple[T, Event]] = []
        while self._events:
            taken.append(self._events.popleft())
        return taken
