"""Worker: the public class, its lifecycle (start, run, stop), registration and the assignments'
admission; the rest lives in modules of one concern each (docs/architecture.md). Over 600 lines
because the public surface is here: the class and method docstrings and the constructor's
signature are about half of it; the machinery is in:

- :mod:`._options`: every option, checked once;
- :mod:`._session`: the connection thread (dial, reconcile, capacity, serve, reconnect);
- :mod:`._attempt`: one attempt's pure state machine; :mod:`._attempts`: its threaded shell;
- :mod:`._renewals` / :mod:`._watchdog`: lease renewals; :mod:`._outbox` / :mod:`._replay`:
  the durable outbox; :mod:`._signals`: SIGTERM/SIGINT for :meth:`Worker.run`;
- :mod:`._shutdown`: the bounded shutdown phases (this module adds the last one, close).

Threads (all daemons, so the process can always exit; each ends when the link is closed or its
wait's deadline passes):

- ``orbit-worker-connection`` (:mod:`._session`), and per session ``orbit-worker-watch``, which
  turns "the connection ended" into a wake-up of it (joined by it when the session ends);
- ``orbit-sync-reader-*`` (the connection's own): hands each assignment to
  :meth:`Worker._dispatch`, which records it and sends its start (never blocking), and handles
  every answer (:mod:`._attempts`);
- ``orbit-handler-N`` (:mod:`._pool`, up to ``capacity``): run handlers and send their
  finishes, and the outbox writes and listeners of answers;
- ``orbit-lease-watchdog``: renews running attempts (:mod:`._watchdog`);
- ``orbit-worker-outbox`` (with an outbox): delivers what earlier processes left (:mod:`._replay`);
- ``orbit-worker-supervisor``: waits for a stop request, then drains and shuts down in bounded
  phases (drain → cancel → abandon → flush → close), joining the threads above.
"""

from __future__ import annotations

import atexit
import collections
import inspect
import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import cattrs

from ..client import DialCut
from ..clock import Clock, WorkerClock
from ..errors import OrbitError
from ..models import (
    Assignment,
    CancelNotice,
    Capability,
    Outcome,
    Registration,
    new_id,
    new_secret,
)
from ._attempt import (
    AttemptMachine,
)
from ._attempts import (
    Attempt,
    AttemptShell,
    Handler,
    Registry,
    attempt_event,
)
from ._backoff import Backoff
from ._clock import Wakeup
from ._context import TaskContext, task_logger
from ._encoding import DEFAULT_ENCODER, ResultEncoder
from ._hooks import (
    DrainEvent,
    Hooks,
)
from ._link import Dialer, Link
from ._options import WorkerOptions, check_seconds
from ._outbox import Outbox
from ._pool import DaemonPool
from ._process import ProcessHandler, ProcessPool, check_process_handler
from ._process_limits import ChildLimits, MemoryLimited
from ._renewals import Renewals
from ._replay import replay
from ._report import ShutdownReport, WorkerStats
from ._session import SessionLoop
from ._shutdown import CLOSE_ALLOWANCE, AttemptPhases
from ._signals import StopSignals
from ._watchdog import LeaseWatchdog, WatchdogThread

__all__ = ["Handler", "Worker"]

T = TypeVar("T")
H = TypeVar("H", bound=Handler)

_LOG = logging.getLogger("orbit_sync.worker")

#: Attempt ids remembered to refuse a repeated assignment (a handler runs once per attempt).
_SEEN_LIMIT = 65_536


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


