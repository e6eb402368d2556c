"""Worker: the public class, its lifecycle (start, run, stop) and registration; it builds the
parts (docs/architecture.md names them, their threads and owners) and keeps what it needs."""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, TypeVar

import attrs
import cattrs

from .._seconds import seconds
from ..client import DialCut, queue_id_from_env
from ..clock import Clock
from ..models import Outcome, Registration
from ._context import Handler
from ._listeners import DrainEvent, ShutdownReport, WorkerStats
from ._options import WorkerOptions
from ._signals import StopSignals, announce
from .core._redial import Backoff
from .core._time_limits import WORKER_DEFAULT, HandlerLimit
from .outbox._outbox import Outbox
from .runtime._handlers import Handlers, HandlerSettings
from .runtime._link import Dialer, Intake, Link, Wakeup
from .runtime._pool import HandlerThreads
from .runtime._registry import LinkControls, Registry, WorkerThreads
from .runtime._renewals import Renewals
from .runtime._shell import AttemptShell
from .runtime._shutdown import Shutdown
from .runtime._watchdog import LeaseWatchdog, Timers, WatchdogThread
from .session._replay import replay_until_done
from .session._session_loop import SessionLoop

__all__ = ["Handler", "Worker"]

H = TypeVar("H", bound=Handler)


