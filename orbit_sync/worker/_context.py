"""TaskContext: what a handler sees of its attempt, and how it learns it must stop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, MutableMapping
from typing import Any

from ..clock import Clock, now_reader
from ..models import Task
from .core._outcomes import CANCEL_REASONS, TaskCancelled

__all__ = [
    "Handler",
    "TaskContext",
    "add_watcher",
    "cancel_context",
    "lease_deadline",
    "remove_watcher",
    "set_lease_deadline",
    "worker_log",
]

_LOG = logging.getLogger("orbit_sync.worker")


def task_logger(handler: str) -> logging.Logger:
    """``ctx.logger``'s logger for *handler*, routed apart from ``orbit_sync.worker``'s lines."""
    return logging.getLogger(f"orbit_sync.task.{handler}")


class _TaskLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Prefixes messages with the task and attempt ids; adds them and the handler as ``extra``."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        kwargs["extra"] = extra = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return f"[task={extra['task_id']} attempt={extra['attempt_id']}] {msg}", kwargs


class TaskContext:
    """The handler's view of one attempt.

    ``cancelled`` is set when the handler should stop; ``cancel_reason`` says why:
    ``cancel_requested`` (the task was cancelled), ``lease_expired`` (the local deadline passed
    before a renewal), ``lease_lost`` (the server no longer holds the lease for us),
    ``session_replaced`` (the lease did not survive a reconnect) or ``shutdown`` (the worker is
    stopping). Cancellation is cooperative: call :meth:`raise_if_cancelled` at safe points.

    ``logger`` logs under ``orbit_sync.task.<handler>`` (or the *logger* given), with the task and
    attempt ids in each line and as ``extra`` fields (``task_id``, ``attempt_id``, ``handler``).

    *deadline* (the local lease deadline) and :meth:`remaining` read *clock*, an
    :class:`orbit_sync.Clock` (real time when left out; the worker passes its own; a plain function
    still works, with a ``DeprecationWarning``, until the next release).
    """

    __slots__ = (
        "_cancel_requested",
        "_clock",
        "_deadline",
        "_lock",
        "_log",
        "_reason",
        "_watchers",
        "attempt_id",
        "cancelled",
        "logger",
        "task",
    )

    def __init__(
        self,
        task: Task,
        attempt_id: str,
        *,
        deadline: float | None = None,
        clock: Clock | Callable[[], float] | None = None,
        logger: logging.Logger | None = None,
        worker_logger: logging.Logger | None = None,
    ) -> None:
        self.task = task
        self.attempt_id = attempt_id
        #: Set once the handler should stop (see ``cancel_reason``).
        self.cancelled = threading.Event()
        extra = {"task_id": task.task_id, "attempt_id": attempt_id, "handler": task.handler}
        #: For the handler's own lines (``orbit_sync.task.<handler>`` unless given).
        self.logger: logging.LoggerAdapter[logging.Logger] = _TaskLogger(
            logger or task_logger(task.handler), extra
        )
        # The worker's lines about this attempt stay under the library's logger.
        self._log: logging.LoggerAdapter[logging.Logger] = _TaskLogger(worker_logger or _LOG, extra)
        self._clock = now_reader(clock)
        self._deadline = deadline
        self._reason: str | None = None
        self._cancel_requested = False
        self._lock = threading.Lock()
        # Called (no arguments, on the changing thread) after a cancel or a deadline change:
        # the process executor relays both to the handler's child process.
        self._watchers: tuple[Callable[[], None], ...] = ()

    @property
    def task_id(self) -> str:
        """The task's id."""
        return self.task.task_id

    @property
    def attempt(self) -> int:
        """The 1-based attempt number (``> 1`` means this is a retry)."""
        return self.task.attempt

    @property
    def max_attempts(self) -> int:
        """The task's attempt budget."""
        return self.task.max_attempts

    @property
    def payload(self) -> Any:
        """The task's JSON payload."""
        return self.task.payload

    @property
    def handler(self) -> str:
        """The handler name this task was assigned to."""
        return self.task.handler

    @property
    def cancel_reason(self) -> str | None:
        """Why the context was cancelled (the first reason wins), or ``None``."""
        return self._reason

    @property
    def cancel_requested(self) -> bool:
        """True once the server asked to cancel this attempt, whatever cancelled the context."""
        return self._cancel_requested

    def raise_if_cancelled(self) -> None:
        """Raise :class:`TaskCancelled` if the handler should stop."""
        if self.cancelled.is_set():
            raise TaskCancelled(self._reason or "cancelled")

    def sleep(self, seconds: float) -> None:
        """Wait up to *seconds*; raise :class:`TaskCancelled` once the context is cancelled."""
        self.cancelled.wait(max(0.0, seconds))
        self.raise_if_cancelled()

    def remaining(self) -> float:
        """Seconds until the local lease deadline (renewals move it forward); 0 when passed."""
        deadline = self._deadline
        return 0.0 if deadline is None else max(0.0, deadline - self._clock())

    def __repr__(self) -> str:
        state = f"cancelled={self._reason!r}" if self._reason else "running"
        return (
            f"<TaskContext task={self.task.task_id} attempt={self.attempt_id} "
            f"handler={self.task.handler!r} {state}>"
        )


# The worker's calls on a context are functions, not methods: the class is the handler's API, and
# a handler has no business cancelling itself or moving its own deadline.


def cancel_context(ctx: TaskContext, reason: str) -> bool:
    """Cancel *ctx* with *reason*; True when this call cancelled it (the first reason wins)."""
    if reason not in CANCEL_REASONS:
        raise ValueError(f"unknown cancel reason {reason!r}")
    with ctx._lock:
        if reason == "cancel_requested":
            ctx._cancel_requested = True
        if ctx._reason is not None:
            return False
        ctx._reason = reason
    ctx.cancelled.set()
    for watcher in ctx._watchers:
        watcher()
    return True


def worker_log(ctx: TaskContext) -> logging.LoggerAdapter[logging.Logger]:
    """The worker's logger for *ctx*'s attempt, its lines prefixed like the handler's."""
    return ctx._log


def lease_deadline(ctx: TaskContext) -> float | None:
    """*ctx*'s local lease deadline (on its clock), or ``None`` before the first lease."""
    return ctx._deadline


def set_lease_deadline(ctx: TaskContext, deadline: float | None) -> None:
    """Move *ctx*'s local lease deadline (a lease was granted or renewed) and tell its watchers."""
    ctx._deadline = deadline
    for watcher in ctx._watchers:
        watcher()


def add_watcher(ctx: TaskContext, watcher: Callable[[], None]) -> None:
    """Call *watcher* (no arguments, on the changing thread) after each cancel or deadline move."""
    with ctx._lock:
        ctx._watchers = (*ctx._watchers, watcher)


def remove_watcher(ctx: TaskContext, watcher: Callable[[], None]) -> None:
    """Stop calling *watcher* (added by :func:`add_watcher`)."""
    with ctx._lock:
        ctx._watchers = tuple(w for w in ctx._watchers if w is not watcher)


#: ``handler(ctx, payload) -> result``
Handler = Callable[[TaskContext, Any], Any]
