"""Who reads a connection's socket: its reader thread, or a caller waiting for what comes next.

On a connection without push callbacks no user code runs when a frame arrives, so a caller that
blocks on an answer (or on the next assignment) can read the socket itself: the frame that ends its
wait is then handled on its own thread, with no hand-off from the reader thread in between (two
thread wake-ups, the larger part of a call's cost on a small machine). :class:`ReadTurn` decides,
under one condition, who holds the right to read:

* a **caller** takes the turn when it is free (after the one message the reader may be reading),
  reads and handles every frame, in order, until its own wait is over, then gives it back;
* a caller that finds another caller holding the turn **follows**: it waits the usual way for what
  the holder (or, after it, the reader) reads;
* the **reader thread** reads whenever no caller does. Right after a caller gave the turn back it
  stays off the socket for :data:`LINGER` seconds, so back-to-back calls do not wake it once per
  answer, unless somebody still awaits something (a follower, a call in flight): then it reads at
  once. Bytes arriving meanwhile wait at most that long.

Pure bookkeeping: the socket is reached through the ``has_input`` callable only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Final

__all__ = ["LINGER", "ReadTurn", "Step", "Take"]

#: How long the reader stays off the socket after a caller gave the turn back (seconds).
LINGER: Final = 0.01


class Take(Enum):
    """What a caller got from :meth:`ReadTurn.take`."""

    TAKEN = "taken"  # read until the wait is over, then release()
    FOLLOW = "follow"  # another caller reads: wait the usual way, then unfollow()
    NO = "no"  # the connection has ended or the deadline passed: wait the usual way


class Step(Enum):
    """What the reader thread does next (:meth:`ReadTurn.reader_next`)."""

    READ = "read"  # read and handle one message, then reader_done()
    WAIT = "wait"  # block until the socket is readable, then ask again
    EXIT = "exit"


_READER: Final = "reader"
_CALLER: Final = "caller"
_GONE: Final = "gone"


class ReadTurn:
    """The read turn of one connection (see the module docstring)."""

    def __init__(
        self,
        has_input: Callable[[], bool],
        ended: Callable[[], bool],
        *,
        clock: Callable[[], float] = time.monotonic,
        linger: float = LINGER,
    ) -> None:
        self._has_input = has_input
        self._ended = ended
        self._clock = clock
        self._linger = linger
        self._cond = threading.Condition(threading.Lock())
        self._holder: str | None = None
        self._wanted = 0  # callers waiting for the reader to finish its message
        self._followers = 0  # callers waiting for what another caller reads
        self._parked = False  # the reader sleeps on the condition (not on the socket)
        self._resume = False  # somebody awaits a frame: the reader must not linger
        self._closing = False  # the reader is exiting once no caller reads
        self._last_release = -float("inf")

    # ------------------------------------------------------------------ callers

    def take(self, deadline: float | None) -> Take:
        """Try to take the turn; waits only while the reader finishes one message."""
        with self._cond:
            while True:
                if self._holder is _GONE or self._ended():
                    return Take.NO
                if self._holder is None:
                    self._holder = _CALLER
                    return Take.TAKEN
                if self._holder is _CALLER:
                    self._followers += 1
                    return Take.FOLLOW
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    return Take.NO
                self._wanted += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._wanted -= 1

    def release(self, pending: bool) -> None:
        """Give the turn back. *pending*: calls are still in flight, so the reader reads now."""
        with self._cond:
            self._holder = None
            self._last_release = self._clock()
            if pending or self._followers:
                self._resume = True
            if self._wanted or self._closing or (self._resume and self._parked):
                self._cond.notify_all()

    def unfollow(self) -> None:
        """A follower's wait is over."""
        with self._cond:
            self._followers -= 1

    def wake(self) -> None:
        """The connection ended: the reader stops lingering and exits."""
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the reader thread

    def reader_next(self) -> Step:
        """The reader's next step; sleeps while a caller reads or the reader lingers."""
        with self._cond:
            while True:
                if self._ended():
                    return Step.EXIT
                if self._holder is None:
                    if self._has_input():
                        self._holder = _READER
                        return Step.READ
                    if self._resume:
                        self._resume = False
                        return Step.WAIT
                    left = self._last_release + self._linger - self._clock()
                    if left <= 0:
                        return Step.WAIT
                else:
                    left = self._linger  # a caller reads; look again later (or when told)
                self._parked = True
                try:
                    self._cond.wait(left)
                finally:
                    self._parked = False

    def reader_done(self) -> None:
        """The reader handled its message."""
        with self._cond:
            self._holder = None
            if self._wanted:
                self._cond.notify_all()

    def close(self) -> None:
        """The reader is exiting: wait until no caller reads, then nobody ever reads again."""
        with self._cond:
            self._closing = True
            while self._holder is _CALLER:
                self._cond.wait()
            self._holder = _GONE
            self._cond.notify_all()
