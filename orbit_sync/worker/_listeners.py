"""What the worker tells its user: its counters, shutdown report, and events for listeners and
handler middleware (docs/observability.md: the events, their threads, a failing listener). Every
event is one frozen object, so fields can be added without breaking a listener."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import attrs

from .._reader import on_reader_thread
from ..models import Outcome
from ._context import TaskContext

__all__ = [
    "AttemptEvent",
    "AttemptFinished",
    "AttemptInfo",
    "DisconnectEvent",
    "DrainEvent",
    "LeaseEvent",
    "SessionEvent",
    "ShutdownReport",
    "StuckEvent",
    "WorkerListener",
    "WorkerStats",
]

_LOG = logging.getLogger("orbit_sync.worker")


@attrs.frozen
class WorkerStats:
    """A snapshot of :meth:`Worker.stats() <orbit_sync.worker.Worker.stats>`.

    ``succeeded``/``failed``/``cancelled``/``unknown`` count finishes the server acknowledged, by
    the outcome the worker reported; ``evidence_only`` counts those of them the server kept only
    as evidence (the lease was already gone). ``renew_lag_*`` is how late the lease watchdog woke
    up compared with its schedule (CPU-bound handlers delay it; see the README).
    ``reconnects`` counts sessions established after the first one; ``dial_failures`` counts
    connection attempts that failed (a worker that cannot reach its server shows 0 reconnects
    and a growing ``dial_failures``). ``stuck`` counts handlers finished ``UNKNOWN`` while
    still running (past their time limit and the cancel grace, or at shutdown): each holds one
    of ``capacity``'s slots until it returns.
    """

    connected: bool
    running: int
    succeeded: int
    failed: int
    cancelled: int
    unknown: int
    evidence_only: int
    finish_rejected: int
    renewals: int
    renew_failures: int
    renew_lag_last: float
    renew_lag_max: float
    lease_losses: int
    reconnects: int
    skipped_assignments: int
    dial_failures: int = 0
    stuck: int = 0


@attrs.frozen
class AttemptInfo:
    """Which attempt a shutdown report entry, or an attempt's event, is about."""

    task_id: str
    attempt_id: str
    handler: str


@attrs.frozen
class ShutdownReport:
    """What :meth:`Worker.run`/:meth:`Worker.stop` return once the worker has stopped.

    - ``drained``: every handler returned before its context had to be cancelled;
    - ``cancelled``: handlers whose context was cancelled with ``shutdown`` and that then returned;
    - ``abandoned``: handlers still running after the cancel grace: finished ``UNKNOWN`` with
      ``SHUTDOWN_TIMEOUT`` (their effect is uncertain); their thread is a daemon and a late result
      is dropped;
    - ``unreported``: attempts whose finish could not be delivered before the end (no
      connection): the server will recover them when their lease expires;
    - ``error``: the error that stopped the worker (bad credentials, ...), if any.
    """

    drained: bool
    cancelled: tuple[AttemptInfo, ...] = ()
    abandoned: tuple[AttemptInfo, ...] = ()
    unreported: tuple[AttemptInfo, ...] = ()
    error: BaseException | None = attrs.field(default=None, eq=False)


@attrs.frozen
class AttemptEvent(AttemptInfo):
    """One attempt of a task (``attempt_received``, ``attempt_started``)."""

    #: The 1-based attempt number and the task's attempt budget.
    attempt: int
    max_attempts: int


@attrs.frozen
class AttemptFinished(AttemptInfo):
    """How an attempt ended (``attempt_finished``).

    ``outcome`` is what the worker reported (``SUCCEEDED``, ``FAILED``, ``CANCELLED``,
    ``UNKNOWN``); ``duration``, the handler's run in seconds (``None`` when it never ran: ``ran``
    is then False). ``delivered`` is False when the finish could not be delivered before the
    worker stopped, or the server refused it (it then recovers the attempt when the lease expires).
    """

    attempt: int
    outcome: Outcome
    error_code: str | None
    duration: float | None
    ran: bool
    delivered: bool


