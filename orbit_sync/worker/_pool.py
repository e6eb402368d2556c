"""A bounded pool of daemon threads that grows on demand and shrinks when idle.

``concurrent.futures.ThreadPoolExecutor`` joins its (non-daemon) threads at interpreter exit, so
one handler that ignores cancellation would keep the process alive forever. These threads are
daemons: after a bounded shutdown the process can always exit. A thread left without work for
*idle_timeout* seconds exits, so one burst of ``capacity`` assignments does not leave ``capacity``
threads behind for the life of the process.
"""

from __future__ import annotations

import itertools
import logging
import queue
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
        # Jobs go through a SimpleQueue: handing one to an idle thread is a C-level wake-up,
        # not a notify under a lock that the woken thread must then take (that hand-off was
        # over a third of the reader thread's time at full load). None tells a thread to exit.
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._cond = threading.Condition(threading.Lock())
        self._threads: set[threading.Thread] = set()
        #: Threads waiting for a job minus jobs queued: negative means jobs wait for a thread.
        self._idle = 0
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Run *job* on a pool thread (queued while all threads are busy). Never blocks."""
        thread = None
        with self._cond:
            if self._closed:
                raise RuntimeError("pool is shut down")
            self._idle -= 1
            if self._idle < 0 and len(self._threads) < self._size:
                self._idle += 1  # the new thread waits for this job from its start
                thread = threading.Thread(
                    target=self._main, name=f"{self._name}-{next(_names)}", daemon=True
                )
                self._threads.add(thread)
        self._clock.put(self._jobs, job)
        if thread is not None:
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
            if not self._closed:
                self._closed = True
                for _ in self._threads:  # behind the jobs already queued: those still run
                    self._clock.put(self._jobs, None)
            while len(self._threads) > stuck and self._clock.now() < deadline:
                self._clock.wait(self._cond, deadline)
            return sorted(t.name for t in self._threads)

    def _main(self) -> None:
        waiting = True  # counted in _idle by the submit() that started this thread
        while True:
            if not waiting:
                with self._cond:
                    self._idle += 1
            job = self._next_job()
            if job is None:
                with self._cond:
                    self._threads.discard(threading.current_thread())
                    self._cond.notify_all()  # shutdown() waits for the pool to empty
                return
            waiting = False
            try:
                job()
            except BaseException:  # a job's bug must not shrink the pool
                _LOG.exception("worker pool job failed")

    def _next_job(self) -> Callable[[], None] | None:
        """The next job, or None when this thread should exit (shut down, or idle too long)."""
        while True:
            try:
                return self._clock.take(self._jobs, self._clock.now() + self._idle_timeout)
            except queue.Empty:
                with self._cond:
                    # Leave only if every queued job still has a waiting thread without this one;
                    # otherwise a job was queued for this thread just as its wait ended.
                    if self._idle > 0:
                        self._idle -= 1
                        return None