#: Every Worker of this process, so a forked child can give each a new identity.
_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # PROTOCOL §3: instance_id is new for every process. A child that kept its parent's identity
    # would fence it (or be fenced) with STALE_SESSION on every reconnect.
    for worker in list(_WORKERS):
        worker._new_identity()


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Worker:
    """Runs registered handlers for the tasks of one queue.

    ::

        worker = Worker(client, queue_id=Q, capacity=8)

        @worker.handler("resize", version="1", payload_version="1")
        def resize(ctx: TaskContext, payload: dict) -> dict:
            ctx.raise_if_cancelled()
            return {"resized": True}

        worker.run()   # blocks; SIGTERM/SIGINT drain, a second signal stops at once

    *capacity* (1-256) is the number of handlers run at once and the capacity reported to the
    server. On stop, running handlers get *drain_timeout* seconds to return (their leases are
    renewed meanwhile); then their contexts are cancelled (``shutdown``) and they get
    *cancel_grace* more; handlers still running are finished ``UNKNOWN`` with
    ``SHUTDOWN_TIMEOUT``; finishes still waiting for a connection get *flush_timeout*. Keep
    *cancel_grace* under half the lease window: cancelled attempts are no longer renewed.

    Connection: reconnects wait per *reconnect_backoff* (exponential, jittered, bounded);
    *dial_timeout* and *call_timeout* bound one dial and one request (after which the request is
    re-sent with its ``message_id`` on the next connection); *max_in_flight* (3-32, default 32)
    bounds the requests outstanding at once, of which a quarter (2 to 8) are kept for renewals,
    resumes and capacity reports;
    *renew_retry_delay* (0.1-5 s) spaces retries of a failed renewal. *cancellation_notifications*
    asks the server for ``task.cancel`` pushes. *handle_signals* lets :meth:`run` on the main
    thread handle SIGTERM/SIGINT. Logs go to *logger* (default ``orbit_sync.worker``);
    ``ctx.logger`` logs under ``orbit_sync.task.<handler>``.

    Handlers registered with ``executor="process"`` run in child processes (spawned lazily, at
    most *process_pool* of them, default one per CPU), so CPU-bound work neither holds the GIL
    against lease renewals nor shares the process with the connection: see
    ``docs/process-executor.md``. A child is replaced between attempts after
    *process_max_tasks_per_child* attempts, or when its RSS exceeds
    *process_max_memory_per_child* MB after one.

    With *outbox* (a file path), launches and finishes are committed to a durable SQLite
    outbox, so a process killed with ``kill -9`` loses no result: the next worker started with
    the same path delivers what it left (see ``docs/outbox.md``).

    Results are encoded by *result_converter* (a cattrs converter; default
    :func:`~orbit_sync.worker.result_converter`, which knows datetimes, ``Decimal``, ``UUID``,
    enums, attrs classes and dataclasses) when the handler returns. *listeners*
    (:class:`~orbit_sync.worker.WorkerListener`) observe attempts, leases and sessions; see also
    :meth:`add_listener`.

    *clock* (an :class:`orbit_sync.Clock`, the kind of object ``dial_worker`` takes) is the
    worker's time: lease deadlines, renewals, heartbeats, retry delays, the shutdown phases and
    idle handler threads run on it. Tests pass the mock server's
    :class:`~orbit_sync.testing.ManualClock` (or a :class:`~orbit_sync.testing.FakeClock`) to let
    those windows pass without sleeping.
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
    ) -> None:
        # First, before any other local exists: every constructor argument (see with_options).
        self._options: dict[str, Any] = {k: v for k, v in locals().items() if k != "self"}
        opts = WorkerOptions(**{k: v for k, v in self._options.items() if k != "client"})
        self._opts = opts
        self._client = client
        self._queue_id = opts.queue_id
        self._capacity = opts.capacity
        self._drain_timeout = opts.drain_timeout
        self._cancel_grace = opts.cancel_grace
        self._flush_timeout = opts.flush_timeout
        self._dial_timeout = opts.dial_timeout
        self._call_timeout = opts.request_timeout
        self._backoff = opts.reconnect_backoff or Backoff()
        self._retry_delay = float(opts.renew_retry_delay)
        self._notifications = opts.cancellation_notifications
        self._handle_signals = opts.handle_signals
        self._log = opts.logger or _LOG
        self._encoder = (
            DEFAULT_ENCODER
            if opts.result_converter is None
            else ResultEncoder(opts.result_converter)
        )
        self._time = opts.clock or WorkerClock()
        self._clock = self._time.now
        self._hooks = Hooks(listeners, logger=self._log)
        # instance_id is new for this Worker (so two Workers of one process never fence each
        # other); instance_secret is kept across all its reconnects (PROTOCOL §3). A forked
        # child gets new ones (_after_fork_in_child).
        self._instance_id = new_id()
        self._instance_secret = new_secret()
        _WORKERS.add(self)

        self._handlers: dict[tuple[str, str, str], Handler] = {}
        self._task_logs: dict[str, logging.Logger] = {}
        # The attempts and counters (the same objects as the registry's, named here for the
        # session and shutdown code that reads them).
        self._reg = Registry()
        self._cond = self._reg.cond
        self._attempts = self._reg.attempts
        self._counts = self._reg.counts
        self._unreported = self._reg.unreported
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._started = False
        self._drain_deadline = 0.0
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._report: ShutdownReport | None = None
        #: run()'s signal handling, while run() on the main thread waits in it.
        self._signals: StopSignals | None = None

        #: Wakes the connection thread: a new capacity report, the connection ended, shutdown.
        self._serve_wake = Wakeup(self._time)
        self._dial_cut = DialCut()

        self._link = Link(self._time, slots=opts.handler_slots)
        self._registration: Registration | None = None
        renewals = Renewals(self._reg, self._link, self._hooks, self._call_timeout)
        self._watchdog = LeaseWatchdog(
            renewals.send_renew,
            send_many=renewals.send_renews,
            clock=self._clock,
            retry_delay=self._retry_delay,
            on_change=lambda: self._watchdog_thread.wake(),
            on_renew=renewals.on_renewed,
            on_loss=renewals.on_lease_lost,
            logger=self._log,
        )
        self._watchdog_thread = WatchdogThread(self._watchdog, wake=Wakeup(self._time))
        self._pool = DaemonPool(opts.capacity, clock=self._time)
        self._shell = AttemptShell(
            self._reg,
            link=self._link,
            pool=self._pool,
            watchdog=self._watchdog,
            hooks=self._hooks,
            log=self._log,
            clock=self._clock,
            encoder=self._encoder,
            call_timeout=self._call_timeout,
            wake=self._serve_wake.set,
            instance_id=lambda: self._instance_id,
            own_thread=self._owns_current_thread,
        )
        self._phases = AttemptPhases(self._reg, self._time, self._shell)
        self._sessions = SessionLoop(
            client,
            registration=lambda: self.registration,
            capacity=opts.capacity,
            notifications=self._notifications,
            dial_timeout=self._dial_timeout,
            call_timeout=self._call_timeout,
            retry_delay=self._retry_delay,
            backoff=self._backoff,
            time=self._time,
            link=self._link,
            registry=self._reg,
            shell=self._shell,
            watchdog=self._watchdog,
            hooks=self._hooks,
            log=self._log,
            wake=self._serve_wake,
            ready=self._ready,
            dial_cut=self._dial_cut,
            on_cancel=self._on_cancel,
            on_assignment=self._dispatch,
            fail=self._fail,
        )
        # Child processes for handlers registered with executor="process"; none start before
        # the first such task. Sized apart from capacity: CPU-bound work wants about one per core.
        self._process_pool_size = opts.process_pool
        self._process_limits = ChildLimits(
            max_tasks=opts.process_max_tasks_per_child,
            max_memory_mb=opts.process_max_memory_per_child,
        )
        self._processes: ProcessPool | None = None
        # Opened by start(), not here: a process-executor child imports the module that builds
        # this Worker, and must not contend for the parent's outbox lock.
        self._outbox_path = opts.outbox
        self._outbox: Outbox | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ registration

    def handler(
        self,
        name: str,
        *,
        version: str | int = "1",
        payload_version: str | int = "1",
        executor: str = "thread",
        memory_limit: int | None = None,
        memory_limit_retryable: bool = False,
    ) -> Callable[[H], H]:
        """Register the decorated function for (*name*, *version*, *payload_version*).

        The function is called as ``fn(ctx, payload)`` on a pool thread, or, with
        ``executor="process"``, in a child process of the worker's process pool (see
        *process_pool*); there *memory_limit* (MB) bounds what one attempt may allocate: past
        it the attempt ends ``FAILED`` with ``HANDLER_MEMORY_LIMIT``, retryable when
        *memory_limit_retryable*. Use it with a name, ``@worker.handler("resize")``: the bare
        ``@worker.handler`` raises ``TypeError``.
        """
        if callable(name) and not isinstance(name, str):
            raise TypeError(
                'worker.handler needs the handler\'s name: use @worker.handler("name"), '
                "not a bare @worker.handler"
            )

        def register(fn: H) -> H:
            self.register(
                name,
                fn,
                version=version,
                payload_version=payload_version,
                executor=executor,
                memory_limit=memory_limit,
                memory_limit_retryable=memory_limit_retryable,
            )
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
    ) -> None:
        """Register *fn* as a handler (the non-decorator form of :meth:`handler`).

        Raises ``TypeError`` when *fn* cannot be called as ``fn(ctx, payload)``, or, with
        ``executor="process"``, when it cannot be sent to a child process by reference (a lambda
        or nested function; whether its module binds its name is checked by :meth:`start`).
        """
        if executor not in ("thread", "process"):
            raise ValueError('executor must be "thread" or "process"')
        _check_handler_signature(fn)
        if memory_limit is not None:
            if executor != "process":
                raise ValueError('memory_limit needs executor="process"')
            fn = MemoryLimited(fn, memory_limit, retryable=memory_limit_retryable)
        if executor == "process":
            check_process_handler(fn)
        cap = Capability(name, version, payload_version)  # validates the names
        key = (cap.handler, cap.handler_version, cap.payload_version)
        with self._cond:
            if self._started:
                raise RuntimeError("register handlers before the worker starts")
            if key in self._handlers:
                raise ValueError(
                    f"handler {name!r} version {key[1]}/{key[2]} is already registered"
                )
            if executor == "process":
                if self._processes is None:
                    size = self._process_pool_size or os.cpu_count() or 1
                    self._processes = ProcessPool(
                        size, cancel_grace=self._cancel_grace, limits=self._process_limits
                    )
                fn = ProcessHandler(fn, self._processes)
            self._handlers[key] = fn
            self._task_logs.setdefault(cap.handler, task_logger(cap.handler))

    @property
    def options(self) -> dict[str, Any]:
        """The keyword arguments this worker was constructed with (a copy)."""
        return dict(self._options)

    def with_options(self, **changes: Any) -> Worker:
        """A new, unstarted Worker with this one's handlers and constructor arguments, except
        *changes* (e.g. ``capacity=4``, ``client=Client(...)``); used by ``orbit-sync worker``
        to apply its command-line options to the Worker a module defines."""
        with self._cond:
            handlers = dict(self._handlers)
        # Listeners added with add_listener() (a health probe, metrics) come along too.
        worker = Worker(**{**self._options, "listeners": self._hooks.listeners, **changes})
        for (name, version, payload_version), fn in handlers.items():
            executor = "thread"
            if isinstance(fn, ProcessHandler):  # bound to this worker's pool: wrap it anew
                fn, executor = fn.fn, "process"
            worker.register(
                name, fn, version=version, payload_version=payload_version, executor=executor
            )
        return worker

    @property
    def registration(self) -> Registration:
        """The ``worker.hello`` body this worker sends (secrets are redacted in its repr)."""
        with self._cond:  # built once, by whichever thread asks first
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

    def _new_identity(self) -> None:
        """A new instance_id and instance_secret (in a forked child: a new process). No lock:
        the child has one thread, and a lock a parent's thread held is never released in it."""
        self._instance_id = new_id()
        self._instance_secret = new_secret()
        self._registration = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Worker:
        """Start in the background and return at once (see :meth:`wait_ready`, :meth:`stop`)."""
        registration = self.registration
        for fn in self._handlers.values():
            if isinstance(fn, ProcessHandler):
                fn.bind()  # by now the handler's module has bound its name (decorator form)
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
        if self._outbox_path is not None:
            try:
                # Raises OutboxError (before anything is sent) for a file we must not use.
                self._outbox = self._shell.outbox = Outbox.open(self._outbox_path, registration)
            except BaseException:
                with self._cond:
                    self._started = False  # nothing ran: a later start() may try again
                raise
            if self._processes is not None:
                self._processes.guard(self._outbox.lock_path, self._instance_id)
        self._watchdog_thread.start()
        targets = [
            (self._sessions.run, "orbit-worker-connection"),
            (self._supervisor_main, "orbit-worker-supervisor"),
        ]
        if self._outbox is not None:
            targets.append((self._replay_main, "orbit-worker-outbox"))
        for target, name in targets:
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
        signals = StopSignals(self._on_stop_signal) if install else None
        if signals is not None:
            signals.install()
            self._signals = signals
        try:
            self.start()
            if signals is not None:
                signals.wait(self._done)
            else:
                self._done.wait()
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
        self._announce_signal(number, first=count == 1)
        self.request_stop(drain=count == 1)

    def _announce_signal(self, number: int, *, first: bool) -> None:
        # WARNING, so that an operator sees at the default level what a signal started and how to
        # cut it short (a supervisor's stop timeout may be shorter than the drain).
        name = signal.Signals(number).name
        with self._cond:
            running = len(self._attempts)
        tasks = f"{running} task{'' if running == 1 else 's'}"
        if first:
            self._log.warning(
                "%s received: draining %s (up to %gs), %s again to stop now",
                name,
                tasks,
                self._drain_timeout,
                name,
            )
        else:
            self._log.warning("%s received again: stopping now, cancelling %s", name, tasks)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the first session is established; True when it is."""
        return self._ready.wait(timeout)

    def request_stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Ask the worker to stop and return at once (safe from handlers and signal-free code).

        With *drain*, running handlers get *timeout* (default ``drain_timeout``) seconds to
        return; without, their contexts are cancelled now. A later request can only shorten it.
        """
        if timeout is not None:
            timeout = check_seconds("timeout", timeout)
        with self._cond:
            if not self._started:
                return
            now = self._clock()
            window = (self._drain_timeout if timeout is None else timeout) if drain else 0.0
            first = not self._reg.stop_requested
            if first:
                self._reg.stop_requested = True
                self._drain_deadline = now + window
                self._log.info(
                    "worker stopping (%s)", f"draining for {window:g}s" if drain else "now"
                )
            elif now + window < self._drain_deadline:
                self._drain_deadline = now + window
                self._log.info("worker stop escalated: cancelling handlers now")
            self._cond.notify_all()
        self._sessions.report_drain()
        if first and self._hooks:
            self._hooks.emit("draining", DrainEvent(drain, window, self._reg.running))

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> ShutdownReport:
        """Stop (draining for *timeout* seconds) and return the shutdown report.

        Safe to call again, and from any thread but the worker's own (use :meth:`request_stop`
        from a handler). Returns after at most ``timeout + cancel_grace + flush_timeout`` (with
        ``timeout`` 0 when not draining), plus up to half a second for the worker's threads to
        exit once their connection is closed; a dial in progress is cut.
        """
        with self._cond:
            started = self._started
            if not started:
                self._started = True  # a worker that never ran cannot start any more
        if not started:
            self._report = ShutdownReport(drained=True)
            self._done.set()
            return self._report
        if self._owns_current_thread():
            raise RuntimeError("stop() would wait for itself here; use request_stop()")
        self.request_stop(drain=drain, timeout=timeout)
        self._done.wait()
        assert self._report is not None
        return self._report

    def _owns_current_thread(self) -> bool:
        """Is this one of the worker's own threads (not a connection's or the user's)?"""
        current = threading.current_thread()
        return current in self._threads or self._pool.owns_current_thread()

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
            running = self._reg.running
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
            dial_failures=counts["dial_failures"],
            skipped_assignments=counts["skipped"],
        )

    def __repr__(self) -> str:
        state = "stopped" if self._done.is_set() else "running" if self._started else "new"
        return f"<Worker queue={self._queue_id} capacity={self._capacity} {state}>"

    # ------------------------------------------------------------------ dispatch

    def _on_cancel(self, notice: CancelNotice) -> None:
        # Runs on the connection's reader thread: only flag the context, never block.
        with self._cond:
            att = self._attempts.get(notice.attempt_id)
        if att is None or att.ref.epoch != notice.epoch:
            return
        if att.ctx._cancel("cancel_requested"):
            att.ctx._log.info("cancel requested by the server")

    def _dispatch(self, assignment: Assignment) -> None:
        # Runs on the connection's reader thread (on_assignment): it must never block nor wait
        # for an answer. It takes the worker's lock (never held across a wait for the network),
        # records the attempt and sends its start pipelined (or queues it for a request slot).
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
            if self._reg.stop_requested or handler is None:
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
            att = Attempt(assignment, ctx, handler, self._retry_delay)
            self._attempts[att.id] = att
        ctx._log.debug(
            "assigned (%s, attempt %d/%d)", task.handler, task.attempt, task.max_attempts
        )
        if self._hooks:
            self._hooks.emit("attempt_received", attempt_event(att))
        self._shell.step(att, AttemptMachine.begin)

    def _replay_main(self) -> None:
        """Deliver what earlier processes left in the outbox; retry with backoff until done."""
        assert self._outbox is not None
        failures = 0
        while not self._link.is_closed():
            try:
                done = replay(
                    self._outbox,
                    self._client,
                    exclude=self._instance_id,
                    log=self._log,
                    dial_timeout=self._dial_timeout,
                    call_timeout=self._call_timeout,
                )
            except OrbitError:  # the outbox file (OutboxError): try again later
                self._log.exception("outbox replay failed; retrying")
                done = False
            except Exception:  # a bug of ours: retrying would repeat it
                self._log.exception(
                    "outbox replay stopped by a worker error; stored results wait for a restart"
                )
                return
            if done:
                return
            failures += 1
            self._link.pause(self._backoff.delay(failures))

    # ------------------------------------------------------------------ shutdown

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
        self.request_stop(drain=False)
        for job in self._link.close():
            job()  # a kept request: it finds the link closed and gives up (unreported)
        self._serve_wake.set()

    def _supervisor_main(self) -> None:
        with self._cond:
            while not self._reg.stop_requested:
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
        if self._signals is not None:
            self._signals.wake()
        atexit.unregister(self._at_exit)
        self._log.info(
            "worker stopped: drained=%s cancelled=%d abandoned=%d unreported=%d",
            report.drained,
            len(report.cancelled),
            len(report.abandoned),
            len(report.unreported),
        )

    def _shutdown(self) -> ShutdownReport:
        # A plan over the clock (see ._shutdown): at most drain + cancel_grace + flush_timeout,
        # plus the close allowance.
        phases = self._phases
        # 1. Drain: meanwhile the connection thread tells the server (drain: true) so it assigns
        #    nothing more. Once nothing runs, the close below ends the session anyway: the drain
        #    report's answer is not waited for.
        drained = phases.drain(lambda: self._drain_deadline)
        # 2. Cancel what is still running, and give it a grace period to return.
        cancelled = phases.cancel(self._cancel_grace)
        # 3. Abandon handlers that ignore cancellation: finished UNKNOWN.
        gave_up = phases.abandon()
        # 4. Flush: finishes waiting for a connection get a bounded time to be delivered.
        phases.settled(self._clock() + self._flush_timeout)

        # 5. Close: every remaining waiter gives up (a dial in progress is cut); the threads,
        #    woken by that, wind down within the close allowance.
        close_end = self._clock() + CLOSE_ALLOWANCE
        current = self._link.current()
        for job in self._link.close():
            job()  # a kept request: it finds the link closed and gives up (unreported)
        self._dial_cut.cut()
        self._serve_wake.set()
        if current is not None:
            current[0].close()
        phases.settled(close_end)
        self._watchdog_thread.stop(timeout=max(0.0, close_end - self._clock()))
        self._pool.shutdown(close_end, stuck=phases.stuck(gave_up))
        if self._processes is not None:
            self._processes.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, close_end - self._clock()))
        if self._outbox is not None:
            self._outbox.close()  # after the replay thread: it writes to the file
        with self._cond:
            unreported = tuple(self._unreported)
            error = self._error
        return ShutdownReport(
            drained=drained,
            cancelled=tuple(a.info for a in cancelled if a not in gave_up),
            abandoned=tuple(a.info for a in gave_up),
            unreported=unreported,
            error=error,
        )
