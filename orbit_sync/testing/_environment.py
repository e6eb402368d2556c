"""HandlerEnvironment: run a handler with no server, the way the Worker would.

For unit tests of handlers (like temporalio's ``ActivityEnvironment``)::

    env = HandlerEnvironment(attempt=2)
    verdict = env.run(resize, {"w": 10})
    assert verdict.outcome is Outcome.SUCCEEDED and verdict.result == {"w": 20}

    env.cancel()                          # the next (or running) context is cancelled
    assert env.run(resize, {"w": 10}).outcome is Outcome.CANCELLED
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import cattrs

from ..clock import Clock, as_clock
from ..models import Task, TaskState, new_id
from ..worker._context import TaskContext, cancel_context
from ..worker.core._outcomes import DEFAULT_ENCODER, ResultEncoder, Verdict, outcome_of

__all__ = ["HandlerEnvironment"]


class HandlerEnvironment:
    """Builds a :class:`TaskContext` for a made-up task, calls the handler on this thread, and
    maps its ending to the :class:`Verdict` (outcome, result, error code) the worker would send.

    *clock* (an :class:`orbit_sync.Clock`, real time when left out; a plain function still works
    with a ``DeprecationWarning`` until the next release) is the time of the lease deadline that
    ``ctx.remaining()`` counts down to."""

    def __init__(
        self,
        *,
        handler: str = "handler",
        attempt: int = 1,
        max_attempts: int = 3,
        lease_seconds: float = 30.0,
        clock: Clock | Callable[[], float] | None = None,
        logger: logging.Logger | None = None,
        result_converter: cattrs.BaseConverter | None = None,
    ) -> None:
        self._handler = handler
        self._encoder = (
            DEFAULT_ENCODER if result_converter is None else ResultEncoder(result_converter)
        )
        self._attempt = attempt
        self._max_attempts = max_attempts
        self._lease = lease_seconds
        self._clock = as_clock(clock)
        self._logger = logger
        self._lock = threading.Lock()
        self._pending: str | None = None
        self._running: TaskContext | None = None
        #: The context of the latest :meth:`run` (``None`` before the first).
        self.context: TaskContext | None = None

    def cancel(self, reason: str = "cancel_requested") -> None:
        """Cancel the running handler's context, or the next one if none is running."""
        with self._lock:
            ctx = self._running
            if ctx is None:
                self._pending = reason
                return
        cancel_context(ctx, reason)

    def run(self, fn: Callable[[TaskContext, Any], Any], payload: Any) -> Verdict:
        """Call ``fn(ctx, payload)`` and return what the worker would report."""
        task = Task(
            task_id=new_id(),
            queue_id=new_id(),
            namespace_id=new_id(),
            handler=self._handler,
            handler_version="1",
            payload_version="1",
            payload=payload,
            state=TaskState.LEASED,
            revision=1,
            attempt=self._attempt,
            max_attempts=self._max_attempts,
        )
        ctx = TaskContext(
            task,
            new_id(),
            deadline=self._clock.now() + self._lease,
            clock=self._clock,
            logger=self._logger,
        )
        with self._lock:
            self.context = self._running = ctx
            pending, self._pending = self._pending, None
        if pending is not None:
            cancel_context(ctx, pending)
        value: Any = None
        error: BaseException | None = None
        try:
            value = fn(ctx, ctx.payload)
        except KeyboardInterrupt:
            raise  # this runs on the caller's thread: Ctrl-C must still stop a test run
        except BaseException as exc:  # the worker maps every other ending; so does this
            error = exc
        finally:
            with self._lock:
                self._running = None
        return outcome_of(
            value=value,
            error=error,
            cancel_requested=ctx.cancel_requested,
            cancel_reason=ctx.cancel_reason,
            encoder=self._encoder,
        )
