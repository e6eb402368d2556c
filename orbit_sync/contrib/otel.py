"""OpenTelemetry tracing for a Worker: one span per attempt (``pip install 'orbit-sync[otel]'``).

::

    from orbit_sync.contrib.otel import OpenTelemetryListener

    worker = Worker(client, queue_id=Q, listeners=[OpenTelemetryListener()])

Each attempt whose handler runs gets a ``CONSUMER`` span named ``orbit.process <handler>``. It is
the current span while the handler runs, so spans the handler opens (HTTP clients, database
drivers) are its children, and it ends when the server has answered the finish, with:

==========================  ===============================================================
attribute                   value
==========================  ===============================================================
``orbit.task_id``           the task's id
``orbit.attempt_id``        the attempt's id
``orbit.handler``           the handler's name
``orbit.attempt``           the 1-based attempt number
``orbit.outcome``           ``SUCCEEDED``, ``FAILED``, ``CANCELLED`` or ``UNKNOWN``
``orbit.error_code``        the finish's error code, if any
``orbit.finish_delivered``  False when the finish could not be delivered
``orbit.duration_s``        how long the handler ran
==========================  ===============================================================

``FAILED`` and ``UNKNOWN`` set the span's status to ``ERROR`` (a handler's exception is recorded
as an event, by type: its message is not). An attempt started on the server whose handler never
ran gets a short span of its own. The tracer comes from *tracer_provider*, or the global one:
with only ``opentelemetry-api`` installed and no SDK configured, spans cost next to nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._version import __version__
from ..models import Outcome
from ..worker import AttemptFinished, TaskContext, WorkerListener
from ..worker.core._outcomes import type_name

try:
    from opentelemetry import trace
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "orbit_sync.contrib.otel needs opentelemetry-api: pip install 'orbit-sync[otel]'"
    ) from exc

__all__ = ["OpenTelemetryListener"]

_ERROR_OUTCOMES = frozenset({Outcome.FAILED, Outcome.UNKNOWN})


class OpenTelemetryListener(WorkerListener):
    """A :class:`~orbit_sync.worker.WorkerListener` that traces each attempt as one span."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer("orbit_sync", __version__, tracer_provider)
        self._lock = threading.Lock()
        # Spans started around a handler, ended when the finish is answered (another event).
        self._spans: dict[str, trace.Span] = {}

    def _start(self, task_id: str, attempt_id: str, handler: str, attempt: int) -> trace.Span:
        attributes: dict[str, str | int] = {
            "orbit.task_id": task_id,
            "orbit.attempt_id": attempt_id,
            "orbit.handler": handler,
            "orbit.attempt": attempt,
            "messaging.system": "orbit",
            "messaging.operation.type": "process",
        }
        return self._tracer.start_span(
            f"orbit.process {handler}", kind=trace.SpanKind.CONSUMER, attributes=attributes
        )

    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        """Open the attempt's span and make it current while the handler runs."""
        span = self._start(ctx.task_id, ctx.attempt_id, ctx.handler, ctx.attempt)
        with self._lock:
            self._spans[ctx.attempt_id] = span
        with trace.use_span(span, end_on_exit=False, record_exception=False):
            try:
                return call()
            except BaseException as exc:
                # By type only: a handler's exception text may quote data or credentials.
                span.add_event("exception", {"exception.type": type_name(exc)})
                raise

    def attempt_finished(self, event: AttemptFinished) -> None:
        """Close the attempt's span with its outcome (or record one for a handler never run)."""
        with self._lock:
            span = self._spans.pop(event.attempt_id, None)
        if span is None:
            span = self._start(event.task_id, event.attempt_id, event.handler, event.attempt)
        span.set_attribute("orbit.outcome", event.outcome.value)
        span.set_attribute("orbit.finish_delivered", event.delivered)
        span.set_attribute("orbit.ran", event.ran)
        if event.error_code is not None:
            span.set_attribute("orbit.error_code", event.error_code)
        if event.duration is not None:
            span.set_attribute("orbit.duration_s", event.duration)
        if event.outcome in _ERROR_OUTCOMES:
            span.set_status(trace.Status(trace.StatusCode.ERROR, event.error_code or ""))
        span.end()
