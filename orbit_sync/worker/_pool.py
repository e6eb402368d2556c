"""A bounded pool of daemon threads that grows on demand and retires its threads when idle (why
not ``concurrent.futures.ThreadPoolExecutor``: docs/architecture.md, the design card's table).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable

from .._realtime import monotonic
from ..clock import Clock, SystemClock

__all__ = ["BatchPolicy", "DaemonPool"]

_LOG = logging.getLogger("orbit_sync.worker")
_names = itertools.count(1)

#: How long a pool thread waits for work before it exits.
IDLE_TIMEOUT = 30.0


class BatchPolicy:
    """Linux's ``SCHED_BATCH`` (same priority) for a thread the connection's reader wakes, so
    that the wake-up does not preempt the reader while it still holds the GIL
    (docs/architecture.md, "Scheduling policy"). Always when the user asked for it (*forced*:
    ``Worker(batch_scheduling=True)``, the handler threads and the intake); otherwise only for
    the worker's own intake, and only while it runs none of the user's code (*has_listener*: an
    ``attempt_received`` listener, which runs there, is subscribed). Checked before each piece
    of work (:meth:`check`): a listener subscribed later gets the thread back under the policy
    it started with. Only a thread of the normal policy is ever moved (a real-time one is left
    as it is), and only on Linux; a refusal changes nothing."""

    def __init__(self, has_listener: Callable[[], bool] = lambda: True, *, forced: bool) -> None:
        self._has_listener = has_listener
        self._forced = forced
        batch: int | None = getattr(os, "SCHED_BATCH", None)
        normal: int | None = getattr(os, "SCHED_OTHER", None)
        #: The two policies it moves between (normal, batch), or None where it moves nothing.
        self._policies: tuple[int, int] | None = None
        if batch is not None and normal is not None and os.sched_getscheduler(0) == normal:
            self._policies = (normal, batch)
        self._batched = False

    def check(self) -> None:
        """Move the calling thread to the policy it should have now (a syscall only on a change)."""
        if self._policies is None:
            return
        want = self._forced or not self._has_listener()
        if want is not self._batched:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, self._policies[want], os.sched_param(0))
                self._batched = want


class _Parked:
    """An idle thread's parking place: the lock it sleeps on and the job handed to it."""

    __slots__ = ("job", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()  # held while parked; a release hands over self.job
        self.job: Callable[[], None] | None = None


class DaemonPool:
    """Runs submitted callables on at most *size* daemon threads, started on demand."""

    def __init__(
        self,
        size: int,
        *,
        name: str = "orbit-handler",
        idle_timeout: float = IDLE_TIMEOUT,
        clock: Clock | None = None,
        batch: bool = False,
    ) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        if not idle_timeout > 0:
            raise ValueError("idle_timeout must be positive")
        self._size = size
        #: Put each thread under SCHED_BATCH (see BatchPolicy).
        self._batch = batch
        self._name = name
        self._idle_timeout = idle_timeout
        self._clock = clock or SystemClock()
        # Entered as its lock (C), not as the condition, whose __enter__ is Python code.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        #: Jobs waiting for a thread (only while every thread is busy).
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        # Idle threads, the most recently parked last. A job is handed straight to one of them
        # by releasing its own lock: a C-level wake-up, not a notify under the pool's lock that
        # the woken thread must then take (that hand-off was over a third of the reader
        # thread's time at full load). Taking the newest keeps the same few threads busy, so
        # the others reach the idle timeout and retire.
        self._parked: list[_Parked] = []
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Run *job* on a pool thread (queued while all threads are busy). Never blocks."""
        with self._lock:
            if self._closed:
                raise RuntimeError("pool is shut down")
            if self._parked:
                parked = self._parked.pop()
                parked.job = job
                self._clock.unpark(parked.lock)
                return
            self._jobs.append(job)
            if len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._main, name=f"{self._name}-{next(_names)}", daemon=True
                )
                self._threads.add(thread)
                thread.start()

    def owns_current_thread(self) -> bool:
        """True when called from one of this pool's threads."""
        current = threading.current_thread()
        with self._lock:
            return current in self._threads

    def thread_count(self) -> int:
        """Threads alive in the pool right now (busy or idle)."""
        with self._lock:
            return len(self._threads)

    def shutdown(self, timeout: float, *, stuck: int = 0) -> list[str]:
        """Refuse new jobs and let every thread exit once its job is done; wait until at most
        *stuck* threads are left (handlers known to ignore cancellation, never waited for) or
        for *timeout* real seconds (threads end on events, not on the pool's clock, which may be
        a test's clock that nobody moves). Return the names of the threads still running."""
        deadline = monotonic() + timeout
        with self._lock:
            self._closed = True
            for parked in self._parked:  # no job: the thread exits
                self._clock.unpark(parked.lock)
            self._parked.clear()
            while len(self._threads) > stuck:
                remaining = deadline - monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return sorted(t.name for t in self._threads)

    def _main(self) -> None:
        if self._batch:  # asked for: submit() wakes it from the connection's reader
            BatchPolicy(forced=True).check()
        me = _Parked()
        while True:
            job = self._next_job(me)
            if job is None:
                with self._lock:
                    self._threads.discard(threading.current_thread())
                    self._cond.notify_all()  # shutdown() waits for the pool to empty
                return
            try:
                job()
            except BaseException:  # a job's bug must not shrink the pool
                _LOG.exception("worker pool job failed")

    def _next_job(self, me: _Parked) -> Callable[[], None] | None:
        """The next job, or None when this thread should exit (shut down, or idle too long)."""
        with self._lock:
            if self._jobs:  # queued jobs still run after shutdown
                return self._jobs.popleft()
            if self._closed:
                return None
            self._parked.append(me)
        if not self._clock.park(me.lock, self._clock.now() + self._idle_timeout):
            with self._lock:
                if me in self._parked:  # nobody picked this thread: it retires
                    self._parked.remove(me)
                    return None
            # Picked just as the wait ended: the release happened under the pool's lock,
            # before this thread could take it, so this acquire returns at once.
            me.lock.acquire()
        job, me.job = me.job, None
        return job
