"""The process executor's parent side (docs/process-executor.md): the pool thread relays the job,
cancellations and deadlines to a child and its logs and ending back; a child that ignores a
cancellation for *cancel_grace* is terminated, one that dies is seen at once. Children are spawned
(the parent is threaded) by one long-lived thread and never get the connection or a secret.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

from ..._realtime import monotonic
from ...client import HANDLER_PROCESS_ENV
from .._context import TaskContext, add_watcher, lease_deadline, remove_watcher, worker_log
from ..core._outcomes import Fail, TaskCancelled, TimeLimitExceeded, UnknownEffect
from ._process_child import SECRET_ENV, child_main
from ._process_limits import ChildLimits

__all__ = [
    "HANDLER_PROCESS_DIED",
    "HANDLER_TERMINATED",
    "ProcessHandler",
    "ProcessPool",
    "check_process_handler",
    "pickled_handler",
]

#: The child died while running the handler: its effect is uncertain.
HANDLER_PROCESS_DIED = "HANDLER_PROCESS_DIED"
#: The child ignored a cancellation for ``cancel_grace`` and was terminated.
HANDLER_TERMINATED = "HANDLER_TERMINATED"

#: After SIGTERM, how long a terminated child gets before SIGKILL.
_KILL_AFTER = 1.0
_env_lock = threading.Lock()


def _not_importable(fn: Callable[..., Any], reason: str = "") -> TypeError:
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return TypeError(
        f"handler {name} cannot run in a process: it must be a module-level function importable "
        f"by its name (not a lambda, closure or nested function, nor replaced by another object "
        f"under that name){reason}"
    )


def check_process_handler(fn: Callable[..., Any]) -> None:
    """``TypeError`` when *fn*'s name alone shows it cannot be sent by reference (a lambda, a
    nested function); the module's binding is checked at start (:func:`pickled_handler`), as a
    ``@worker.handler`` decorator runs before its module binds the name."""
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(qualname, str) and isinstance(getattr(fn, "__module__", None), str):
        if "<lambda>" in qualname or "<locals>" in qualname:
            raise _not_importable(fn)
        return
    pickled_handler(fn)  # not a function (e.g. a callable object): it pickles by value


def pickled_handler(fn: Callable[..., Any]) -> bytes:
    """*fn* pickled by reference, as a child loads it; ``TypeError`` if its module does not bind
    that name to it."""
    try:
        return pickle.dumps(fn)
    except Exception as exc:
        raise _not_importable(fn, f": {exc}") from None


def _remote_error(name: str, child_traceback: str) -> BaseException:
    """An exception named as the child's (for ``HANDLER_ERROR``) whose message is its traceback,
    for the parent's log line (never the server's)."""
    module, _, qualname = name.rpartition(".")
    kind = type(qualname.rsplit(".", 1)[-1], (Exception,), {})
    kind.__module__ = module or "builtins"
    kind.__qualname__ = qualname
    return cast(BaseException, kind(f"raised in the handler's process:\n{child_traceback}"))


class _Process:
    """One child and the parent's end of its pipe; sends need no lock: only the thread running a
    job sends, else the one stopping it (close() only terminates a busy child)."""

    _ids = itertools.count(1)

    def __init__(
        self, mp: Any, log_level: int, cancel_grace: float, guard: tuple[str, str] | None
    ) -> None:
        self.conn, child_conn = mp.Pipe()
        self.proc = mp.Process(
            target=child_main,
            args=(child_conn, log_level, os.getpid(), cancel_grace, guard),
            name=f"orbit-child-{next(self._ids)}",
            daemon=True,
        )
        with _env_lock:
            # spawn copies this process's environment: hide the credentials while it starts.
            saved = {k: os.environ.pop(k, None) for k in (*SECRET_ENV, HANDLER_PROCESS_ENV)}
            os.environ[HANDLER_PROCESS_ENV] = "1"  # Client.from_env() then needs no token
            try:
                self.proc.start()
            finally:
                os.environ.pop(HANDLER_PROCESS_ENV)
                os.environ.update({k: v for k, v in saved.items() if v is not None})
        child_conn.close()
        self.healthy = True
        # A context change on another thread interrupts the relay's wait through this pair.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.jobs = 0  # jobs sent so far; each is numbered by it

    def poke(self) -> None:
        # A full buffer: already poked; closed: the relay has ended.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def run(self, fn_bytes: bytes, ctx: TaskContext, cancel_grace: float) -> tuple[str, Any]:
        """Run one job, relaying until it ends: ``(kind, data)`` as the child sent it."""
        self.jobs += 1
        job = self.jobs
        sent_deadline = lease_deadline(ctx)
        self.conn.send(("run", job, fn_bytes, ctx.task, ctx.attempt_id, sent_deadline))
        add_watcher(ctx, self.poke)
        cancelled_at: float | None = None
        try:
            while True:
                timeout = None
                if ctx.cancelled.is_set():
                    now = monotonic()
                    if cancelled_at is None:
                        cancelled_at = now
                        self.conn.send(
                            ("cancel", job, ctx.cancel_reason or "shutdown", ctx.cancel_requested)
                        )
                    timeout = cancelled_at + cancel_grace - now
                    if timeout <= 0:
                        # SIGTERM, then SIGKILL: the attempt is finished only once it is gone.
                        self.stop(kill=True)
                        return "terminated", self.proc.exitcode
                deadline = lease_deadline(ctx)
                if deadline != sent_deadline:
                    sent_deadline = deadline
                    self.conn.send(("deadline", job, deadline))
                ready = multiprocessing.connection.wait(
                    [self.conn, self.proc.sentinel, self._wake_r], timeout
                )
                if self._wake_r in ready:
                    with contextlib.suppress(OSError):  # BlockingIOError once drained
                        while self._wake_r.recv(512):
                            pass
                if self.conn in ready or (self.proc.sentinel in ready and self.conn.poll()):
                    message = self.conn.recv()
                    if message[0] == "log":
                        data = message[1]
                        logger = logging.getLogger(data.get("name") or "")
                        if logger.isEnabledFor(data.get("levelno", logging.INFO)):
                            logger.handle(logging.makeLogRecord(data))
                    elif message[0] == "done" and message[1] == job:
                        return message[2], message[3]
                elif self.proc.sentinel in ready:
                    return "died", self._exit_code()
        except (EOFError, OSError):  # the pipe broke: the child is gone or going
            return "died", self._exit_code()
        finally:
            remove_watcher(ctx, self.poke)

    def _exit_code(self) -> int | None:
        self.healthy = False
        self.proc.join(_KILL_AFTER)
        return cast(int | None, self.proc.exitcode)

    def stop(self, *, kill: bool) -> None:
        """End the child: ask nicely unless *kill*; SIGTERM, then SIGKILL if it lingers."""
        self.healthy = False
        if self.conn.closed:
            return
        if not kill and self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.proc.join(_KILL_AFTER)
        for end in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                end()
                self.proc.join(_KILL_AFTER)
        self.conn.close()
        self._wake_r.close()
        self._wake_w.close()


#: A child to start: its future, root log level and guard.
_Spawn = tuple[Future[_Process], int, tuple[str, str] | None]


class ProcessPool:
    """Up to *size* child processes, started on first use and replaced when one dies."""

    def __init__(self, size: int, *, cancel_grace: float, limits: ChildLimits) -> None:
        self.size = size  # the Worker's process_pool option, checked there
        self.cancel_grace = cancel_grace
        self._limits = limits  # recycling between attempts (_process_limits)
        self._mp = multiprocessing.get_context("spawn")
        self._cond = threading.Condition()
        self._idle: list[_Process] = []
        self._live = 0
        self._busy: set[_Process] = set()
        self._closed = False
        self._guard: tuple[str, str] | None = None
        #: What the spawner starts; None (queued by close(), after every request) ends it.
        self._spawns: queue.SimpleQueue[_Spawn | None] = queue.SimpleQueue()
        self._spawner: threading.Thread | None = None

    def guard(self, lock_path: str, instance_id: str) -> None:
        """Have every child started from now on hold *instance_id*'s lock in *lock_path*."""
        with self._cond:
            self._guard = (lock_path, instance_id)

    def run(self, fn_bytes: bytes, ctx: TaskContext) -> tuple[str, Any]:
        """Run one job on a free child (waiting for one if all are busy)."""
        child = self._acquire()
        try:
            return child.run(fn_bytes, ctx, self.cancel_grace)
        except BaseException:
            child.healthy = False
            raise
        finally:
            self._release(child)

    def _spawn(self) -> None:
        """The spawner thread, for as long as the pool is open: a child's parent-death signal
        fires when the *thread* that started it ends."""
        while (request := self._spawns.get()) is not None:
            made, level, guard = request
            try:
                made.set_result(_Process(self._mp, level, self.cancel_grace, guard))
            except BaseException as exc:
                made.set_exception(exc)

    def _acquire(self) -> _Process:
        made: Future[_Process] = Future()
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the process pool is closed")
                if self._idle:
                    child = self._idle.pop()
                    self._busy.add(child)
                    return child
                if self._live < self.size:
                    self._live += 1
                    break
                self._cond.wait()  # a release or close() notifies; a child's run is bounded
            if self._spawner is None:
                self._spawner = threading.Thread(
                    target=self._spawn, name="orbit-process-spawner", daemon=True
                )
                self._spawner.start()
            self._spawns.put((made, logging.getLogger().getEffectiveLevel(), self._guard))
        try:
            # Outside the lock: a spawn is slow but bounded (it does not wait for the child).
            child = made.result()
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise
        with self._cond:
            self._busy.add(child)
        return child

    def _release(self, child: _Process) -> None:
        keep = child.healthy and child.proc.is_alive()
        if not keep or self._limits.after_job(child.proc.pid, child.jobs) is not None:
            child.stop(kill=not keep)  # recycled between attempts: the next one starts anew
            keep = False
        with self._cond:
            self._busy.discard(child)
            idle = keep and not self._closed
            if idle:
                self._idle.append(child)
            else:
                self._live -= 1
            self._cond.notify()
        if keep and not idle:
            child.stop(kill=False)  # the pool closed while it ran

    def close(self) -> None:
        """Stop every child: idle ones exit; busy ones (abandoned handlers) are terminated."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
            self._live -= len(idle)
            self._cond.notify_all()
            started = self._spawner is not None
        # All at once, under one deadline: stop() has a time bound to keep.
        for child in idle:
            with contextlib.suppress(OSError):
                child.conn.send(("exit",))
        for child in busy:
            child.proc.terminate()
        deadline = monotonic() + _KILL_AFTER
        for child in idle + busy:
            child.proc.join(max(0.0, deadline - monotonic()))
        for child in idle + busy:
            child.stop(kill=True)  # SIGKILL for any that lingered; closes the pipes
        if started:
            # Last: its end would SIGKILL (parent-death signal) the children it started.
            self._spawns.put(None)


class ProcessHandler:
    """Wraps a handler so that each call runs in a child of *pool*."""

    def __init__(self, fn: Callable[[TaskContext, Any], Any], pool: ProcessPool) -> None:
        self.fn = fn  # checked by check_process_handler
        self._fn_bytes: bytes | None = None
        self._pool = pool
        self.__name__ = getattr(fn, "__name__", "handler")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def bind(self) -> bytes:
        """Look the handler up by its name (at start); ``TypeError`` if it does not lead back."""
        if self._fn_bytes is None:
            self._fn_bytes = pickled_handler(self.fn)
        return self._fn_bytes

    def __call__(self, ctx: TaskContext, payload: Any) -> Any:
        kind, data = self._pool.run(self.bind(), ctx)
        if kind == "value":
            return data
        if kind == "fail":
            code, message, retryable, details = data
            raise Fail(code, message, retryable=retryable, details=details)
        if kind == "unknown":
            code, message, details = data
            raise UnknownEffect(code, message, details=details)
        if kind == "cancelled":
            raise TimeLimitExceeded() if data == "time_limit" else TaskCancelled(data)
        if kind == "error":
            raise _remote_error(*data)
        if kind == "terminated":
            if ctx.cancel_reason == "time_limit":
                worker_log(ctx).warning(
                    "handler still running %.1f s after its time limit: process killed",
                    self._pool.cancel_grace,
                )
                raise TimeLimitExceeded()
            worker_log(ctx).warning(
                "handler ignored its cancellation (%s) for %.1f s: process terminated",
                ctx.cancel_reason,
                self._pool.cancel_grace,
            )
            raise UnknownEffect(
                HANDLER_TERMINATED,
                "the handler ignored its cancellation and its process was terminated",
            )
        worker_log(ctx).error("the handler's process died (exit code %s)", data)
        raise UnknownEffect(HANDLER_PROCESS_DIED, f"the handler's process died (exit code {data})")

    def __repr__(self) -> str:
        return f"<ProcessHandler {self.__qualname__}>"
