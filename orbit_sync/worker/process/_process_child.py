"""The process executor's child side: one job at a time, relayed by the parent (``_process``), in
a real ``TaskContext`` driven by a control thread. The child never outlives its worker: the
parent-death signal on Linux, and everywhere the end of its pipe (cancel, exit after the grace).
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

__all__ = ["HANDLER_IMPORT_ERROR", "ORPHAN_EXIT", "SECRET_ENV", "child_main"]

_LOG = logging.getLogger("orbit_sync.worker")

#: The handler could not be loaded in the child (its module failed to import there).
HANDLER_IMPORT_ERROR = "HANDLER_IMPORT_ERROR"
#: Environment variables a child must not inherit: credentials stay in the parent.
SECRET_ENV = ("ORBIT_TOKEN", "ORBIT_TOKEN_FILE")
#: A child's exit status when its parent went away (it ran, or cut short, its last handler).
ORPHAN_EXIT = 70
#: prctl(2) option: the signal a process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1
#: What a log record's field may be to surely pickle.
_PLAIN = (str, int, float, bool, type(None))


class _PipeLogHandler(logging.Handler):
    """Sends each record, formatted and made picklable, to the parent."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = dict(record.__dict__, msg=record.getMessage(), args=None, exc_info=None)
            if record.exc_info:
                data["exc_text"] = logging.Formatter().formatException(record.exc_info)
            # Extras a user attached may not pickle: keep what surely does.
            self._send(("log", {k: v for k, v in data.items() if isinstance(v, _PLAIN)}))
        except Exception:  # a log line must never break the handler
            self.handleError(record)


_Job = tuple[int, bytes, Task, TaskContext, Interruptible]


class _Child:
    """The loop of one child process: one job at a time, controlled by the parent."""

    def __init__(self, conn: multiprocessing.connection.Connection, cancel_grace: float) -> None:
        self._conn = conn
        self._cancel_grace = cancel_grace
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []  # received, not started
        #: The job from its arrival until done (only then does the next come): a cancel or a
        #: deadline that comes while it is queued or loading its handler holds.
        self._current: _Job | None = None
        self._closed = False

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(message)

    def control(self) -> None:
        """The control thread: applies the parent's cancels and deadlines to the current job."""
        try:
            while (message := self._conn.recv())[0] != "exit":
                with self._cond:
                    if message[0] == "run":
                        _, number, fn_bytes, task, attempt_id, deadline = message
                        ctx = TaskContext(task, attempt_id, deadline=deadline)
                        # Interrupted at its time limit (as it starts, if that comes first).
                        running = Interruptible(threading.Lock())
                        self._current = (number, fn_bytes, task, ctx, running)
                        self._jobs.append(self._current)
                        self._cond.notify()
                        continue
                    current = self._current
                if current is None or current[0] != message[1]:
                    continue  # for a job already done
                _, _, _, ctx, running = current
                if message[0] == "deadline":
                    set_lease_deadline(ctx, message[2])
                    continue
                _, _, reason, requested = message
                cancel_context(ctx, reason)
                if requested:
                    cancel_context(ctx, "cancel_requested")
                if reason == "time_limit":
                    # As on a thread: the parent kills this process past the grace.
                    running.interrupt(TimeLimitExceeded)
        except (EOFError, OSError):
            # The parent went away, and the lease with it: cancel the handler, exit after the grace.
            timer = threading.Timer(self._cancel_grace, os._exit, (ORPHAN_EXIT,))
            timer.name = "orbit-process-orphan-exit"
            timer.daemon = True
            timer.start()
            with self._cond:
                current = self._current
            if current is not None:
                cancel_context(current[3], "shutdown")
        with self._cond:
            self._closed = True
            self._cond.notify()

    def serve(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return  # a job queued before the parent went away is not started
                job = self._jobs.pop(0)
            outcome = self._run(job)
            with self._cond:
                self._current = None
            try:
                self.send(("done", job[0], *outcome))
            except OSError:
                return  # the parent went away

    @staticmethod
    def _run(job: _Job) -> tuple[str, Any]:
        _, fn_bytes, task, ctx, running = job
        try:
            try:
                fn = pickle.loads(fn_bytes)
            except BaseException as exc:
                _LOG.error("could not load handler %r in its process", task.handler, exc_info=True)
                raise Fail(
                    HANDLER_IMPORT_ERROR,
                    f"the handler could not be loaded in its process ({type_name(exc)}); "
                    "see the worker log",
                ) from None
            value = running.run(lambda: fn(ctx, task.payload))
            try:
                pickle.dumps(value)
            except Exception:
                raise Fail(
                    "RESULT_NOT_JSON",
                    f"the handler returned a {type_name(value)}, which cannot leave its process "
                    "(not picklable)",
                ) from None
            return "value", value
        except Fail as exc:
            return "fail", (exc.code, exc.message, exc.retryable, exc.details)
        except UnknownEffect as exc:
            return "unknown", (exc.code, exc.message, exc.details)
        except TaskCancelled as exc:
            return "cancelled", exc.reason
        except BaseException as exc:
            # The type goes to the server (as on a thread); the traceback to the parent's log.
            return "error", (type_name(exc), traceback.format_exc())


def child_main(
    conn: multiprocessing.connection.Connection,
    log_level: int,
    parent: int,
    cancel_grace: float,
    guard: tuple[str, str] | None,
) -> None:
    """A child's entry point: *parent* is the worker's pid, *guard* the outbox lock and instance."""
    for name in SECRET_ENV:
        os.environ.pop(name, None)
    if sys.platform.startswith("linux"):
        import ctypes  # only here: a child on Linux

        # The kernel SIGKILLs this process when the thread that started it ends.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            _LOG.warning("could not set the parent-death signal (errno %d)", ctypes.get_errno())
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
    root.handlers = [_PipeLogHandler(child.send)]  # every record goes to the parent to write
    root.setLevel(log_level)
    threading.Thread(target=child.control, name="orbit-process-control", daemon=True).start()
    child.serve()
