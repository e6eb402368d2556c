"""The supervised worker process's end: the supervisor's commands, the guard against outliving
it, the reports, and the recycling limits.

The supervisor asks a child to drain, or to stop at once, over the child's control pipe, not
with a signal: a child may also receive the host's SIGTERM directly (systemd's default
``KillMode=control-group`` signals every process of the unit), and two signals would make it
stop at once instead of draining. Every request is idempotent; a stop asked before the worker
runs is applied as soon as it does (at the next report).

A supervised child never outlives its supervisor, however the supervisor ends:

- on Linux the child asks the kernel for ``SIGTERM`` when its parent dies (``PR_SET_PDEATHSIG``),
  and the worker drains on it as on any ``SIGTERM``;
- everywhere, end-of-file on the control pipe (whose writing end only the supervisor holds)
  means the supervisor is gone, and the worker drains.

Either way the child is gone within its own stop bound (``drain_timeout + cancel_grace +
flush_timeout`` plus half a second) of the supervisor's death.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..contrib.health import HealthProbe
from ..worker import (
    AttemptEvent,
    AttemptFinished,
    DrainEvent,
    SessionEvent,
    ShutdownReport,
    StuckEvent,
    WorkerListener,
)
from ..worker.process._process_limits import rss_bytes
from ._speaker import name_this_process
from ._wire import DRAIN, ENV, STATE_INTERVAL, STOP_NOW, ChildSettings, encode

__all__ = ["ChildLink", "RecycleLimits", "check_memory_limit"]

_LOG = logging.getLogger("orbit_sync.supervisor")
#: ``prctl(2)`` option: the signal the kernel sends this process when its parent dies.
_PR_SET_PDEATHSIG = 1
_MB = 1024 * 1024


def set_parent_death_signal(signum: int) -> bool:
    """Linux: have the kernel send *signum* to this process when its parent dies. False where
    the call does not exist (end-of-file on the control pipe still covers those platforms)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def check_memory_limit(
    max_memory_mb: int | None, rss: Callable[[], int | None] = rss_bytes
) -> None:
    """Refuse (``ValueError``) a per-process memory limit at or below what this process holds
    before its first task (the application loaded): every process would recycle after each task.
    """
    held = None if max_memory_mb is None else rss()
    if max_memory_mb is None or held is None or held < max_memory_mb * _MB:
        return
    raise ValueError(
        f"--max-memory-per-child {max_memory_mb} is at or below this worker process's own RSS "
        f"after start ({held / _MB:.0f} MB): every process would recycle after each task; give "
        f"it more than {math.ceil(held / _MB)} MB plus what a task needs"
    )