@attrs.frozen
class LeaseEvent(AttemptInfo):
    """A lease renewal (``lease_renewed``) or loss (``lease_lost``) of one attempt: ``lag`` is
    how many seconds after its schedule the renewal was sent (CPU-bound handlers holding the GIL
    make it grow); ``reason``, why a lease was lost (``lease_expired``, ``lease_lost``,
    ``session_replaced``)."""

    lag: float = 0.0
    reason: str | None = None


@attrs.frozen
class StuckEvent(AttemptInfo):
    """A handler slot stuck (``handler_stuck``) or freed again (``handler_unstuck``).

    A handler that does not stop within the cancel grace (past its time limit, or at shutdown)
    is finished ``UNKNOWN`` while its thread, holding its slot, runs on until it returns, if ever.
    ``stuck`` is how many slots are stuck now, out of ``capacity``; ``reason`` is ``time_limit``
    or ``shutdown``.
    """

    reason: str
    stuck: int
    capacity: int


@attrs.frozen
class SessionEvent:
    """A session was established (``connected``); ``reconnect`` is False for the first one;
    ``capacity`` is the worker's slots (stuck ones included), 0 once it drains."""

    session_id: str
    reconnect: bool
    capacity: int = 0


@attrs.frozen
class DisconnectEvent:
    """A session ended and the worker will reconnect (``disconnected``), or a connection attempt
    failed and the worker will retry (``dial_failed``): ``reason`` is the error's type name
    (never its text)."""

    reason: str


@attrs.frozen
class DrainEvent:
    """The worker stopped taking work (``draining``): ``drain`` is False for a stop that cancels
    running handlers at once; ``timeout`` is how long they get to return; ``running``, how many
    were running then."""

    drain: bool
    timeout: float
    running: int


class WorkerListener:
    """Base class of worker listeners: every method is a no-op; override what you need.

    :meth:`around_handler` is middleware: it wraps the handler's call on the handler's thread
    (open a span, set a context variable, time it). It must call ``call()`` once and return what
    it returns; whatever it does, the worker reports the handler's own result or exception.
    """

    def attempt_received(self, event: AttemptEvent) -> None:
        """An assignment was accepted, before its start is sent (on the taking handler thread)."""

    def attempt_started(self, event: AttemptEvent) -> None:
        """The server started the attempt and its handler is about to run (handler's thread)."""

    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        """Wrap the handler's call (``call()`` runs it and returns its result), on its thread."""
        return call()

    def attempt_finished(self, event: AttemptFinished) -> None:
        """The attempt's finish was answered (``event.delivered``) or given up on (its thread)."""

    def lease_renewed(self, event: LeaseEvent) -> None:
        """A renewal of a running attempt's lease was acknowledged (lease watchdog's thread)."""

    def lease_lost(self, event: LeaseEvent) -> None:
        """A running attempt lost its lease, its context cancelled (watchdog or connection)."""

    def handler_stuck(self, event: StuckEvent) -> None:
        """A handler that would not stop (time limit or shutdown grace) was finished
        ``UNKNOWN``; its thread holds a slot (on the watchdog's or the shutdown thread)."""

    def handler_unstuck(self, event: StuckEvent) -> None:
        """A stuck handler returned at last; its slot is free again (on the handler's thread)."""

    def connected(self, event: SessionEvent) -> None:
        """A session was established (the first, or after a reconnect), on the connection."""

    def disconnected(self, event: DisconnectEvent) -> None:
        """A session ended unexpectedly; the worker is reconnecting (connection thread)."""

    def dial_failed(self, event: DisconnectEvent) -> None:
        """A dial failed (refused, timed out, HTTP error); it is retried (connection thread)."""

    def draining(self, event: DrainEvent) -> None:
        """The worker was asked to stop, takes no new work (on ``request_stop``'s caller)."""

    def stopped(self, report: ShutdownReport) -> None:
        """The worker stopped; *report* is what ``run()``/``stop()`` return (shutdown thread)."""


#: The events, in the order WorkerListener declares them (around_handler is middleware).
EVENTS = tuple(
    name for name in vars(WorkerListener) if not name.startswith("_") and name != "around_handler"
)


