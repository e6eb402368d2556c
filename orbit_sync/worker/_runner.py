"""Worker: handlers, a daemon thread pool, the lease watchdog, reconnects, drain and shutdown.

Threads (all daemons, so the process can always exit):

- ``orbit-worker-connection``: dial, ``resume`` every live attempt, publish the connection, send
  the capacity report, then repeat it before the session expires until the connection ends; on
  loss, back off with jitter and start again with the same registration.
- ``orbit-sync-reader-*`` (the connection's own): hands each assignment to :meth:`Worker._dispatch`
  (``on_assignment``), which only records it and queues it for the pool, so a burst of up to
  ``capacity`` assignments never overflows the connection's 8-slot queue (PROTOCOL §10).
- ``orbit-handler-N`` (``capacity`` of them): per assignment ``start`` → handler (only if the
  lease allows) → ``finish``. A request whose answer was lost is re-sent with its original
  ``message_id`` once a newer connection is reconciled (:mod:`._link`).
- ``orbit-lease-watchdog``: renews running attempts (:mod:`._watchdog`).
- ``orbit-worker-supervisor``: waits for a stop request, then drains and shuts down in bounded
  phases (drain → cancel → abandon → flush → close).
"""

from __future__ import annotations

import atexit
import collections
import enum
import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from types import FrameType
from typing import Any, TypeVar

import cattrs

from ..errors import OrbitError, WorkerBusy
from ..models import (
    ID_RE,
    MAX_CAPACITY,
    Assignment,
    AttemptRef,
    AttemptState,
    CancelNotice,
    Capability,
    CapacityReport,
    Disposition,
    Lease,
    Outcome,
    Registration,
    new_id,
    new_message_id,
    new_secret,
)
from ._backoff import Backoff
from ._context import TaskContext, task_logger
from ._encoding import DEFAULT_ENCODER, ResultEncoder
from ._errors import NotConnected, is_fatal_dial_error, is_link_failure, is_transient
from ._hooks import (
    AttemptEvent,
    AttemptFinished,
    DisconnectEvent,
    DrainEvent,
    Hooks,
    LeaseEvent,
    SessionEvent,
)
from ._link import Connection, Dialer, GaveUp, Link
from ._outcomes import HANDLER_ERROR, Verdict, abandoned, not_run, outcome_of
from ._pool import DaemonPool
from ._report import AttemptInfo, ShutdownReport, WorkerStats
from ._watchdog import LeaseWatchdog, WatchdogThread

__all__ = ["Handler", "Worker"]

T = TypeVar("T")
#: ``handler(ctx, payload) -> result``
Handler = Callable[[TaskContext, Any], Any]
H = TypeVar("H", bound=Handler)

_LOG = logging.getLogger("orbit_sync.worker")

#: How often the connection thread looks up from its connection (stop flags, drain report).
_POLL = 0.25
#: Retry delay after ``busy`` (nothing was sent; a slot frees within a round trip).
_BUSY_DELAY = 0.05
#: How long shutdown waits for the drain report to be acknowledged before going on without it.
_DRAIN_REPORT_WAIT = 1.0
#: Attempt ids remembered to refuse a repeated assignment (a handler runs once per attempt).
_SEEN_LIMIT = 65_536


class _Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    FINISHING = "finishing"
    SETTLED = "settled"


class _Attempt:
    """One assignment as the worker tracks it, from ``start`` until its finish is settled."""

    __slots__ = ("abandoned", "ctx", "handler", "lock", "phase", "ref", "start_id", "task")

    def __init__(self, assignment: Assignment, ctx: TaskContext, handler: Handler) -> None:
        self.task = assignment.task
        self.ref: AttemptRef = assignment.attempt
        self.ctx = ctx
        self.handler = handler
        #: The start's message_id, kept for re-sending after a reconnect.
        self.start_id = new_message_id()
        self.phase = _Phase.STARTING
        #: Shutdown gave up on the handler and finished it UNKNOWN: its late result is dropped.
        self.abandoned = False
        self.lock = threading.Lock()

    @property
    def id(self) -> str:
        return self.ref.attempt_id

    @property
    def info(self) -> AttemptInfo:
        return AttemptInfo(self.task.task_id, self.ref.attempt_id, self.task.handler)


def _event(att: _Attempt) -> AttemptEvent:
    task = att.task
    return AttemptEvent(task.task_id, att.id, task.handler, task.attempt, task.max_attempts)


def _finished(att: _Attempt, verdict: Verdict, delivered: bool) -> AttemptFinished:
    task = att.task
    return AttemptFinished(
        task_id=task.task_id,
        attempt_id=att.id,
        handler=task.handler,
        attempt=task.attempt,
        outcome=verdict.outcome,
        error_code=verdict.error_code,
        duration=verdict.duration,
        ran=verdict.ran,
        delivered=delivered,
    )