class RecycleLimits(WorkerListener):
    """Calls *on_limit* once with the reason when a limit is reached: the ``max_tasks``-th
    attempt started, more than ``max_memory_mb`` of RSS after an attempt finished, or
    ``max_stuck`` slots stuck (held by handlers past their time limit that could not be stopped:
    only a new process frees them).

    Tasks are counted as they start, not as their finish is answered: a child then runs
    ``max_tasks`` handlers plus the ones already starting beside the last and those the server
    assigned it before it answered the drain (every assignment that reaches a worker runs there),
    however late the acknowledgements of its finishes come back. Counted at the finish, a child
    whose acknowledgements lag would go on taking work past its limit.
    """

    def __init__(
        self,
        *,
        max_tasks: int | None,
        max_memory_mb: int | None,
        on_limit: Any,
        rss: Any = rss_bytes,
        max_stuck: int | None = None,
    ) -> None:
        self._max_tasks = max_tasks
        self._max_stuck = max_stuck
        self._max_bytes = None if max_memory_mb is None else max_memory_mb * _MB
        self._on_limit = on_limit
        self._rss = rss
        self._lock = threading.Lock()
        self._count = 0
        self._finished = 0
        self._reached = False
        #: The memory limit was reached when the first attempt finished: no room for one task.
        self.first_task = False

    def attempt_started(self, event: AttemptEvent) -> None:
        """One more handler about to run: the last one allowed, recycle (once)."""
        if self._max_tasks is None:
            return
        with self._lock:
            self._count += 1
            if self._count < self._max_tasks:
                return
        self._limit(f"{self._max_tasks} tasks (--max-tasks-per-child {self._max_tasks})")

    def attempt_finished(self, event: AttemptFinished) -> None:
        """An attempt done: past the memory limit, recycle (once)."""
        if self._max_bytes is None:
            return
        with self._lock:
            self._finished += 1
            first = self._finished == 1
        rss = self._rss()
        if rss is not None and rss > self._max_bytes:
            self.first_task = first
            self._limit(f"RSS {rss / _MB:.0f} MB (--max-memory-per-child {self._max_bytes // _MB})")

    def handler_stuck(self, event: StuckEvent) -> None:
        """A slot stuck: at the limit, recycle (once)."""
        if self._max_stuck is not None and event.stuck >= self._max_stuck:
            self._limit(
                f"{event.stuck} of {event.capacity} slots stuck past a time limit"
                f" (--max-stuck-per-child {self._max_stuck})"
            )

    def _limit(self, reason: str) -> None:
        with self._lock:
            if self._reached:
                return
            self._reached = True
        self._on_limit(reason)


