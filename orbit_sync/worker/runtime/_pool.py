"""The handler threads: daemon threads that take the connection's assignments and run each
attempt on themselves, started on demand and retired when idle (why not
``concurrent.futures.ThreadPoolExecutor``: docs/architecture.md, the design card's table).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable

from ..._realtime import monotonic
from ...connection import ASSIGNMENT_BUFFER
from ...errors import OrbitError
from ...models import Assignment
from ._link import Connection, Intake
from ._requests import waiting_thread

__all__ = ["EXTRA", "HandlerThreads", "batch_scheduling"]

_LOG = logging.getLogger("orbit_sync.worker")
_names = itertools.count(1)

#: Handler threads beyond the capacity (see HandlerThreads): as many as the connection's queue
#: holds.
EXTRA = ASSIGNMENT_BUFFER

#: How long an idle handler thread (not the last) waits for an assignment before it exits.
IDLE_TIMEOUT = 30.0


def batch_scheduling() -> None:
    """Move the calling thread from the normal policy to Linux's ``SCHED_BATCH``
    (``Worker(batch_scheduling=True)``): a woken thread of the normal policy preempts the reader
    only to wait for the GIL it holds (docs/architecture.md, "Scheduling policy"). A real-time
    thread is left as it is; a refusal changes nothing."""
    batch: int | None = getattr(os, "SCHED_BATCH", None)
    normal: int | None = getattr(os, "SCHED_OTHER", None)
    if batch is None or normal is None or os.sched_getscheduler(0) != normal:
        return
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, batch, os.sched_param(0))


class HandlerThreads:
    """Each thread takes the next assignment from *intake* (the newest connection) and runs its
    attempt to the end with *run*; at most *size* handlers run at once (:attr:`running`). Threads
    start on demand: one more as the last idle one takes an assignment, up to *size*, and up to
    :data:`EXTRA` more when a thread is about to wait holding its attempt (:meth:`ensure_taker`);
    an idle one beyond the last retires after *idle_timeout* real seconds.

    Why beyond *size*: after a cut the server may assign in place of an attempt whose lease it
    ended before this worker learned it; the thread still holding that one must not keep the new
    assignment (nor the next session's resumes) waiting.
    """

    def __init__(
        self,
        size: int,
        intake: Intake,
        run: Callable[[Connection, Assignment], None],
        *,
        idle_timeout: float = IDLE_TIMEOUT,
        batch: bool = False,
    ) -> None:
        self._capacity = size
        self._size = size + EXTRA
        self.running = threading.BoundedSemaphore(size)
        self._intake = intake
        self._run = run
        self._idle_timeout = idle_timeout
        self._batch = batch
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._threads: set[threading.Thread] = set()
        self._idle = 0
        self._closed = False

    def start(self) -> None:
        """Start the first thread (it waits for the first connection)."""
        with self._lock:
            self._spawn(self._capacity)

    def _spawn(self, limit: int) -> None:
        """(Lock held) Start a thread to wait on the queue, unless one does or *limit* exist."""
        if self._idle or len(self._threads) >= limit or self._closed:
            return
        thread = threading.Thread(
            target=self._main, name=f"orbit-handler-{next(_names)}", daemon=True
        )
        self._threads.add(thread)
        self._idle += 1
        thread.start()

    def ensure_taker(self) -> None:
        """The calling thread is about to wait holding its attempt: another takes the queue."""
        with self._lock:
            self._spawn(self._size)

    def owns_current_thread(self) -> bool:
        """True when called from one of the handler threads."""
        current = threading.current_thread()
        with self._lock:
            return current in self._threads

    def thread_count(self) -> int:
        """Handler threads alive right now (busy or idle)."""
        with self._lock:
            return len(self._threads)

    def shutdown(self, timeout: float, *, stuck: int = 0) -> list[str]:
        """Take no more assignments; wait until at most *stuck* threads are left (handlers known
        to ignore cancellation) or *timeout* real seconds pass. Return the names still running."""
        deadline = monotonic() + timeout
        self._intake.close()
        with self._lock:
            self._closed = True
            while len(self._threads) > stuck:
                remaining = deadline - monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return sorted(t.name for t in self._threads)

    def _main(self) -> None:
        waiting_thread()  # it makes its attempts' calls and waits for their answers
        if self._batch:  # asked for: the reader wakes it for each assignment
            batch_scheduling()
        exhausted: Connection | None = None
        try:
            while True:
                conn = self._intake.next(after=exhausted)
                if conn is None:
                    return  # shut down
                try:
                    assignment = conn.next_assignment(self._idle_timeout, after_end=True)
                except OrbitError:  # ended, and nothing it received is left
                    exhausted = conn
                    continue
                except TimeoutError:
                    if conn.done.is_set():
                        exhausted = conn
                        continue
                    with self._lock:
                        if self._idle > 1 or self._closed:  # another one is waiting: retire
                            return
                    continue
                with self._lock:
                    self._idle -= 1
                    self._spawn(self._capacity)  # the next assignment finds a thread waiting
                try:
                    self._run(conn, assignment)
                except BaseException:  # a bug of ours must not shrink the pool
                    _LOG.exception("worker error in a handler thread")
                finally:
                    with self._lock:
                        self._idle += 1
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
                self._idle -= 1
                self._cond.notify_all()  # shutdown() waits for the threads to end
