"""A bounded pool of daemon threads that grows on demand and shrinks when idle.

``concurrent.futures.ThreadPoolExecutor`` joins its (non-daemon) threads at interpreter exit, so
one handler that ignores cancellation would keep the process alive forever. These threads are
daemons: after a bounded shutdown the process can always exit. A thread left without work for
*idle_timeout* seconds exits, so one burst of ``capacity`` assignments does not leave ``capacity``
threads behind for the life of the process.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable

from ._clock import WorkerClock

__all__ = ["DaemonPool"]

_LOG = logging.getLogger("orbit_sync.worker")
_names = itertools.count(1)

#: How long a pool thread waits for work before it exits.
IDLE_TIMEOUT = 30.0


class DaemonPool:
    """Runs submitted callables on at most *size* daemon threads, started on demand."""

    def __init__(
        self,
        size: int,
        *,
        name: str = "orbit-handler",
        idle_timeout: float = IDLE_TIMEOUT,
        clock: WorkerClock | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        if not idle_timeout > 0:
            raise ValueError("idle_timeout must be positive")
        self._size = size
        self._name = name
        self._idle_timeout = idle_timeout
        self._clock = clock or WorkerClock()
        self._cond = threading.Condition(threading.Lock())
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._threads: set[threading.Thread] = set()
        #: Threads waiting for a job (notified ones included until they run again).
        self._waiting = 0
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Run *job* on a pool thread (queued while all threads are busy). Never blocks."""
        with self._cond:
            if self._closed:
                raise RuntimeError("pool is shut down")
            self._jobs.append(job)
            if len(self._jobs) <= self._waiting:
                self._cond.notify()
                return
            if len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._main, name=f"{self._name}-{next(_names)}", daemon=True
                )
                self._threads.add(thread)
                thread.start()

    def owns_current_thread(self) -> bool:
        """True when called from one of this pool's threads."""
        current = threading.current_thread()
        with self._cond:
            return current in self._threads

    def thread_count(self) -> int:
        """Threads alive in the pool right now (busy or idle)."""
        with self._cond:
            return len(self._threads)

    def shutdown(self, deadline: float, *, stuck: int = 0) -> list[str]:
        """Refuse new jobs and let every thread exit once its job is done; wait until at most
        *stuck* threads are left (handlers known to ignore cancellation, never waited for) or
        until *deadline* (clock time). Return the names of the threads still running."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while len(self._threads) > stuck and self._clock.now() < deadline:
                self._clock.wait(self._cond, deadline)
            return sorted(t.name for t in self._threads)

    def _main(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                idle_until = self._clock.now() + self._idle_timeout
                while not self._jobs:
                    if self._closed or self._clock.now() >= idle_until:
                        self._threads.discard(me)
                        self._cond.notify_all()  # shutdown() waits for the pool to empty
                        return
                    self._waiting += 1
                    try:
                        self._clock.wait(self._cond, idle_until)
                    finally:
                        self._waiting -= 1
                job = self._jobs.popleft()
            try:
                job()
            except BaseException:  # a job's bug must not shrink the pool
                _LOG.exception("worker pool job failed")
