"""A fixed-size pool of daemon threads.

``concurrent.futures.ThreadPoolExecutor`` joins its (non-daemon) threads at interpreter exit, so
one handler that ignores cancellation would keep the process alive forever. These threads are
daemons: after a bounded shutdown the process can always exit.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["DaemonPool"]

_LOG = logging.getLogger("orbit_sync.worker")
_names = itertools.count(1)


class DaemonPool:
    """Runs submitted callables on at most *size* daemon threads, started on demand."""

    def __init__(self, size: int, *, name: str = "orbit-handler") -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self._size = size
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        """Run *job* on a pool thread (queued while all threads are busy)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("pool is shut down")
            self._jobs.put(job)
            if self._idle > 0:
                self._idle -= 1
                return
            if len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._main, name=f"{self._name}-{next(_names)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def owns_current_thread(self) -> bool:
        """True when called from one of this pool's threads."""
        current = threading.current_thread()
        with self._lock:
            return current in self._threads

    def shutdown(self, timeout: float) -> list[str]:
        """Stop idle threads; wait up to *timeout* in total; return names still running."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        deadline = time.monotonic() + max(0.0, timeout)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive()]

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException:  # a job's bug must not shrink the pool
                _LOG.exception("worker pool job failed")
            with self._lock:
                self._idle += 1
