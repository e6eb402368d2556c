"""The Worker's registered handlers and identity, and the ``worker.hello`` body built from them."""

from __future__ import annotations

import inspect
import logging
import os
import threading
import weakref
from collections.abc import Callable

import attrs

from ...models import Capability, Registration, new_id, new_secret
from .._context import Handler, task_logger
from .._options import WorkerOptions
from ..core._time_limits import WORKER_DEFAULT, HandlerLimit, TimeLimit, check_time_limit
from ..process._process import ProcessHandler, ProcessPool, check_process_handler
from ..process._process_limits import ChildLimits, MemoryLimited

__all__ = ["HandlerSettings", "Handlers", "check_handler_signature"]

#: A handler's key: (name, handler version, payload version).
Key = tuple[str, str, str]


@attrs.frozen
class HandlerSettings:
    """How a handler is registered: :meth:`Worker.handler`'s keywords."""

    version: str | int = "1"
    payload_version: str | int = "1"
    executor: str = "thread"
    memory_limit: int | None = None
    memory_limit_retryable: bool = False
    time_limit: HandlerLimit = WORKER_DEFAULT
    time_limit_retryable: bool = False


def check_handler_signature(fn: object) -> None:
    """Refuse at registration what would only fail at run time as ``HANDLER_ERROR``."""
    if not callable(fn):
        raise TypeError(f"handler must be callable as fn(ctx, payload), not {type(fn).__name__}")
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's async __call__
    ):
        raise TypeError("handlers run on threads: use a plain def, not async def")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"handler {name}{signature} cannot be called as fn(ctx, payload)") from None


#: Every handler table of this process, so a forked child can give each worker a new identity.
_TABLES: weakref.WeakSet[Handlers] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # PROTOCOL §3: instance_id is new for every process. A child that kept its parent's identity
    # would fence it (or be fenced) with STALE_SESSION on every reconnect.
    for table in list(_TABLES):
        table.new_identity()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Handlers:
    """The handler table of one Worker (docs/architecture.md, ``_handlers``), under the
    worker's registry lock."""

    def __init__(
        self, lock: threading.RLock, options: WorkerOptions, started: Callable[[], bool]
    ) -> None:
        self._lock = lock
        self._options = options
        self._started = started
        self._registered: dict[Key, tuple[Handler, HandlerSettings]] = {}
        #: What :meth:`find` returns (process handlers wrapped in a ProcessHandler).
        self._found: dict[Key, tuple[Handler, logging.Logger, TimeLimit | None]] = {}
        #: Child processes for the ``executor="process"`` handlers; none before the first one.
        self.processes: ProcessPool | None = None
        self._registration: Registration | None = None
        # instance_id is new for each Worker (so two Workers of one process never fence each
        # other); instance_secret is kept across all its reconnects (PROTOCOL §3).
        self.instance_id = new_id()
        self._instance_secret = new_secret()
        _TABLES.add(self)

    def add(self, name: str, fn: Handler, settings: HandlerSettings) -> None:
        """Register *fn* (see :meth:`Worker.register`)."""
        executor, time_limit = settings.executor, settings.time_limit
        registered = fn
        if executor not in ("thread", "process"):
            raise ValueError('executor must be "thread" or "process"')
        seconds = (
            self._options.time_limit
            if time_limit is WORKER_DEFAULT
            else check_time_limit(time_limit, f"handler {name!r}: time_limit")
        )
        if type(settings.time_limit_retryable) is not bool:
            raise TypeError("time_limit_retryable must be a bool")
        check_handler_signature(fn)
        if settings.memory_limit is not None:
            if executor != "process":
                raise ValueError('memory_limit needs executor="process"')
            fn = MemoryLimited(fn, settings.memory_limit, retryable=settings.memory_limit_retryable)
        if executor == "process":
            check_process_handler(fn)
        cap = Capability(name, settings.version, settings.payload_version)  # validates the names
        key = (cap.handler, cap.handler_version, cap.payload_version)
        limit = None
        if seconds is not None:
            limit = TimeLimit(
                seconds,
                self._options.cancel_grace,
                retryable=settings.time_limit_retryable,
                in_process=executor == "process",
            )
        with self._lock:
            if self._started():
                raise RuntimeError("register handlers before the worker starts")
            if key in self._found:
                raise ValueError(
                    f"handler {name!r} version {key[1]}/{key[2]} is already registered"
                )
            if executor == "process":
                if self.processes is None:
                    # Sized apart from capacity: CPU-bound work wants about one per core.
                    options = self._options
                    self.processes = ProcessPool(
                        options.process_pool or os.cpu_count() or 1,
                        cancel_grace=options.cancel_grace,
                        limits=ChildLimits(
                            max_tasks=options.process_max_tasks_per_child,
                            max_memory_mb=options.process_max_memory_per_child,
                        ),
                    )
                fn = ProcessHandler(fn, self.processes)
            self._found[key] = (fn, task_logger(cap.handler), limit)
            self._registered[key] = (registered, settings)

    def find(self, key: Key) -> tuple[Handler, logging.Logger, TimeLimit | None] | None:
        """The handler registered for *key*, its task logger and its time limit, or None."""
        with self._lock:
            return self._found.get(key)

    def time_limits(self) -> dict[Key, float | None]:
        """Each registered handler's time limit in seconds (None: no limit)."""
        with self._lock:
            return {
                key: None if limit is None else limit.seconds
                for key, (_, _, limit) in self._found.items()
            }

    def specs(self) -> list[tuple[Key, Handler, HandlerSettings]]:
        """Each registration as given (unwrapped), so another Worker can register it anew."""
        with self._lock:
            return [(key, fn, settings) for key, (fn, settings) in self._registered.items()]

    def bind(self) -> None:
        """Look up every process handler by its name (by start its module has bound it)."""
        for fn, _, _ in list(self._found.values()):
            if isinstance(fn, ProcessHandler):
                fn.bind()

    def registration(self) -> Registration:
        """The ``worker.hello`` body, built once, by whichever thread asks first."""
        with self._lock:
            if self._registration is None:
                if not self._found:
                    raise ValueError("register at least one handler before starting the worker")
                self._registration = Registration(
                    queue_id=self._options.queue_id,
                    capabilities=[Capability(*key) for key in self._found],
                    capacity=self._options.capacity,
                    instance_id=self.instance_id,
                    instance_secret=self._instance_secret,
                    cancellation_notifications=self._options.cancellation_notifications,
                )
            return self._registration

    def new_identity(self) -> None:
        """A new instance_id and instance_secret (in a forked child: a new process). No lock:
        the child has one thread, and a lock a parent's thread held is never released in it."""
        self.instance_id = new_id()
        self._instance_secret = new_secret()
        self._registration = None
