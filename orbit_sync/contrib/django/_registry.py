"""Handlers declared by Django apps (``@handler`` in ``orbit_tasks.py``) before a Worker exists."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ...models import Capability
from ...worker import TaskContext, Worker
from ...worker.core._time_limits import WORKER_DEFAULT, HandlerLimit

__all__ = ["HandlerRegistry", "handler", "registry"]

Handler = Callable[[TaskContext, Any], Any]
H = TypeVar("H", bound=Handler)


class HandlerRegistry:
    """Handlers keyed by (name, version, payload_version), registered on a Worker later.

    A module of an installed app (``<app>/orbit_tasks.py``) cannot build the Worker itself: the
    server, token and capacity belong to the process that runs it (the ``orbit_worker`` command),
    so it declares its handlers here and the command applies them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handlers: dict[tuple[str, str, str], Handler] = {}
        #: Each handler's time limit and whether a timeout is retried, as declared.
        self._limits: dict[tuple[str, str, str], tuple[HandlerLimit, bool]] = {}

    def handler(
        self,
        name: str,
        *,
        version: str | int = "1",
        payload_version: str | int = "1",
        time_limit: HandlerLimit = WORKER_DEFAULT,
        time_limit_retryable: bool = False,
    ) -> Callable[[H], H]:
        """Declare the decorated function as the handler of (*name*, *version*,
        *payload_version*), called as ``fn(ctx, payload)`` on a worker thread; *time_limit*
        and *time_limit_retryable* as for ``Worker.handler`` (checked when the worker is
        built)."""
        if callable(name) or not isinstance(name, str):
            # @handler without parentheses would otherwise register nothing, silently.
            raise TypeError('use @handler("task-name"), with the handler name in parentheses')
        cap = Capability(name, version, payload_version)  # validates the names now
        key = (cap.handler, cap.handler_version, cap.payload_version)

        def register(fn: H) -> H:
            if not callable(fn):
                raise TypeError("a handler must be callable as fn(ctx, payload)")
            with self._lock:
                known = self._handlers.get(key)
                # Re-importing a module (autoreload, a test) registers the same function again.
                if known is not None and _qualname(known) != _qualname(fn):
                    raise ValueError(
                        f"handler {name!r} version {key[1]}/{key[2]} is already registered"
                        f" by {_qualname(known)}"
                    )
                self._handlers[key] = fn
                self._limits[key] = (time_limit, time_limit_retryable)
            return fn

        return register

    def keys(self) -> list[tuple[str, str, str]]:
        """The registered (name, version, payload_version) triples."""
        with self._lock:
            return list(self._handlers)

    def apply(self, worker: Worker) -> None:
        """Register every declared handler on *worker*."""
        with self._lock:
            handlers = [(key, fn, self._limits[key]) for key, fn in self._handlers.items()]
        for (name, version, payload_version), fn, (time_limit, retryable) in handlers:
            worker.register(
                name,
                fn,
                version=version,
                payload_version=payload_version,
                time_limit=time_limit,
                time_limit_retryable=retryable,
            )

    def clear(self) -> None:
        """Forget every handler (for tests)."""
        with self._lock:
            self._handlers.clear()
            self._limits.clear()


def _qualname(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


#: The registry ``@handler`` fills and ``manage.py orbit_worker`` applies.
registry = HandlerRegistry()
handler = registry.handler