class Hooks:
    """The worker's listeners, and the dispatch that keeps a failing one from breaking work."""

    def __init__(self, listeners: Iterable[object] = (), *, logger: logging.Logger | None = None):
        self._log = logger or _LOG
        self._lock = threading.Lock()
        #: Every listener subscribed so far, in order (a plain attribute, not a property: it is
        #: asked several times per attempt).
        self.listeners: tuple[object, ...] = ()
        # Per event, only the listeners that override it: a no-op base method costs nothing.
        self._by_event: dict[str, tuple[Callable[[Any], None], ...]] = dict.fromkeys(EVENTS, ())
        self._wrappers: tuple[Callable[[TaskContext, Callable[[], Any]], Any], ...] = ()
        #: Runs an event decided on a connection's reader on the watchdog's thread (the reader
        #: runs no user code); unset (a Hooks used alone): in place.
        self.elsewhere: Callable[[Callable[[], None]], None] | None = None
        for listener in listeners:
            self.add(listener)

    def __bool__(self) -> bool:
        return bool(self.listeners)

    def add(self, listener: object) -> None:
        """Subscribe *listener* (a :class:`WorkerListener`, or any object with such methods)."""
        if listener is None or isinstance(listener, type):
            raise TypeError("add a listener instance (e.g. MyListener()), not a class or None")
        if not any(callable(getattr(listener, name, None)) for name in (*EVENTS, "around_handler")):
            raise TypeError(
                f"{type(listener).__name__} has none of the listener methods: {', '.join(EVENTS)}"
            )
        with self._lock:  # copy on write: emitters read the tuples without a lock
            by_event = dict(self._by_event)
            for name in EVENTS:
                if (method := _overridden(listener, name)) is not None:
                    by_event[name] = (*by_event[name], method)
            if (wrap := _overridden(listener, "around_handler")) is not None:
                self._wrappers = (*self._wrappers, wrap)
            self._by_event = by_event
            self.listeners = (*self.listeners, listener)

    def emit(self, name: str, event: object) -> None:
        """Call every listener of event *name*, logging and skipping one that raises; on a
        connection's reader, the calls are handed to :attr:`elsewhere`."""
        if self.elsewhere is not None and on_reader_thread():
            self.elsewhere(partial(self._emit, name, event))
            return
        self._emit(name, event)

    def _emit(self, name: str, event: object) -> None:
        for method in self._by_event[name]:
            try:
                method(event)
            except Exception:
                self._log.exception("worker listener %s failed on %s", _owner(method), name)

    def call_handler(self, handler: Callable[[TaskContext, Any], Any], ctx: TaskContext) -> Any:
        """Run ``handler(ctx, payload)`` inside every listener's :meth:`around_handler`."""
        call: Callable[[], Any] = partial(handler, ctx, ctx.payload)
        for wrap in reversed(self._wrappers):
            call = self._isolate(wrap, ctx, call)
        return call()

    def _isolate(self, wrap: Callable[..., Any], ctx: TaskContext, inner: Callable[[], Any]) -> Any:
        def run() -> Any:
            # What the handler did inside this middleware: a failing middleware is skipped.
            called = False
            value: Any = None
            error: BaseException | None = None

            def guarded() -> Any:
                nonlocal called, value, error
                if called:
                    raise RuntimeError("around_handler called the handler twice")
                called = True
                try:
                    value = inner()
                except BaseException as exc:
                    error = exc
                    raise
                return value

            try:
                wrap(ctx, guarded)
            except BaseException:
                if error is not None:
                    raise error from None  # the handler's own ending, whatever was raised
                self._log.exception(
                    "worker middleware %s failed %s",
                    _owner(wrap),
                    "after the handler returned"
                    if called
                    else "before calling the handler; running it without",
                )
            else:
                if error is not None:
                    raise error  # a middleware swallowed the handler's exception: keep it
                if not called:
                    self._log.error(
                        "worker middleware %s did not call the handler; running it without",
                        _owner(wrap),
                    )
            return value if called else inner()

        return run


def _overridden(listener: object, name: str) -> Any:
    """*listener*'s method *name*, or None when it has none or keeps the base class's no-op."""
    method = getattr(listener, name, None)
    if not callable(method) or getattr(type(listener), name, None) is getattr(WorkerListener, name):
        return None
    return method


def _owner(method: Callable[..., Any]) -> str:
    owner = getattr(method, "__self__", method)
    return type(owner).__qualname__