class ChildLink(WorkerListener):
    """Connects a worker process to the supervisor that started it (see :mod:`._wire`)."""

    def __init__(self, settings: ChildSettings) -> None:
        self.settings = settings
        self._write_lock = threading.Lock()
        self._broken = False
        self._wake = threading.Event()
        self._stop_lock = threading.Lock()
        self._stop: bool | None = None  # None: keep running; True: drain; False: stop now
        self._done = threading.Event()
        self._worker: Any = None
        self._limits: RecycleLimits | None = None
        #: This process names itself in its lines (a child started by a supervisor).
        self._named = False
        self._probe = HealthProbe()
        #: The listeners :meth:`attach` added (the banner describes them, not by class name).
        self.attached: tuple[object, ...] = ()

    @classmethod
    def from_environ(cls) -> ChildLink | None:
        """The link when this process was started by a supervisor (else None); guards the
        process at once, before the application is imported."""
        value = os.environ.pop(ENV, None)
        if value is None:
            return None
        link = cls(ChildSettings.from_env(value))
        for fd in (link.settings.status_fd, link.settings.control_fd):
            os.set_inheritable(fd, False)  # this process's own children must not hold them
        link._named = True
        name_this_process(link.name)
        link._guard()
        return link

    @property
    def name(self) -> str:
        """This process in its lines on the standard error it shares with the others."""
        return f"worker pid {os.getpid()} slot {self.settings.slot}"

    @property
    def stop_requested(self) -> bool:
        """The supervisor asked this process to stop, or is gone."""
        return self._stop is not None

    def _guard(self) -> None:
        set_parent_death_signal(signal.SIGTERM)
        # The supervisor may have died before the call above: the kernel would never signal.
        if os.getppid() != self.settings.supervisor_pid:
            self._request(True, "the supervisor is gone")
        threading.Thread(target=self.watch_control, name="orbit-sync-control", daemon=True).start()

    def watch_control(self) -> None:
        """Apply the supervisor's requests as they arrive on the control pipe; return at its
        end, which is a request to drain (the supervisor is gone). Run on its own thread."""
        with contextlib.suppress(OSError):
            while command := os.read(self.settings.control_fd, 64):
                for byte in command:
                    if byte == DRAIN[0]:
                        self._request(True, "the supervisor asks to drain")
                    elif byte == STOP_NOW[0]:
                        self._request(False, "the supervisor asks to stop now")
        self._request(True, "the supervisor is gone")

    def _request(self, drain: bool, why: str) -> None:
        with self._stop_lock:
            if self._stop is False or self._stop is drain:
                return  # asked already (stopping now is never softened into a drain)
            # Said before the request is visible: once it is, the worker may stop and the
            # process exit before this thread runs again, and the line would be lost.
            _LOG.warning("%s: %s", why, "draining" if drain else "stopping now")
            self._stop = drain
        self._apply_stop()

    def _apply_stop(self) -> None:
        worker, drain = self._worker, self._stop
        if worker is not None and drain is not None:
            worker.request_stop(drain=drain)  # idempotent; a no-op until the worker starts

    # ------------------------------------------------------------------ the worker

    def attach(self, worker: Any) -> None:
        """Subscribe to *worker* (its health, the limits), say hello, start reporting."""
        self._worker = worker
        attached: list[object] = [self._probe, self]
        s = self.settings
        if self._named:
            name_this_process(self.name)  # again: the application may have set up logging
        check_memory_limit(s.max_memory_mb)  # before anything is started or subscribed
        if s.max_tasks is not None or s.max_memory_mb is not None or s.max_stuck is not None:
            self._limits = RecycleLimits(
                max_tasks=s.max_tasks,
                max_memory_mb=s.max_memory_mb,
                max_stuck=s.max_stuck,
                on_limit=self._recycle,
            )
            attached.append(self._limits)
        for listener in attached:
            worker.add_listener(listener)
        if s.metrics and (metrics := _add_metrics(worker)) is not None:
            attached.append(metrics)
        self.attached = tuple(attached)
        options = worker.options
        self.send(
            "hello",
            pid=os.getpid(),
            drain_timeout=options.drain_timeout,
            cancel_grace=options.cancel_grace,
            flush_timeout=options.flush_timeout,
        )
        threading.Thread(target=self._report, name="orbit-sync-report", daemon=True).start()

    def _recycle(self, reason: str) -> None:
        # Tell the supervisor first: it starts the replacement while this process drains.
        _LOG.warning("recycling this worker process after %s: draining", reason)
        limits = self._limits
        self.send("recycle", reason=reason, first_task=limits is not None and limits.first_task)
        self._worker.request_stop(drain=True)

    def _report(self) -> None:
        while not self._done.is_set():
            self._apply_stop()
            self.send("state", state=self._probe.state())
            self._wake.wait(STATE_INTERVAL)
            self._wake.clear()

    def connected(self, event: SessionEvent) -> None:
        """Report at once: the supervisor's readiness waits for this."""
        self._wake.set()

    def draining(self, event: DrainEvent) -> None:
        """Report at once: the host is no longer ready."""
        self._wake.set()

    def stopped(self, report: ShutdownReport) -> None:
        """Stop reporting (the last state goes out now)."""
        self._done.set()
        self._wake.set()
        self.send("state", state=self._probe.state())

    def exit(self, status: int, message: str | None) -> None:
        """Tell the supervisor how this process ends."""
        self._done.set()
        self.send("exit", status=status, message=message)

    def send(self, kind: str, **fields: Any) -> None:
        """Write one message; once the supervisor is gone, nothing more is written."""
        line = encode(kind, **fields)
        with self._write_lock:
            if self._broken:
                return
            try:
                os.write(self.settings.status_fd, line)
            except OSError:
                self._broken = True


def _add_metrics(worker: Any) -> object | None:
    """Count this worker's events in the supervisor's Prometheus directory: a PrometheusListener
    on the default registry (returned), unless the application registered one there already."""
    from ..contrib.prometheus import PrometheusListener

    # Their undelivered finishes read 0 from the start in the summed metrics, not "no data".
    handlers = sorted({c.handler for c in worker.registration.capabilities})
    try:
        listener = PrometheusListener()
    except ValueError:  # "Duplicated timeseries": the application's own
        for own in worker.listeners:
            if isinstance(own, PrometheusListener):
                own.declare_handlers(handlers)
        return None
    listener.declare_handlers(handlers)
    worker.add_listener(listener)
    return listener