def _lease_event(att: _Attempt, *, lag: float = 0.0, reason: str | None = None) -> LeaseEvent:
    return LeaseEvent(att.task.task_id, att.id, att.task.handler, lag, reason)


def _check_handler_signature(fn: object) -> None:
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


def _check_seconds(name: str, value: float, *, positive: bool = False) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number of seconds")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'positive' if positive else 'non-negative'}")
    return float(value)


class Worker:
    """Runs registered handlers for the tasks of one queue.

    ::

        worker = Worker(client, queue_id=Q, capacity=8)

        @worker.handler("resize", version="1", payload_version="1")
        def resize(ctx: TaskContext, payload: dict) -> dict:
            ctx.raise_if_cancelled()
            return {"resized": True}

        worker.run()   # blocks; SIGTERM/SIGINT drain, a second signal stops at once

    *capacity* (1-256) is the number of handler threads and the capacity reported to the
    server. On stop, running handlers get *drain_timeout* seconds to return (their leases are
    renewed meanwhile); then their contexts are cancelled (``shutdown``) and they get
    *cancel_grace* more; handlers still running are finished ``UNKNOWN`` with
    ``SHUTDOWN_TIMEOUT``; finishes still waiting for a connection get *flush_timeout*. Keep
    *cancel_grace* under half the lease window: cancelled attempts are no longer renewed.

    Connection: reconnects wait per *reconnect_backoff* (exponential, jittered, bounded);
    *dial_timeout* and *call_timeout* bound one dial and one request (after which the request is
    re-sent with its ``message_id`` on the next connection); *max_in_flight* (3-32) bounds the
    requests outstanding at once so the server's 8-frame outbound queue never overflows;
    *renew_retry_delay* (0.1-5 s) spaces retries of a failed renewal. *cancellation_notifications*
    asks the server for ``task.cancel`` pushes. *handle_signals* lets :meth:`run` on the main
    thread handle SIGTERM/SIGINT. Logs go to *logger* (default ``orbit_sync.worker``);
    ``ctx.logger`` logs under ``orbit_sync.task.<handler>``.

    Results are encoded by *result_converter* (a cattrs converter; default
    :func:`~orbit_sync.worker.result_converter`, which knows datetimes, ``Decimal``, ``UUID``,
    enums, attrs classes and dataclasses) when the handler returns. *listeners*
    (:class:`~orbit_sync.worker.WorkerListener`) observe attempts, leases and sessions; see also
    :meth:`add_listener`.
    """

    def __init__(
        self,
        client: Dialer,
        *,
        queue_id: str,
        capacity: int = 8,
        drain_timeout: float = 30.0,
        cancel_grace: float = 5.0,
        flush_timeout: float = 10.0,
        reconnect_backoff: Backoff | None = None,
        renew_retry_delay: float = 1.0,
        cancellation_notifications: bool = True,
        dial_timeout: float = 8.0,
        call_timeout: float = 10.0,
        max_in_flight: int = 4,
        handle_signals: bool = True,
        logger: logging.Logger | None = None,
        result_converter: cattrs.BaseConverter | None = None,
        listeners: Iterable[object] = (),
    ) -> None:
        if type(queue_id) is not str or not ID_RE.fullmatch(queue_id):
            raise ValueError("queue_id must be 32 lowercase hex characters")
        if type(capacity) is not int or not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be an int between 1 and {MAX_CAPACITY}")
        self._client = client
        self._queue_id = queue_id
        self._capacity = capacity
        self._drain_timeout = _check_seconds("drain_timeout", drain_timeout)
        self._cancel_grace = _check_seconds("cancel_grace", cancel_grace)
        self._flush_timeout = _check_seconds("flush_timeout", flush_timeout)
        self._dial_timeout = _check_seconds("dial_timeout", dial_timeout, positive=True)
        # Past this a request's connection is closed and the operation re-sent on the next one.
        self._call_timeout = min(10.0, _check_seconds("call_timeout", call_timeout, positive=True))
        self._backoff = reconnect_backoff or Backoff()
        if type(max_in_flight) is not int or not 3 <= max_in_flight <= 32:
            raise ValueError("max_in_flight must be an int between 3 and 32")
        # The server queues at most 8 outbound frames per connection and drops a consumer that
        # lets more pile up (PROTOCOL §10); it keeps 4 of them for pushes. Bounding our own
        # requests in flight keeps its answers within the rest, however busy the handlers are.
        # The watchdog (one renew at a time) and the connection thread (one capacity or resume
        # at a time) are outside the gate, so handler traffic can never starve a renewal.
        self._gate = threading.BoundedSemaphore(max_in_flight - 2)
        self._retry_delay = _check_seconds("renew_retry_delay", renew_retry_delay, positive=True)
        if not 0.1 <= self._retry_delay <= 5.0:
            raise ValueError("renew_retry_delay must be between 0.1 and 5 seconds")
        self._notifications = bool(cancellation_notifications)
        self._handle_signals = handle_signals
        self._log = logger or _LOG
        self._encoder = (
            DEFAULT_ENCODER if result_converter is None else ResultEncoder(result_converter)
        )
        self._clock = time.monotonic
        self._hooks = Hooks(listeners, logger=self._log)
        # instance_id is new for this Worker (so two Workers of one process never fence each
        # other); instance_secret is kept across all its reconnects (PROTOCOL §3).
        self._instance_id = new_id()
        self._instance_secret = new_secret()

        self._handlers: dict[tuple[str, str, str], Handler] = {}
        self._task_logs: dict[str, logging.Logger] = {}
        self._cond = threading.Condition()
        self._attempts: dict[str, _Attempt] = {}
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._counts: collections.Counter[str] = collections.Counter()
        self._running = 0
        self._unreported: list[AttemptInfo] = []
        self._started = False
        self._stop_requested = False
        self._drain_deadline = 0.0
        self._error: BaseException | None = None
        self._signals = 0
        self._ready = threading.Event()
        self._done = threading.Event()
        self._report: ShutdownReport | None = None

        self._capacity_lock = threading.Lock()
        self._report_next = CapacityReport(sequence=1, capacity=capacity, drain=False)
        self._report_sent: CapacityReport | None = None
        self._drain_acked = threading.Event()
        self._heartbeat = 15.0
        self._next_heartbeat = 0.0

        self._link = Link()
        self._registration: Registration | None = None
        self._watchdog = LeaseWatchdog(
            self._renew,
            retry_delay=self._retry_delay,
            on_change=lambda: self._watchdog_thread.wake(),
            on_renew=self._on_renewed,
            on_loss=self._on_lease_lost,
            logger=self._log,
        )
        self._watchdog_thread = WatchdogThread(self._watchdog)
        self._pool = DaemonPool(capacity)
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ registration

    def handler(
        self, name: str, *, version: str | int = "1", payload_version: str | int = "1"
    ) -> Callable[[H], H]:
        """Register the decorated function for (*name*, *version*, *payload_version*).

        The function is called as ``fn(ctx, payload)`` on a pool thread. Use it with a name,
        ``@worker.handler("resize")``: the bare ``@worker.handler`` raises ``TypeError``.
        """
        if callable(name) and not isinstance(name, str):
            raise TypeError(
                'worker.handler needs the handler\'s name: use @worker.handler("name"), '
                "not a bare @worker.handler"
            )

        def register(fn: H) -> H:
            self.register(name, fn, version=version, payload_version=payload_version)
            return fn

        return register

    def register(
        self,
        name: str,
        fn: Handler,
        *,
        version: str | int = "1",
        payload_version: str | int = "1",
    ) -> None:
        """Register *fn* as a handler (the non-decorator form of :meth:`handler`).

        Raises ``TypeError`` when *fn* cannot be called as ``fn(ctx, payload)``.
        """
        _check_handler_signature(fn)
        cap = Capability(name, version, payload_version)  # validates the names
        key = (cap.handler, cap.handler_version, cap.payload_version)
        with self._cond:
            if self._started:
                raise RuntimeError("register handlers before the worker starts")
            if key in self._handlers:
                raise ValueError(
                    f"handler {name!r} version {key[1]}/{key[2]} is already registered"
                )
            self._handlers[key] = fn
            self._task_logs.setdefault(cap.handler, task_logger(cap.handler))

    @property
    def registration(self) -> Registration:
        """The ``worker.hello`` body this worker sends (secrets are redacted in its repr)."""
        if self._registration is None:
            if not self._handlers:
                raise ValueError("register at least one handler before starting the worker")
            self._registration = Registration(
                queue_id=self._queue_id,
                capabilities=[Capability(*key) for key in self._handlers],
                capacity=self._capacity,
                instance_id=self._instance_id,
                instance_secret=self._instance_secret,
                cancellation_notifications=self._notifications,
            )
        return self._registration

    def add_listener(self, listener: object) -> None:
        """Subscribe *listener* (a :class:`~orbit_sync.worker.WorkerListener`) to this worker's
        events; safe at any time, from any thread. A listener that raises is logged and skipped."""
        self._hooks.add(listener)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Worker:
        """Start in the background and return at once (see :meth:`wait_ready`, :meth:`stop`)."""
        registration = self.registration
        with self._cond:
            if self._started:
                raise RuntimeError("a Worker can be started only once")
            self._started = True
        self._log.info(
            "worker starting: queue %s, capacity %d, handlers %s",
            registration.queue_id,
            registration.capacity,
            ", ".join(f"{c.handler}@{c.handler_version}" for c in registration.capabilities),
        )
        self._watchdog_thread.start()
        for target, name in (
            (self._connection_main, "orbit-worker-connection"),
            (self._supervisor_main, "orbit-worker-supervisor"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()
        # Daemon threads die abruptly at interpreter exit; stop cleanly first if nobody did.
        atexit.register(self._at_exit)
        return self

    def run(self) -> ShutdownReport:
        """Run until stopped; return the shutdown report (raise the error that stopped it).

        On the main thread, SIGTERM and SIGINT drain (``stop(drain=True)``); a second signal
        stops at once (``stop(drain=False)``). The previous handlers are restored on return.
        """
        install = self._handle_signals and threading.current_thread() is threading.main_thread()
        previous: dict[signal.Signals, Any] = {}
        if install:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self.start()
            seen = 0
            # Signal handlers only bump a counter (taking locks there can deadlock); this loop
            # turns the count into stop requests from ordinary code.
            while not self._done.wait(_POLL if install else None):
                if self._signals > seen:
                    seen = self._signals
                    self.request_stop(drain=seen == 1)
        except KeyboardInterrupt:
            self.request_stop(drain=False)
            self._done.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        report = self._report
        assert report is not None
        if report.error is not None:
            raise report.error
        return report

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals += 1

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the first session is established; True when it is."""
        return self._ready.wait(timeout)

    def request_stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Ask the worker to stop and return at once (safe from handlers and signal-free code).

        With *drain*, running handlers get *timeout* (default ``drain_timeout``) seconds to
        return; without, their contexts are cancelled now. A later request can only shorten it.
        """
        if timeout is not None:
            timeout = _check_seconds("timeout", timeout)
        with self._cond:
            if not self._started:
                return
            now = self._clock()
            window = (self._drain_timeout if timeout is None else timeout) if drain else 0.0
            first = not self._stop_requested
            if first:
                self._stop_requested = True
                self._drain_deadline = now + window
                self._log.info(
                    "worker stopping (%s)", f"draining for {window:g}s" if drain else "now"
                )
            elif now + window < self._drain_deadline:
                self._drain_deadline = now + window
                self._log.info("worker stop escalated: cancelling handlers now")
            self._cond.notify_all()
        with self._capacity_lock:
            if not self._report_next.drain:
                current = self._report_next
                self._report_next = CapacityReport(
                    sequence=current.sequence + 1, capacity=current.capacity, drain=True
                )
        if first and self._hooks:
            self._hooks.emit("draining", DrainEvent(drain, window, self._running))

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> ShutdownReport:
        """Stop (draining for *timeout* seconds) and return the shutdown report.

        Safe to call again, and from any thread but the worker's own (use :meth:`request_stop`
        from a handler). Returns after at most about ``timeout + cancel_grace + flush_timeout``.
        """
        with self._cond:
            started = self._started
            if not started:
                self._started = True  # a worker that never ran cannot start any more
        if not started:
            self._report = ShutdownReport(drained=True)
            self._done.set()
            return self._report
        current = threading.current_thread()
        if current in self._threads or self._pool.owns_current_thread():
            raise RuntimeError("stop() would wait for itself here; use request_stop()")
        self.request_stop(drain=drain, timeout=timeout)
        self._done.wait()
        assert self._report is not None
        return self._report

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _at_exit(self) -> None:
        if not self._done.is_set():
            self.stop(drain=False)

    # ------------------------------------------------------------------ observability

    def stats(self) -> WorkerStats:
        """A snapshot of the worker's counters."""
        wd = self._watchdog.stats()
        with self._cond:
            counts = self._counts.copy()
            running = self._running
        return WorkerStats(
            connected=self._link.current() is not None,
            running=running,
            succeeded=counts[Outcome.SUCCEEDED.value],
            failed=counts[Outcome.FAILED.value],
            cancelled=counts[Outcome.CANCELLED.value],
            unknown=counts[Outcome.UNKNOWN.value],
            evidence_only=counts["evidence_only"],
            finish_rejected=counts["finish_rejected"],
            renewals=wd.renewals,
            renew_failures=wd.renew_failures,
            renew_lag_last=wd.lag_last,
            renew_lag_max=wd.lag_max,
            lease_losses=wd.lease_losses + counts["resume_losses"],
            reconnects=counts["reconnects"],
            skipped_assignments=counts["skipped"],
        )

    def __repr__(self) -> str:
        state = "stopped" if self._done.is_set() else "running" if self._started else "new"
        return f"<Worker queue={self._queue_id} capacity={self._capacity} {state}>"

    # ------------------------------------------------------------------ connection thread

    def _connection_main(self) -> None:
        failures = 0
        first = True
        while not self._link.is_closed():
            if not first:
                self._link.pause(self._backoff.delay(failures))
                if self._link.is_closed():
                    break
            first = False
            try:
                conn: Connection = self._client.dial_worker(
                    self.registration,
                    timeout=self._dial_timeout,
                    on_cancel=self._on_cancel if self._notifications else None,
                    on_assignment=self._dispatch,
                )
            except Exception as exc:
                # Bad credentials, or a bug/misconfiguration (not a network problem): retrying
                # cannot help, so the worker stops and run() raises it.
                if is_fatal_dial_error(exc) or not isinstance(exc, OrbitError | OSError):
                    self._log.error("worker cannot connect: %s", exc)
                    self._fail(exc)
                    return
                failures += 1
                self._log.warning("connect failed (%s); retrying", type(exc).__name__)
                continue
            failures = self._session(conn, failures)

    def _session(self, conn: Connection, failures: int) -> int:
        """Reconcile, publish and serve one connection; return the updated failure count."""
        gen: int | None = None
        reason = "closed"
        try:
            if self._link.is_closed():
                return failures
            self._reconcile(conn)
            gen = self._link.publish(conn)
            self._send_capacity(conn)
            self._ready.set()
            self._log.info("session %s established", conn.session_id)
            if self._hooks:
                again = self._counts["reconnects"] > 0
                self._hooks.emit("connected", SessionEvent(conn.session_id, again))
            failures = 0
            self._serve(conn)
        except Exception as exc:  # any failure of this connection means: reconnect
            reason = type(exc).__name__
            if not self._link.is_closed():
                failures += 1
                if is_fatal_dial_error(exc):
                    self._log.error("worker rejected by the server: %s", exc)
                    self._fail(exc)
                elif isinstance(exc, OrbitError):
                    self._log.warning("connection lost (%s); reconnecting", type(exc).__name__)
                else:
                    self._log.exception("connection failed unexpectedly; reconnecting")
        finally:
            if gen is not None:
                self._link.retract(gen)
            conn.close()
        if not self._link.is_closed():
            with self._cond:
                self._counts["reconnects"] += 1
            if self._hooks:
                self._hooks.emit("disconnected", DisconnectEvent(reason))
        return failures

    def _reconcile(self, conn: Connection) -> None:
        """``resume`` every live attempt before the first capacity report (PROTOCOL §5.5)."""
        with self._cond:
            live = [a for a in self._attempts.values() if a.phase is not _Phase.SETTLED]
        pending = set(self._watchdog.pending_renewals())
        for att in live:
            lease: Lease | None
            try:
                lease = conn.resume(att.ref, timeout=self._call_timeout)
            except OrbitError as exc:
                if is_transient(exc):
                    raise
                lease = None
                self._log.warning(
                    "resume of attempt %s refused (%s)", att.id, getattr(exc, "code", "")
                )
            self._after_resume(att, lease, renew_now=att.id in pending)

    def _after_resume(self, att: _Attempt, lease: Lease | None, *, renew_now: bool) -> None:
        ctx = att.ctx
        with att.lock:
            if att.phase is not _Phase.RUNNING or ctx.cancelled.is_set():
                return  # starting/finishing threads re-send their own request; nothing to renew
            if lease is not None and lease.cancel_requested:
                self._watchdog.untrack(att.id)
                ctx._cancel("cancel_requested")
                return
            if lease is not None and lease.may_run(self._clock) and lease.deadline is not None:
                self._watchdog.refresh(att.id, lease.deadline, renew_now=renew_now)
                return
            self._watchdog.untrack(att.id)
            reason = "lease_expired" if ctx.remaining() <= 0 else "session_replaced"
            if ctx._cancel(reason):
                with self._cond:
                    self._counts["resume_losses"] += 1
                ctx._log.warning("lease did not survive the reconnect (%s)", reason)
                if self._hooks:
                    self._hooks.emit("lease_lost", _lease_event(att, reason=reason))

    def _send_capacity(self, conn: Connection) -> None:
        # Only this (connection) thread sends reports. The lock is never held across the call:
        # request_stop() takes it to queue the drain report and must not wait for an answer.
        with self._capacity_lock:
            report = self._report_next
        sent_at = self._clock()
        welcome = conn.capacity(report, timeout=self._call_timeout)
        with self._capacity_lock:
            self._report_sent = report
            # PROTOCOL §5.6: repeat the report at least every third of the session window.
            self._heartbeat = max(0.1, welcome.session_window / 3)
            self._next_heartbeat = sent_at + self._heartbeat
        if report.drain and not self._drain_acked.is_set():
            self._drain_acked.set()
            self._log.info("drain reported to the server (sequence %d)", report.sequence)

    def _serve(self, conn: Connection) -> None:
        # Assignments are dispatched by the connection's reader (on_assignment); this thread only
        # keeps the session alive and reports capacity changes until the connection ends.
        while not self._link.is_closed():
            if self._report_next is not self._report_sent or self._clock() >= self._next_heartbeat:
                self._send_capacity(conn)
                continue
            if conn.done.wait(min(_POLL, max(0.0, self._next_heartbeat - self._clock()))):
                break
        err = conn.err
        if err is not None and not self._link.is_closed():
            raise err

    def _on_cancel(self, notice: CancelNotice) -> None:
        # Runs on the connection's reader thread: only flag the context, never block.
        with self._cond:
            att = self._attempts.get(notice.attempt_id)
        if att is None or att.ref.epoch != notice.epoch:
            return
        if att.ctx._cancel("cancel_requested"):
            att.ctx._log.info("cancel requested by the server")

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, assignment: Assignment) -> None:
        # Runs on the connection's reader thread (on_assignment): it must never block or make a
        # request. It takes the worker's lock (never held across a wait for the network) and
        # queues the attempt on the pool, whose submit never blocks.
        task = assignment.task
        key = (task.handler, task.handler_version, task.payload_version)
        with self._cond:
            if assignment.attempt_id in self._seen:
                self._log.warning("attempt %s assigned twice; ignored", assignment.attempt_id)
                return
            self._seen[assignment.attempt_id] = None
            if len(self._seen) > _SEEN_LIMIT:
                self._seen.popitem(last=False)
            handler = self._handlers.get(key)
            if self._stop_requested or handler is None:
                # Draining takes no new work: the unstarted reservation returns to the queue
                # when its lease expires on the server.
                self._counts["skipped"] += 1
                self._log.info(
                    "attempt %s of task %s not started: worker is stopping",
                    assignment.attempt_id,
                    task.task_id,
                )
                return
            ctx = TaskContext(
                task,
                assignment.attempt_id,
                clock=self._clock,
                logger=self._task_logs[task.handler],
                worker_logger=self._log,
            )
            att = _Attempt(assignment, ctx, handler)
            self._attempts[att.id] = att
        ctx._log.debug(
            "assigned (%s, attempt %d/%d)", task.handler, task.attempt, task.max_attempts
        )
        if self._hooks:
            self._hooks.emit("attempt_received", _event(att))
        self._pool.submit(lambda: self._run_attempt(att))

    def _run_attempt(self, att: _Attempt) -> None:
        try:
            self._attempt_body(att)
        except Exception:  # a bug here must not lose the slot silently
            att.ctx._log.exception("worker error while running the attempt")
        finally:
            with att.lock:
                abandoned_ = att.abandoned
            if not abandoned_:
                self._settle(att)

    def _attempt_body(self, att: _Attempt) -> None:
        ctx = att.ctx
        try:
            result = self._call(
                lambda c: c.start(att.ref, message_id=att.start_id, timeout=self._call_timeout)
            )
        except GaveUp:
            ctx._log.warning("not started: the worker stopped before start was answered")
            return
        except OrbitError as exc:
            ctx._log.warning("start refused (%s); handler not run", getattr(exc, "code", exc))
            return
        lease = result.lease
        if lease.cancel_requested:
            ctx._cancel("cancel_requested")
        receipt = result.receipt
        started = (
            receipt.disposition is Disposition.APPLIED
            and receipt.attempt_state is AttemptState.RUNNING
        )
        with att.lock:
            may_run = lease.may_run(self._clock) and not ctx.cancelled.is_set()
            if may_run and lease.deadline is not None:
                att.phase = _Phase.RUNNING
                self._watchdog.track(att.id, ctx, lease.deadline)
        self._notify()
        if not may_run:
            if not started:
                ctx._log.info("not started (lease %s, active=%s)", lease.state, lease.active)
                return
            reason = ctx.cancel_reason or ("lease_lost" if not lease.active else "lease_expired")
            verdict = not_run(cancel_requested=ctx.cancel_requested, reason=reason)
            ctx._log.info("started but not run (%s): finishing %s", reason, verdict.outcome)
        else:
            verdict = self._execute(att)
            self._watchdog.untrack(att.id)
        with att.lock:
            if att.abandoned:
                ctx._log.warning(
                    "handler returned after shutdown finished it UNKNOWN; its result is dropped"
                )
                return
            att.phase = _Phase.FINISHING
        self._notify()
        self._finish(att, verdict)

    def _execute(self, att: _Attempt) -> Verdict:
        ctx = att.ctx
        with self._cond:
            self._running += 1
        error: BaseException | None = None
        value: Any = None
        hooks = self._hooks
        if hooks:
            hooks.emit("attempt_started", _event(att))
        began = time.perf_counter()
        try:
            value = hooks.call_handler(att.handler, ctx) if hooks else att.handler(ctx, ctx.payload)
        except BaseException as exc:  # every ending is an outcome; the thread must survive
            error = exc
        finally:
            duration = time.perf_counter() - began
            with self._cond:
                self._running -= 1
        verdict = outcome_of(
            value=value,
            error=error,
            cancel_requested=ctx.cancel_requested,
            cancel_reason=ctx.cancel_reason,
            encoder=self._encoder,
            duration=duration,
        )
        if verdict.error_code == HANDLER_ERROR and error is not None:
            # The traceback stays local: only the exception's type goes to the server.
            ctx._log.error("handler raised %s", type(error).__name__, exc_info=error)
        elif verdict.problem is not None:
            # The handler's side effects happened; only its result cannot travel. Say where.
            ctx._log.error(
                "handler %s: result cannot be sent, finishing %s %s: %s",
                att.task.handler,
                verdict.outcome,
                verdict.error_code,
                verdict.problem,
            )
        elif verdict.outcome is not Outcome.SUCCEEDED:
            ctx._log.info("handler ended %s (%s)", verdict.outcome, verdict.error_code)
        return verdict

    def _finish(self, att: _Attempt, verdict: Verdict) -> None:
        delivered = self._deliver(att, verdict)
        if self._hooks:
            self._hooks.emit("attempt_finished", _finished(att, verdict, delivered))

    def _deliver(self, att: _Attempt, verdict: Verdict) -> bool:
        """Send *verdict*'s finish until it is answered; True when the server accepted it."""
        finish = verdict.finish(att.ref)
        message_id = new_message_id()
        try:
            result = self._call(
                lambda c: c.finish(finish, message_id=message_id, timeout=self._call_timeout)
            )
        except GaveUp:
            with self._cond:
                self._unreported.append(att.info)
            att.ctx._log.error("finish %s not delivered: the worker stopped", verdict.outcome)
            return False
        except OrbitError as exc:
            with self._cond:
                self._counts["finish_rejected"] += 1
            att.ctx._log.error("finish %s refused (%s)", verdict.outcome, getattr(exc, "code", exc))
            return False
        evidence = result.receipt.disposition is Disposition.EVIDENCE_ONLY
        with self._cond:
            self._counts[verdict.outcome.value] += 1
            if evidence:
                self._counts["evidence_only"] += 1
        att.ctx._log.info(
            "handler %s finished %s%s%s%s",
            att.task.handler,
            verdict.outcome,
            "" if verdict.duration is None else f" in {verdict.duration:.3f}s",
            " (kept as evidence only)" if evidence else "",
            " (deduplicated)" if result.deduplicated else "",
        )
        return True

    def _settle(self, att: _Attempt) -> None:
        with att.lock:
            att.phase = _Phase.SETTLED
        with self._cond:
            self._attempts.pop(att.id, None)
            self._cond.notify_all()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _call(self, fn: Callable[[Connection], T]) -> T:
        """Send one operation until it is answered, re-sending it (same ``message_id``, bound
        in *fn*) on each newer connection after a connection failure."""
        newer_than = 0
        while True:
            conn, gen = self._link.wait(newer_than=newer_than)
            try:
                return self._gated(partial(fn, conn))
            except OrbitError as exc:
                if is_link_failure(exc):
                    newer_than = gen
                    self._link.broken(gen)
                    continue
                if is_transient(exc):
                    self._link.pause(
                        _BUSY_DELAY if isinstance(exc, WorkerBusy) else self._retry_delay
                    )
                    continue
                raise

    def _gated(self, fn: Callable[[], T]) -> T:
        """Run one handler-side request (start/finish) under the in-flight bound."""
        while not self._gate.acquire(timeout=_POLL):
            if self._link.is_closed():
                raise GaveUp("worker stopped")
        try:
            return fn()
        finally:
            self._gate.release()

    def _on_renewed(self, attempt_id: str, lag: float) -> None:
        if self._hooks:
            with self._cond:
                att = self._attempts.get(attempt_id)
            if att is not None:
                self._hooks.emit("lease_renewed", _lease_event(att, lag=lag))

    def _on_lease_lost(self, attempt_id: str, reason: str) -> None:
        if self._hooks and reason != "cancel_requested":
            with self._cond:
                att = self._attempts.get(attempt_id)
            if att is not None:
                self._hooks.emit("lease_lost", _lease_event(att, reason=reason))

    def _renew(self, attempt_id: str, message_id: str) -> Lease:
        """The watchdog's renew function: one try on the current connection, never waiting."""
        with self._cond:
            att = self._attempts.get(attempt_id)
        if att is None:
            raise NotConnected("attempt is no longer tracked")
        current = self._link.current()
        if current is None:
            raise NotConnected("no connection")
        conn, gen = current
        # A slow answer must not stall every other attempt's renewal (one watchdog thread).
        timeout = min(self._call_timeout, max(1.0, att.ctx.remaining() / 2))
        try:
            return conn.renew(att.ref, message_id=message_id, timeout=timeout).lease
        except OrbitError as exc:
            if is_link_failure(exc):
                self._link.broken(gen)
            raise

    # ------------------------------------------------------------------ shutdown

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
        self.request_stop(drain=False)
        self._link.close()

    def _wait_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait (on the worker's condition) until *done()* or *deadline*; return *done()*."""
        with self._cond:
            while not done():
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def _supervisor_main(self) -> None:
        with self._cond:
            while not self._stop_requested:
                self._cond.wait()
        try:
            report = self._shutdown()
        except BaseException as exc:  # never leave stop() waiting forever
            self._log.exception("worker shutdown failed")
            report = ShutdownReport(drained=False, error=exc)
        self._report = report
        if self._hooks:
            self._hooks.emit("stopped", report)
        self._done.set()
        atexit.unregister(self._at_exit)
        self._log.info(
            "worker stopped: drained=%s cancelled=%d abandoned=%d unreported=%d",
            report.drained,
            len(report.cancelled),
            len(report.abandoned),
            len(report.unreported),
        )

    def _live(self, *phases: _Phase) -> list[_Attempt]:
        with self._cond:
            return [a for a in self._attempts.values() if a.phase in phases]

    def _shutdown(self) -> ShutdownReport:
        # 0. Tell the server (drain: true) so it assigns nothing more; best effort, bounded.
        if self._link.current() is not None:
            self._drain_acked.wait(_DRAIN_REPORT_WAIT)
        # 1. Drain: running handlers keep their leases renewed until they return or time is up.
        with self._cond:
            while self._attempts:
                remaining = self._drain_deadline - self._clock()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            drained = not self._attempts

        # 2. Cancel what is still running, and give it a grace period to return.
        cancelled: list[_Attempt] = []
        for att in self._live(_Phase.STARTING, _Phase.RUNNING):
            att.ctx._cancel("shutdown")
            if att.phase is _Phase.RUNNING:
                cancelled.append(att)
        self._wait_until(
            lambda: not any(a.phase is _Phase.RUNNING for a in self._attempts.values()),
            self._clock() + self._cancel_grace,
        )

        # 3. Abandon handlers that ignore cancellation: their effect is uncertain (UNKNOWN).
        gave_up: list[_Attempt] = []
        for att in self._live(_Phase.RUNNING):
            with att.lock:
                if att.phase is not _Phase.RUNNING:
                    continue
                att.abandoned = True
                att.phase = _Phase.FINISHING
            self._watchdog.untrack(att.id)
            att.ctx._log.error("handler ignored cancellation at shutdown: finishing UNKNOWN")
            gave_up.append(att)
            threading.Thread(
                target=self._finish_abandoned, args=(att,), name="orbit-finish", daemon=True
            ).start()

        # 4. Flush: finishes waiting for a connection get a bounded time to be delivered.
        self._wait_until(lambda: not self._attempts, self._clock() + self._flush_timeout)

        # 5. Close: every remaining waiter gives up; the threads wind down.
        current = self._link.current()
        self._link.close()
        if current is not None:
            current[0].close()
        self._wait_until(lambda: not self._attempts, self._clock() + 1.0)
        self._watchdog_thread.stop(timeout=2.0)
        self._pool.shutdown(timeout=0.5)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self._dial_timeout + 1.0)
        with self._cond:
            unreported = tuple(self._unreported)
            error = self._error
        return ShutdownReport(
            drained=drained,
            cancelled=tuple(a.info for a in cancelled if not a.abandoned),
            abandoned=tuple(a.info for a in gave_up),
            unreported=unreported,
            error=error,
        )

    def _finish_abandoned(self, att: _Attempt) -> None:
        try:
            self._finish(att, abandoned())
        finally:
            self._settle(att)