class Worker:
    """Runs registered handlers for the tasks of one queue.

    ::

        worker = Worker(client, queue_id=Q, capacity=8)

        @worker.handler("resize", version="1", payload_version="1")
        def resize(ctx: TaskContext, payload: dict) -> dict:
            ctx.raise_if_cancelled()
            return {"resized": True}

        worker.run()   # blocks; SIGTERM/SIGINT drain, a second signal stops at once

    All keywords are checked first, as a :class:`~orbit_sync.worker.WorkerOptions` (a wrong one
    raises ``TypeError`` or ``ValueError`` naming it); :attr:`options` returns them and
    :meth:`from_options` builds a Worker from one. In short (README "Running a worker", ``docs/``):

    - *queue_id*: the queue served (left out: ``$ORBIT_QUEUE_ID``, else ``SettingError``).
    - *capacity* (1-256): the handlers run at once, and the capacity reported to the server.
    - *drain_timeout*: on stop, the seconds running handlers get to return, leases renewed;
      *cancel_grace*: then, cancelled, before they finish ``UNKNOWN`` (keep it under half the lease
      window: cancelled attempts are not renewed); *flush_timeout*: then, for unsent finishes.
    - *reconnect_backoff*: the wait before each reconnect (exponential, jittered, bounded).
    - *first_connect_timeout*: stop (``ServerUnreachable``) if not connected that long after start.
    - *dial_timeout*, *call_timeout*: bound one dial, one request (re-sent on the next connection).
    - *max_in_flight* (3-32, default 32): requests outstanding at once, a quarter for renewals.
    - *renew_retry_delay* (0.1-5 s): the spacing of retries of a failed renewal.
    - *cancellation_notifications*: ask for ``task.cancel`` pushes; *handle_signals*: :meth:`run`
      on the main thread handles SIGTERM/SIGINT.
    - *logger*: the worker's logs (default ``orbit_sync.worker``; ``docs/observability.md``).
    - *result_converter*: the cattrs converter that encodes results (``docs/results.md``).
    - *listeners*: :class:`~orbit_sync.worker.WorkerListener` objects (see :meth:`add_listener`).
    - *clock*: the worker's time, an :class:`orbit_sync.Clock` (tests pass a ``ManualClock``).
    - *process_pool*, *process_max_tasks_per_child*, *process_max_memory_per_child*: how many
      child processes run ``executor="process"`` handlers, and the attempts or RSS in MB after
      which one is replaced (``docs/process-executor.md``).
    - *outbox*: a file path: a durable outbox, so a killed process loses no result (docs/outbox.md).
    - *time_limit*: the seconds a handler may run, unless registered with its own (default: none).
    - *batch_scheduling*: on Linux, run the handler threads and the intake under ``SCHED_BATCH``
      (off by default: the worker changes no scheduling policy of a thread that runs your code;
      ``docs/deploy.md`` says what it saves and what it costs).
    """

    def __init__(
        self,
        client: Dialer,
        *,
        queue_id: str | None = None,
        capacity: int = 8,
        drain_timeout: float = 30.0,
        cancel_grace: float = 5.0,
        flush_timeout: float = 10.0,
        reconnect_backoff: Backoff | None = None,
        renew_retry_delay: float = 1.0,
        cancellation_notifications: bool = True,
        dial_timeout: float = 8.0,
        call_timeout: float = 10.0,
        max_in_flight: int | None = None,
        handle_signals: bool = True,
        logger: logging.Logger | None = None,
        result_converter: cattrs.BaseConverter | None = None,
        listeners: Iterable[object] = (),
        clock: Clock | None = None,
        process_pool: int | None = None,
        process_max_tasks_per_child: int | None = None,
        process_max_memory_per_child: int | None = None,
        outbox: str | os.PathLike[str] | None = None,
        time_limit: float | None = None,
        first_connect_timeout: float | None = None,
        batch_scheduling: bool = False,
    ) -> None:
        # Each keyword by name (not locals()), so mypy checks every one against WorkerOptions.
        options = WorkerOptions(
            # Resolved once: options and with_options() then name the queue this worker serves.
            queue_id=queue_id_from_env() if queue_id is None else queue_id,
            capacity=capacity,
            drain_timeout=drain_timeout,
            cancel_grace=cancel_grace,
            flush_timeout=flush_timeout,
            reconnect_backoff=reconnect_backoff,
            renew_retry_delay=renew_retry_delay,
            cancellation_notifications=cancellation_notifications,
            dial_timeout=dial_timeout,
            call_timeout=call_timeout,
            max_in_flight=max_in_flight,
            handle_signals=handle_signals,
            logger=logger,
            result_converter=result_converter,
            listeners=listeners,
            clock=clock,
            process_pool=process_pool,
            process_max_tasks_per_child=process_max_tasks_per_child,
            process_max_memory_per_child=process_max_memory_per_child,
            outbox=outbox,
            time_limit=time_limit,
            first_connect_timeout=first_connect_timeout,
            batch_scheduling=batch_scheduling,
        )
        self._build(client, options)

    @classmethod
    def from_options(cls, client: Dialer, options: WorkerOptions) -> Worker:
        """A Worker for *client* with *options* (a :class:`WorkerOptions`, e.g. evolved from another
        worker's ``options``); the same as passing each as a keyword."""
        if not isinstance(options, WorkerOptions):
            raise TypeError("options must be an orbit_sync.worker.WorkerOptions")
        worker = cls.__new__(cls)
        worker._build(client, options)
        return worker

    def _build(self, client: Dialer, options: WorkerOptions) -> None:
        """Build the parts, each after what it uses (nothing runs yet)."""
        self._options = opts = options
        self._client = client
        clock = opts.clock
        self._reg = Registry()
        self._registered = Handlers(self._reg.lock, opts, lambda: self._started)
        self._started = False
        self._done = threading.Event()
        self._report: ShutdownReport | None = None
        #: run()'s signal handling, while run() waits in it on the main thread.
        self._signals: StopSignals | None = None

        self._controls = LinkControls(
            Link(clock, slots=opts.handler_slots), Wakeup(clock), DialCut()
        )
        # Wakes the watchdog's thread: a lease tracked or renewed, a time limit set.
        watchdog_wake = Wakeup(clock)
        self._watchdog = LeaseWatchdog(
            lambda renewals: self._renewals.send(renewals),
            clock=clock.now,
            on_change=watchdog_wake.set,
            logger=opts.logger,
            cautious_start=True,
        )
        # The handlers' time limits, run by the watchdog's thread.
        timers = Timers(clock.now, watchdog_wake.set)
        intake = Intake()  # the connection whose assignments the handler threads take
        pool = HandlerThreads(
            opts.capacity,
            intake,
            lambda c, a: self._sessions.take(c, a),
            batch=opts.batch_scheduling,
        )
        self._threads = WorkerThreads(
            pool, WatchdogThread(self._watchdog, wake=watchdog_wake, timers=timers), timers
        )
        self._shell = AttemptShell(
            self._reg,
            opts,
            controls=self._controls,
            threads=self._threads,
            handlers=self._registered,
        )
        self._hooks = self._shell.hooks
        # Listeners never run on a connection's reader: what it decides is told on the watchdog's.
        self._hooks.elsewhere = self._threads.watchdog.run_soon
        self._watchdog.report_to(self._shell.renew_answered)
        # Renewals on the wire: one write per batch, each answer waking the watchdog's thread.
        self._renewals = Renewals(
            self._reg, self._controls.link, opts.request_timeout, watchdog_wake
        )
        self._threads.watchdog.answers = self._renewals.answered
        self._sessions = SessionLoop(client, self._shell, intake, fail=self._fail)
        self._shutdown = Shutdown(
            self._shell, assignments_over=self._sessions.assignments_over, stopped=self._stopped
        )

    def handler(
        self,
        name: str,
        *,
        version: str | int = "1",
        payload_version: str | int = "1",
        executor: str = "thread",
        memory_limit: int | None = None,
        memory_limit_retryable: bool = False,
        time_limit: HandlerLimit = WORKER_DEFAULT,
        time_limit_retryable: bool = False,
    ) -> Callable[[H], H]:
        """Register the decorated function for (*name*, *version*, *payload_version*), called as
        ``fn(ctx, payload)``, as ``@worker.handler("resize")`` (a bare ``@worker.handler`` raises
        ``TypeError``).

        - *executor*: ``"thread"`` (a pool thread) or ``"process"`` (a child process of the
          worker's process pool: ``docs/process-executor.md``).
        - *memory_limit* (MB, process handlers): what one attempt may allocate; past it the
          attempt ends ``FAILED`` ``HANDLER_MEMORY_LIMIT``, retryable when *memory_limit_retryable*.
        - *time_limit* (seconds; default: the worker's ``time_limit``; ``None``: no limit): one
          run's bound, past which the handler is cancelled and interrupted and ends
          ``HANDLER_TIMEOUT``, retryable when *time_limit_retryable* (README, "Time limits").
        """
        if callable(name) and not isinstance(name, str):
            raise TypeError(
                'worker.handler needs the handler\'s name: use @worker.handler("name"), '
                "not a bare @worker.handler"
            )

        settings = HandlerSettings(
            version=version,
            payload_version=payload_version,
            executor=executor,
            memory_limit=memory_limit,
            memory_limit_retryable=memory_limit_retryable,
            time_limit=time_limit,
            time_limit_retryable=time_limit_retryable,
        )

        def register(fn: H) -> H:
            self._registered.add(name, fn, settings)
            return fn

        return register

    def register(
        self,
        name: str,
        fn: Handler,
        *,
        version: str | int = "1",
        payload_version: str | int = "1",
        executor: str = "thread",
        memory_limit: int | None = None,
        memory_limit_retryable: bool = False,
        time_limit: HandlerLimit = WORKER_DEFAULT,
        time_limit_retryable: bool = False,
    ) -> None:
        """Register *fn* as a handler (the non-decorator form of :meth:`handler`).

        Raises ``TypeError`` when *fn* cannot be called as ``fn(ctx, payload)``, or, with
        ``executor="process"``, when it cannot be sent to a child process by reference (a lambda
        or nested function; whether its module binds its name is checked by :meth:`start`).
        """
        settings = HandlerSettings(
            version=version,
            payload_version=payload_version,
            executor=executor,
            memory_limit=memory_limit,
            memory_limit_retryable=memory_limit_retryable,
            time_limit=time_limit,
            time_limit_retryable=time_limit_retryable,
        )
        self._registered.add(name, fn, settings)

    @property
    def options(self) -> WorkerOptions:
        """The options this worker was built with, a frozen :class:`WorkerOptions` (reading them
        as a dict, ``options["capacity"]``, is deprecated: it warns until the next release)."""
        return self._options

    @property
    def client(self) -> Dialer:
        """The client this worker dials its server with."""
        return self._client

    @property
    def listeners(self) -> tuple[object, ...]:
        """The listeners subscribed now: those of the options, then :meth:`add_listener`'s."""
        return self._hooks.listeners

    @property
    def executors(self) -> dict[tuple[str, str, str], str]:
        """Each registered handler's executor (``"thread"``/``"process"``), by (name, handler
        version, payload version) (a copy)."""
        return {key: settings.executor for key, _, settings in self._registered.specs()}

    @property
    def time_limits(self) -> dict[tuple[str, str, str], float | None]:
        """Each registered handler's time limit in seconds (its own, or the worker's
        ``time_limit``; ``None``: none), by (name, handler version, payload version) (a copy)."""
        return self._registered.time_limits()

    def with_options(self, **changes: Any) -> Worker:
        """A new, unstarted Worker with this one's handlers and options but *changes* (e.g.
        ``capacity=4``, ``client=Client(...)``, by ``attrs.evolve``); ``orbit-sync worker``
        applies its command-line options to a module's Worker with it."""
        client = changes.pop("client", self._client)
        # Listeners added with add_listener() (a health probe, metrics) come along too.
        options = attrs.evolve(self._options, **{"listeners": self.listeners, **changes})
        worker = Worker.from_options(client, options)
        for key, fn, settings in self._registered.specs():
            worker._registered.add(key[0], fn, settings)
        return worker

    @property
    def registration(self) -> Registration:
        """The ``worker.hello`` body this worker sends (secrets are redacted in its repr)."""
        return self._registered.registration()

    def add_listener(self, listener: object) -> None:
        """Subscribe *listener* (a :class:`~orbit_sync.worker.WorkerListener`) to this worker's
        events; safe at any time, from any thread. A listener that raises is logged and skipped."""
        self._hooks.add(listener)

    def start(self) -> Worker:
        """Start in the background and return at once (see :meth:`wait_ready`, :meth:`stop`)."""
        registration = self.registration
        self._registered.bind()
        with self._reg.lock:
            if self._started:
                raise RuntimeError("a Worker can be started only once")
            self._started = True
        self._options.logger.info(
            "worker starting: queue %s, capacity %d, handlers %s",
            registration.queue_id,
            registration.capacity,
            ", ".join(f"{c.handler}@{c.handler_version}" for c in registration.capabilities),
        )
        targets = [
            (self._sessions.run, "orbit-worker-connection"),
            (self._shutdown.run, "orbit-worker-shutdown"),
        ]
        if self._options.outbox is not None:
            # Opened here, not in _build: a process-executor child imports the module that builds
            # the Worker and must not contend for the parent's outbox lock. OutboxError (a file we
            # must not use) is raised before anything is sent.
            try:
                outbox = Outbox.open(self._options.outbox, registration)
            except BaseException:
                with self._reg.lock:
                    self._started = False  # nothing ran: a later start() may try again
                raise
            self._shell.outbox = outbox
            if self._registered.processes is not None:
                self._registered.processes.guard(outbox.lock_path, self._registered.instance_id)
            replay = partial(
                replay_until_done,
                outbox,
                self._client,
                link=self._controls.link,
                exclude=self._registered.instance_id,
                options=self._options,
            )
            targets.append((replay, "orbit-worker-outbox"))
        self._threads.watchdog.start()
        self._threads.pool.start()
        for target, name in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            self._threads.started.append(thread)
            thread.start()
        # Daemon threads die abruptly at interpreter exit; stop cleanly first if nobody did.
        atexit.register(self._at_exit)
        return self

    def run(self) -> ShutdownReport:
        """Run until stopped; return the shutdown report (raise the error that stopped it).

        On the main thread, SIGTERM and SIGINT drain (``stop(drain=True)``); a second signal
        stops at once (``stop(drain=False)``). The previous handlers are restored on return.
        """
        signals = None
        if self._options.handle_signals and threading.current_thread() is threading.main_thread():
            signals = self._signals = StopSignals(self._on_stop_signal)
        try:
            self.start()
            # Unbounded until a stop is asked for; then the shutdown's alarm bounds the wait.
            signals.wait(self._done) if signals is not None else self._done.wait()
        except KeyboardInterrupt:
            self.request_stop(drain=False)
            self._done.wait()
        finally:
            if signals is not None:
                signals.restore()
        report = self._report
        assert report is not None
        if report.error is not None:
            raise report.error
        return report

    def _on_stop_signal(self, number: int, count: int) -> None:
        with self._reg.lock:
            running = len(self._reg.attempts)
        opts = self._options
        announce(opts.logger, number, count=count, running=running, drain=opts.drain_timeout)
        self.request_stop(drain=count == 1)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the first session is established; True when it is."""
        return self._sessions.ready.wait(timeout)

    def request_stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Ask the worker to stop and return at once (safe from handlers and signal-free code).

        With *drain*, running handlers get *timeout* (default ``drain_timeout``) seconds to
        return; without, their contexts are cancelled now. A later request can only shorten it.
        """
        if timeout is not None:
            timeout = seconds(timeout, "timeout")
        with self._reg.lock:
            if not self._started:
                return
            now = self._options.clock.now()
            window = self._drain_window(drain, timeout)
            first = not self._reg.stop_requested
            if first:
                self._reg.stop_requested = True
                self._reg.drain_deadline = now + window
                self._options.logger.info(
                    "worker stopping (%s)", f"draining for {window:g}s" if drain else "now"
                )
            elif now + window < self._reg.drain_deadline:
                self._reg.drain_deadline = now + window
                self._options.logger.info("worker stop escalated: cancelling handlers now")
            self._reg.cond.notify_all()
        self._sessions.report_drain()
        if first and self._hooks:
            self._hooks.emit("draining", DrainEvent(drain, window, self._reg.running))

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> ShutdownReport:
        """Stop (draining for *timeout* seconds) and return the shutdown report.

        Safe to call again, and from any thread but the worker's own (use :meth:`request_stop`
        from a handler). Returns within ``timeout + cancel_grace + flush_timeout`` (``timeout``
        0 when not draining) plus half a second, in real time whatever *clock* does (give or
        take a second: what was not delivered by then is reported ``unreported``); a dial in
        progress is cut. See the README's "Shutdown" and ``docs/architecture.md``.
        """
        with self._reg.lock:  # a worker stopped before it ran cannot start any more
            started, self._started = self._started, True
        if not started:
            self._report = ShutdownReport(drained=True)
            self._done.set()
            return self._report
        if self._threads.owns_current():
            raise RuntimeError("stop() would wait for itself here; use request_stop()")
        self.request_stop(drain=drain, timeout=timeout)
        window = self._drain_window(drain, timeout)
        report = self._shutdown.await_report(window, self._done, lambda: self._report)
        with self._reg.lock:
            self._report = self._report or report
            return self._report

    def _drain_window(self, drain: bool, timeout: float | None) -> float:
        """How long running handlers get to return (none when they do not drain)."""
        if not drain:
            return 0.0
        return self._options.drain_timeout if timeout is None else timeout

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _at_exit(self) -> None:
        if not self._done.is_set():
            self.stop(drain=False)

    def stats(self) -> WorkerStats:
        """A snapshot of the worker's counters."""
        wd = self._watchdog.stats()
        with self._reg.lock:
            counts = self._reg.counts.copy()
            running = self._reg.running
            stuck = len(self._reg.stuck)
        return WorkerStats(
            connected=self._controls.link.current() is not None,
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
            lease_losses=counts["lease_losses"],
            reconnects=counts["reconnects"],
            dial_failures=counts["dial_failures"],
            skipped_assignments=counts["skipped"],
            stuck=stuck,
        )

    def __repr__(self) -> str:
        state = "stopped" if self._done.is_set() else "running" if self._started else "new"
        opts = self._options
        return f"<Worker queue={opts.queue_id} capacity={opts.capacity} {state}>"

    def _fail(self, exc: BaseException) -> None:
        with self._reg.lock:
            if self._reg.error is None:
                self._reg.error = exc
        self.request_stop(drain=False)
        self._controls.close_link()
        self._controls.wake.set()

    def _stopped(self, report: ShutdownReport) -> None:
        """The shutdown thread's last step: tell the listeners the final *report*, wake waiters."""
        with self._reg.lock:
            self._report = self._report or report  # stop() may have given up and reported
        self._hooks.emit("stopped", report)
        self._done.set()
        if self._signals is not None:
            self._signals.wake()
        atexit.unregister(self._at_exit)
