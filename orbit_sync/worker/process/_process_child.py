"""The process executor's child side: one job at a time, relayed by the parent (``_process``).

The handler gets a real ``TaskContext`` driven by a control thread; the child never outlives its
worker: the parent-death signal on Linux, and everywhere the end of its pipe, which cancels the
running handler and ends the process after *cancel_grace*.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from ...models import Task
from .._context import TaskContext, cancel_context, set_lease_deadline
from ..core._outcomes import Fail, TaskCancelled, TimeLimitExceeded, UnknownEffect, type_name
from ..core._time_limits import Interruptible
from ..outbox._outbox_lock import hold_instance_shared

__all__ = ["ORPHAN_EXIT", "SECRET_ENV", "child_main"]

_LOG = logging.getLogger("orbit_sync.worker")

#: Environment variables a child must not inherit: credentials stay in the parent.
SECRET_ENV = ("ORBIT_TOKEN", "ORBIT_TOKEN_FILE")
#: A child's exit status when its parent went away (it ran, or cut short, its last handler).
ORPHAN_EXIT = 70
#: prctl(2) option: the signal a process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1


class _PipeLogHandler(logging.Handler):
    """Sends each record, formatted and made picklable, to the parent."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = dict(record.__dict__)
            data["msg"] = record.getMessage()
            data["args"] = None
            if record.exc_info:
                data["exc_text"] = logging.Formatter().formatException(record.exc_info)
            data["exc_info"] = None
            # Extras a user attached may not pickle: keep what surely does.
            for key, value in list(data.items()):
                if not isinstance(value, str | int | float | bool | type(None)):
                    del data[key]
            self._send(("log", data))
        except Exception:  # a log line must never break the handler
            self.handleError(record)


class _Child:
    """The loop of one child process: one job at a time, controlled by the parent."""

    def __init__(self, conn: multiprocessing.connection.Connection, cancel_grace: float) -> None:
        self._conn = conn
        self._cancel_grace = cancel_grace
        self._send_lock = threading.Lock()
        self._jobs: list[tuple[Any, ...]] = []
        self._cond = threading.Condition()
        self._ctx: TaskContext | None = None
        self._job: int | None = None
        self._closed = False
        #: The running job's handler call: interrupted at its time limit.
        self._running: Interruptible | None = None
        #: Cancels that came for a job not started yet: applied as it starts.
        self._early: dict[int, tuple[str, bool]] = {}
        #: The last job done (the parent numbers them in order).
        self._last_done = 0

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(message)

    def control(self) -> None:
        """Runs on a thread: applies the parent's cancels and deadlines to the running job."""
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                with self._cond:
                    if kind == "run":
                        self._jobs.append(message)
                        self._cond.notify()
                        continue
                    if kind == "exit":
                        break
                    ctx = self._ctx if message[1] == self._job else None
                    running = self._running
                    if ctx is None and kind == "cancel" and message[1] > self._last_done:
                        # Queued, or loading its handler: applied once it starts.
                        self._early[message[1]] = (message[2], message[3])
                if ctx is None or running is None:
                    continue
                if kind == "cancel":
                    _, _, reason, requested = message
                    self._cancel(ctx, running, reason, requested)
                elif kind == "deadline":
                    set_lease_deadline(ctx, message[2])
        except (EOFError, OSError):
            # The parent went away: nobody keeps the lease any more. Cancel the handler and
            # give it cancel_grace to stop, then leave whatever it does.
            timer = threading.Timer(self._cancel_grace, os._exit, (ORPHAN_EXIT,))
            timer.name = "orbit-process-orphan-exit"
            timer.daemon = True
            timer.start()
            with self._cond:
                ctx = self._ctx
            if ctx is not None:
                cancel_context(ctx, "shutdown")
        with self._cond:
            self._closed = True
            self._cond.notify()

    @staticmethod
    def _cancel(ctx: TaskContext, running: Interruptible, reason: str, requested: bool) -> None:
        cancel_context(ctx, reason)
        if requested:
            cancel_context(ctx, "cancel_requested")
        if reason == "time_limit":
            # As on a thread: the parent kills this process past the grace.
            running.interrupt(TimeLimitExceeded)

    def serve(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return  # a job queued before the parent went away is not started
                _, job, fn_bytes, task, attempt_id, deadline = self._jobs.pop(0)
            outcome = self._run(job, fn_bytes, task, attempt_id, deadline)
            with self._cond:
                self._last_done = job
                self._early.pop(job, None)
            try:
                self.send(("done", job, *outcome))
            except OSError:
                return  # the parent went away

    def _run(
        self, job: int, fn_bytes: bytes, task: Task, attempt_id: str, deadline: float | None
    ) -> tuple[str, Any]:
        try:
            fn = pickle.loads(fn_bytes)
        except BaseException as exc:
            _LOG.error("could not load handler %r in its process", task.handler, exc_info=True)
            return "import_error", type_name(exc)
        ctx = TaskContext(task, attempt_id, deadline=deadline)
        running = Interruptible(threading.Lock())
        with self._cond:
            self._ctx, self._job, self._running = ctx, job, running
            early = self._early.pop(job, None)
        if early is not None:
            # Cancelled while it was starting (a slow import, a short time limit).
            self._cancel(ctx, running, *early)
        try:
            value = running.run(lambda: fn(ctx, task.payload))
        except Fail as exc:
            return "fail", (exc.code, exc.message, exc.retryable, exc.details)
        except UnknownEffect as exc:
            return "unknown", (exc.code, exc.message, exc.details)
        except TaskCancelled as exc:
            return "cancelled", exc.reason
        except BaseException as exc:
            # The type goes to the server (as on a thread); the traceback to the parent's log.
            return "error", (type_name(exc), traceback.format_exc())
        finally:
            with self._cond:
                self._ctx, self._job, self._running = None, None, None
        try:
            pickle.dumps(value)
        except Exception:
            return "unpicklable", type_name(value)
        return "value", value


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when the thread that started it ends."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # only here: a child on Linux

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        _LOG.warning("could not set the parent-death signal (errno %d)", ctypes.get_errno())


def child_main(
    conn: multiprocessing.connection.Connection,
    log_level: int,
    parent: int,
    cancel_grace: float,
    guard: tuple[str, str] | None,
) -> None:
    """Entry point of a child process.

    *parent* is the worker's pid; *guard* the outbox lock file and instance id, if any.
    """
    for name in SECRET_ENV:
        os.environ.pop(name, None)
    _die_with_parent()
    if guard is not None:
        try:
            # Held until this process ends (the descriptor stays open): see ``_outbox_lock``.
            hold_instance_shared(*guard)
        except OSError:
            os._exit(ORPHAN_EXIT)  # a later process is replaying this instance: its worker is gone
    if os.getppid() != parent:
        # The parent died before the signal was armed (or the lock taken): run nothing.
        os._exit(ORPHAN_EXIT)
    child = _Child(conn, cancel_grace)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_PipeLogHandler(child.send))
    root.setLevel(log_level)
    threading.Thread(target=child.control, name="orbit-process-control", daemon=True).start()
    child.serve()
