"""The attempts' threaded shell: performs what each attempt's state machine (:mod:`._machine`)
decides, on whichever thread the event arrives (docs/architecture.md follows one attempt across
them; :meth:`AttemptShell.lease_actions` and :meth:`AttemptShell.perform` say what runs where).
Requests take the one request path (:mod:`._requests`); no thread waits for an answer.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import attrs

from ..client import DialCut
from ..connection import Submission, pipeline_of
from ..errors import OrbitError, WorkerError
from ..models import Assignment, AttemptRef, Disposition, Finish, Outcome
from ._context import Handler, TaskContext, cancel_context, set_lease_deadline, worker_log
from ._errors import NotConnected, is_link_failure
from ._handlers import Handlers
from ._link import Link, Resumes, Wakeup
from ._listeners import AttemptEvent, AttemptFinished, AttemptInfo, Hooks, LeaseEvent, StuckEvent
from ._machine import (
    Action,
    AttemptMachine,
    CancelContext,
    Event,
    InterruptHandler,
    LeaseLost,
    LeaseRenewed,
    LeaseView,
    NotStarted,
    Phase,
    RecordFinish,
    RefreshLease,
    Release,
    RenewAfter,
    RenewAnswer,
    Reported,
    Request,
    ResumeEnded,
    RunHandler,
    Send,
    SlotFreed,
    SlotStuck,
    TrackLease,
    UntrackLease,
    answered,
    failed,
)
from ._options import WorkerOptions
from ._outbox import Outbox, OutboxError
from ._outcomes import (
    DEFAULT_ENCODER,
    HANDLER_ERROR,
    ResultEncoder,
    TimeLimitExceeded,
    Verdict,
    not_run,
    outcome_of,
)
from ._pool import DaemonPool
from ._requests import RequestPath
from ._time_limits import Interruptible
from ._watchdog import RenewDone, Timers, WatchdogThread
from ._window import CapacityWindow

__all__ = [
    "Attempt",
    "AttemptShell",
    "LinkControls",
    "Registry",
    "WorkerThreads",
    "attempt_event",
]


class Attempt:
    """One assignment as the worker tracks it: its context, its handler, and its state machine
    (:class:`._machine.AttemptMachine`), which is read and changed only under ``lock``."""

    __slots__ = (
        "ctx",
        "handler",
        "limit_at",
        "lock",
        "machine",
        "ref",
        "running_on",
        "task",
    )

    def __init__(
        self, assignment: Assignment, ctx: TaskContext, handler: Handler, machine: AttemptMachine
    ) -> None:
        self.task = assignment.task
        self.ref: AttemptRef = machine.ref  # the one the machine sends (built once)
        self.ctx = ctx
        self.handler = handler
        self.machine = machine
        time_limit = machine.time_limit
        self.lock = threading.Lock()
        #: The handler's thread, to interrupt at its time limit (a thread handler with one).
        self.running_on = (
            None if time_limit is None or time_limit.in_process else Interruptible(self.lock)
        )
        #: When the handler reaches its time limit (clock time; set as it starts).
        self.limit_at = 0.0

    @property
    def id(self) -> str:
        return self.ref.attempt_id

    @property
    def info(self) -> AttemptInfo:
        return AttemptInfo(self.task.task_id, self.ref.attempt_id, self.task.handler)

    def phase(self) -> Phase:
        with self.lock:
            return self.machine.phase


class Registry:
    """The attempts the worker holds, its counters and its stop request, under one condition
    variable (which the shutdown thread waits on once a stop was requested). Attempt locks are
    taken after it, never before."""

    def __init__(self) -> None:
        #: Entered as this lock (C) where nothing waits or notifies: the condition's own
        #: ``__enter__`` is Python code, taken several times per attempt.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.attempts: dict[str, Attempt] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.unreported: list[AttemptInfo] = []
        #: Handlers running now.
        self.running = 0
        #: Attempts finished UNKNOWN while their handler still runs: each holds a slot.
        self.stuck: dict[str, AttemptInfo] = {}
        self.stop_requested = False
        #: When the drain ends (clock time), once a stop was requested; a later request may
        #: bring it forward.
        self.drain_deadline = 0.0
        #: The error that stopped the worker, if one did.
        self.error: BaseException | None = None
        #: The shutdown's drain is over (its cancel phase began): an assignment arriving now
        #: starts with its context cancelled (docs/architecture.md, "Threads and their owners").
        self.drain_over = False

    def get(self, attempt_id: str) -> Attempt | None:
        with self.lock:
            return self.attempts.get(attempt_id)


@attrs.frozen
class LinkControls:
    """The link and the connection thread that drives it: *wake* wakes that thread (a request
    was kept, a capacity report is due, the worker stops); *dial_cut* ends its dial in progress."""

    link: Link
    wake: Wakeup
    dial_cut: DialCut

    def close_link(self) -> None:
        """Close the link: each request it kept runs now, finds it closed and gives up (it is
        reported unreported)."""
        for job in self.link.close():
            job()


@attrs.frozen
class WorkerThreads:
    """The worker's own threads: the handler *pool*; the lease *watchdog*'s thread, which also
    fires the handlers' time limits (*timers*); and those ``Worker.start`` starts (*started*:
    connection, shutdown, outbox replay)."""

    pool: DaemonPool
    watchdog: WatchdogThread
    timers: Timers
    started: list[threading.Thread] = attrs.field(factory=list)

    def owns_current(self) -> bool:
        """Is this one of the worker's own threads (not a connection's or the user's)?"""
        return threading.current_thread() in self.started or self.pool.owns_current_thread()


def _decided(actions: list[Action], machine: AttemptMachine) -> list[Action]:
    """The event of actions its machine already returned (see AttemptShell.admitted)."""
    return actions


def attempt_event(att: Attempt) -> AttemptEvent:
    task = att.task
    return AttemptEvent(task.task_id, att.id, task.handler, task.attempt, task.max_attempts)


def _lease_event(att: Attempt, *, lag: float = 0.0, reason: str | None = None) -> LeaseEvent:
    return LeaseEvent(att.task.task_id, att.id, att.task.handler, lag, reason)


class AttemptShell(RequestPath[Attempt]):
    """Performs the attempts' actions: sends and re-sends (:class:`~._requests.RequestPath`),
    runs handlers, writes the outbox, counts, logs and tells the listeners. The worker's parts it
    holds are the ones admission, the session loop and the shutdown work with."""

    def __init__(
        self,
        registry: Registry,
        options: WorkerOptions,
        *,
        controls: LinkControls,
        threads: WorkerThreads,
        handlers: Handlers,
    ) -> None:
        #: The resumes of the newest connection (the connection thread waits for them).
        self.resumes: Resumes[Attempt] = Resumes(controls.wake.set)
        super().__init__(controls.link, options, controls.wake.set, self.resumes.sent)
        self.registry = registry
        self.controls = controls
        self.threads = threads
        self.window = CapacityWindow(options.capacity)
        self.hooks = Hooks(options.listeners, logger=options.logger)
        #: Its ``instance_id`` (new in a forked child) goes into the outbox's records.
        self.handlers = handlers
        self._encoder = (
            DEFAULT_ENCODER
            if options.result_converter is None
            else ResultEncoder(options.result_converter)
        )
        #: The durable outbox, once start() opened it (the shutdown closes it last).
        self.outbox: Outbox | None = None

    def step(self, att: Attempt, event: Event) -> None:
        """Feed *event* to the attempt's machine and perform the actions it returns. An
        unexpected error (a bug of ours) finishes the attempt UNKNOWN instead of dropping it."""
        try:
            with att.lock:
                actions = self.lease_actions(att, event(att.machine))
            self.perform(att, actions)
        except Exception:
            worker_log(att.ctx).exception(
                "worker error while processing the attempt; finishing UNKNOWN"
            )
            self.crashed(att)
        self.notify()

    def admitted(self, att: Attempt, actions: list[Action]) -> None:
        """Perform *actions*, which the machine of *att* returned as admission recorded it
        (under the registry's lock), as :meth:`step` performs an event's."""
        self.step(att, partial(_decided, actions))

    def crashed(self, att: Attempt) -> None:
        try:
            with att.lock:
                actions = self.lease_actions(att, att.machine.crashed())
            self.perform(att, actions)
        except Exception:
            # Twice in a row: nothing more can be sent for it; never leave it counted as live.
            worker_log(att.ctx).exception("worker error while finishing the attempt UNKNOWN")
            with self.registry.lock:
                self.registry.unreported.append(att.info)
            self.settle(att)

    def lease_actions(self, att: Attempt, actions: list[Action]) -> list[Action]:
        """Perform the lease and context actions now, under the attempt's lock (shutdown's
        abandon step must never see a lease tracked after its untrack); return the rest."""
        rest: list[Action] = []
        leases = self.threads.watchdog.core
        for action in actions:
            if isinstance(action, TrackLease):
                leases.track(att.id, action.deadline)
                set_lease_deadline(att.ctx, action.deadline)
            elif isinstance(action, RefreshLease):
                if leases.refresh(att.id, action.deadline):
                    set_lease_deadline(att.ctx, action.deadline)
            elif isinstance(action, UntrackLease):
                leases.untrack(att.id)
            elif isinstance(action, CancelContext):
                cancel_context(att.ctx, action.reason)
            else:
                rest.append(action)
        return rest

    def perform(self, att: Attempt, actions: list[Action]) -> None:
        """Perform *actions* in order on this thread, except what must not run on a connection's
        thread (its reader, or one ending it): the handler (a pool job), outbox writes and
        listeners (the rest goes to a pool thread when there are any). The worker's own threads
        perform everything themselves: the shutdown thread must not wait for a pool whose threads
        may all be held by handlers that ignore cancellation; for the same reason, an abandoned
        attempt's last actions (at shutdown only) run where its answer arrives."""
        offload = (
            (self.outbox is not None or bool(self.hooks.listeners))
            and any(isinstance(a, RecordFinish | Reported | LeaseLost) for a in actions)
            and not self.threads.owns_current()
        )
        if offload:
            with att.lock:
                offload = not att.machine.abandoned
        # A pool shut down raises: a late answer at the very end of shutdown, when the link is
        # closed and nothing is written any more, is performed here.
        if offload:
            with contextlib.suppress(RuntimeError):
                self.threads.pool.submit(partial(self._perform_now, att, actions))
                return
        self._perform_now(att, actions)

    def _perform_now(self, att: Attempt, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                if action.request.early:
                    self.resumes.add(action.request)
                self._send(att, action.request)
            elif isinstance(action, RunHandler):
                self._run_handler_on_pool(att)
            elif isinstance(action, RecordFinish):
                self._record_finish(att, action.request)
            elif isinstance(action, Reported):
                self._reported(att, action)
            elif isinstance(action, NotStarted):
                level = logging.INFO if action.error is None else logging.WARNING
                worker_log(att.ctx).log(level, "%s", action.why)
            elif isinstance(action, LeaseLost):
                self._lease_lost(att, action)
            elif isinstance(action, LeaseRenewed):
                if self.hooks.listeners:
                    self.hooks.emit("lease_renewed", _lease_event(att, lag=action.lag))
            elif isinstance(action, RenewAfter):
                self.threads.watchdog.core.retry(att.id, action.delay, action.error)
            elif isinstance(action, ResumeEnded):
                if action.refused is not None:
                    code = getattr(action.refused, "code", type(action.refused).__name__)
                    self._log.warning("resume of attempt %s refused (%s)", att.id, code)
                self.resumes.ended(action.request, cut=action.cut)
            elif isinstance(action, Release):
                self.settle(att)
            elif isinstance(action, InterruptHandler):
                self._interrupt(att, action.grace)
            elif isinstance(action, SlotStuck):
                self._stuck(att, action.reason)
            elif isinstance(action, SlotFreed):
                self._unstuck(att)
            elif not self.perform_request(att, action):
                raise AssertionError(f"unexpected attempt action {action!r}")

    def outcome(self, att: Attempt, request: Request, event: Event) -> None:
        if request.early:
            self.resumes.deliver(att, event)  # stepped by the connection thread
        else:
            self.step(att, event)

    def failure(self, att: Attempt, request: Request, error: OrbitError, gen: int) -> Event:
        if not request.early:
            return failed(request, error, gen)
        # A live resume's refusal is judged on the lease as it is when it is stepped.
        return lambda m: m.failed(request, error, gen=gen, view=self._lease_view(att))

    def answer(self, att: Attempt, request: Request, value: Any) -> Event:
        if request.early:
            return lambda m: m.resume_answered(request, value, self._lease_view(att))
        if request.request_type != "task.start":
            return answered(request, value)
        ctx = att.ctx
        return lambda m: m.start_answered(
            request,
            value,
            now=self.options.clock.now(),
            cancel_reason=ctx.cancel_reason,
            cancel_requested=ctx.cancel_requested,
        )

    def _run_handler_on_pool(self, att: Attempt) -> None:
        try:
            self.threads.pool.submit(partial(self._run_handler, att))
        except RuntimeError:  # the pool shut down under a late start answer: do not run it
            stop = not_run(cancel_requested=False, reason="shutdown")
            self.step(att, lambda m: m.handler_returned(stop))

    def _run_handler(self, att: Attempt) -> None:
        """The attempt's one pool job: record the launch, run the handler, send its finish."""
        try:
            # Without the launch record a kill would leave no trace of the run: do not run.
            launched = self._outbox_write(
                att,
                lambda o: o.launch(self.handlers.instance_id, att.ref, att.task.handler),
                failed="outbox unavailable: handler not run",
            )
            verdict = self.execute(att) if launched else None
        except Exception:
            worker_log(att.ctx).exception(
                "worker error while running the attempt; finishing UNKNOWN"
            )
            self.crashed(att)
            self.notify()
            return
        self.step(
            att, lambda m: m.launch_refused() if verdict is None else m.handler_returned(verdict)
        )

    def execute(self, att: Attempt) -> Verdict:
        ctx = att.ctx
        with self.registry.lock:
            self.registry.running += 1
        error: BaseException | None = None
        value: Any = None
        if self.hooks.listeners:
            self.hooks.emit("attempt_started", attempt_event(att))
        limit = att.machine.time_limit
        timer = None
        if limit is not None:
            att.limit_at = self.options.clock.now() + limit.seconds
            timer = self.threads.timers.call_at(
                att.limit_at, lambda: self.step(att, lambda m: m.time_limit_passed())
            )
        began = time.perf_counter()
        try:
            if att.running_on is None:
                value = self._call_handler(att)
            else:  # a time limit interrupts it on this thread
                value = att.running_on.run(partial(self._call_handler, att))
        except BaseException as exc:  # every ending is an outcome; the thread must survive
            error = exc
        finally:
            duration = time.perf_counter() - began
            if timer is not None:
                self.threads.timers.cancel(timer)
            with self.registry.lock:
                self.registry.running -= 1
        verdict = outcome_of(
            value=value,
            error=error,
            cancel_requested=ctx.cancel_requested,
            cancel_reason=ctx.cancel_reason,
            encoder=self._encoder,
            duration=duration,
            timeout_retryable=limit is not None and limit.retryable,
        )
        if verdict.error_code == HANDLER_ERROR and error is not None:
            # The traceback stays local: only the exception's type goes to the server.
            worker_log(ctx).error("handler raised %s", type(error).__name__, exc_info=error)
        elif verdict.problem is not None:
            # The handler's side effects happened; only its result cannot travel. Say where.
            worker_log(ctx).error(
                "handler %s: result cannot be sent, finishing %s %s: %s",
                att.task.handler,
                verdict.outcome,
                verdict.error_code,
                verdict.problem,
            )
        elif verdict.outcome is not Outcome.SUCCEEDED:
            worker_log(ctx).info("handler ended %s (%s)", verdict.outcome, verdict.error_code)
        return verdict

    def _call_handler(self, att: Attempt) -> Any:
        """The handler's own call (through the listeners' hook when there are listeners)."""
        ctx = att.ctx
        if self.hooks.listeners:
            return self.hooks.call_handler(att.handler, ctx)
        return att.handler(ctx, ctx.payload)

    def _record_finish(self, att: Attempt, request: Request) -> None:
        finish = request.body
        assert isinstance(finish, Finish)
        self._outbox_write(
            att,
            lambda o: o.record_finish(
                self.handlers.instance_id, att.task.handler, finish, request.message_id
            ),
        )

    def _reported(self, att: Attempt, reported: Reported) -> None:
        """The finish's fate: close its outbox entry (unless undelivered), count, log, tell."""
        verdict, result, ctx = reported.verdict, reported.result, att.ctx
        if result is not None:
            self._outbox_write(att, lambda o: o.done(att.id))
            evidence = result.receipt.disposition is Disposition.EVIDENCE_ONLY
            with self.registry.lock:
                self.registry.counts[verdict.outcome.value] += 1
                if evidence:
                    self.registry.counts["evidence_only"] += 1
            log = worker_log(ctx)
            if log.isEnabledFor(logging.INFO):  # a line per task: its text only when kept
                log.info(
                    "handler %s finished %s%s%s%s",
                    att.task.handler,
                    verdict.outcome,
                    "" if verdict.duration is None else f" in {verdict.duration:.3f}s",
                    " (kept as evidence only)" if evidence else "",
                    " (deduplicated)" if result.deduplicated else "",
                )
        elif reported.error is not None:
            with self.registry.lock:
                self.registry.counts["finish_rejected"] += 1
            code = getattr(reported.error, "code", reported.error)
            worker_log(ctx).error("finish %s refused (%s)", verdict.outcome, code)
            self._outbox_write(att, lambda o: o.done(att.id))
        else:
            with self.registry.lock:
                self.registry.unreported.append(att.info)
            worker_log(ctx).error(
                "finish %s not delivered: the worker stopped%s",
                verdict.outcome,
                "; kept in the outbox for the next start" if self.outbox else "",
            )
        if self.hooks.listeners:
            task = att.task
            finished = AttemptFinished(
                task_id=task.task_id,
                attempt_id=att.id,
                handler=task.handler,
                attempt=task.attempt,
                outcome=verdict.outcome,
                error_code=verdict.error_code,
                duration=verdict.duration,
                ran=verdict.ran,
                delivered=reported.delivered,
            )
            self.hooks.emit("attempt_finished", finished)

    # ------------------------------------------------------------------ time limits

    def _interrupt(self, att: Attempt, grace: float) -> None:
        """The handler ran past its time limit (its context is cancelled): raise
        ``TimeLimitExceeded`` in its thread, and give it *grace* seconds to end."""
        limit = att.machine.time_limit
        assert att.running_on is not None and limit is not None
        marked = att.running_on.interrupt(TimeLimitExceeded)
        worker_log(att.ctx).warning(
            "handler %s ran past its time limit of %gs: %s",
            att.task.handler,
            limit.seconds,
            "interrupted" if marked else "context cancelled (the thread cannot be interrupted)",
        )
        # From the limit, not from now: the handler gets at most limit + grace, however late
        # this thread woke.
        self.threads.timers.call_at(
            att.limit_at + grace, lambda: self.step(att, lambda m: m.time_limit_grace_passed())
        )

    def _stuck(self, att: Attempt, reason: str) -> None:
        """*att* was finished UNKNOWN while its handler still runs: its slot is stuck."""
        stuck = self._count_stuck(att, True)
        if reason == "shutdown":
            worker_log(att.ctx).error("handler ignored cancellation at shutdown: finishing UNKNOWN")
        else:
            assert att.machine.time_limit is not None
            worker_log(att.ctx).error(
                "handler %s still running %gs after its time limit: finishing UNKNOWN; its "
                "thread keeps a slot until it returns (%d of %d slots stuck)",
                att.task.handler,
                att.machine.time_limit.grace,
                stuck,
                self.options.capacity,
            )
        if self.hooks.listeners:
            self.hooks.emit("handler_stuck", self._stuck_event(att, reason, stuck))

    def _unstuck(self, att: Attempt) -> None:
        """A stuck handler returned at last: its slot is free, its result dropped."""
        stuck = self._count_stuck(att, False)
        worker_log(att.ctx).warning(
            "handler returned after it was finished UNKNOWN; its result is dropped and its "
            "slot is free again"
        )
        if self.hooks.listeners:
            reason = "time_limit" if att.machine.timed_out else "shutdown"
            self.hooks.emit("handler_unstuck", self._stuck_event(att, reason, stuck))

    def _count_stuck(self, att: Attempt, stuck: bool) -> int:
        """Count *att*'s slot stuck (or free again); return how many are. The capacity reported
        leaves out the stuck slots: no task waits behind a thread that cannot be stopped (the
        connection thread sends the new report)."""
        with self.registry.lock:
            if stuck:
                self.registry.stuck[att.id] = att.info
            else:
                self.registry.stuck.pop(att.id, None)
            count = len(self.registry.stuck)
        with self.window.lock:
            self.window.stuck = count
        self._wake()
        return count

    def _stuck_event(self, att: Attempt, reason: str, stuck: int) -> StuckEvent:
        task = att.task
        return StuckEvent(task.task_id, att.id, task.handler, reason, stuck, self.options.capacity)

    # ------------------------------------------------------------------ durable outbox

    def _outbox_write(
        self, att: Attempt, write: Callable[[Outbox], None], failed: str = "outbox write failed"
    ) -> bool:
        """Write to the outbox, if there is one; False (logged as *failed*) if that failed. A
        finish is still sent then: a failing outbox must not hold up a result."""
        if self.outbox is None:
            return True
        try:
            write(self.outbox)
        except OutboxError:
            worker_log(att.ctx).exception(failed)
            return False
        return True

    def settle(self, att: Attempt) -> None:
        """The worker is done with *att* (its machine reached a settled phase)."""
        with self.registry.lock:
            self.registry.attempts.pop(att.id, None)
            if self.registry.stop_requested:
                self.registry.cond.notify_all()

    def notify(self) -> None:
        # Only the shutdown thread waits on the condition for attempts to change, and only once a
        # stop was requested: waking it on every phase change of every task is wasted work.
        if self.registry.stop_requested:
            with self.registry.lock:
                self.registry.cond.notify_all()

    # ------------------------------------------------------------------ a new connection

    def _lease_view(self, att: Attempt) -> LeaseView:
        """The attempt's lease as the shell knows it now (read under the attempt's lock)."""
        ctx = att.ctx
        return LeaseView(
            now=self.options.clock.now(),
            remaining=ctx.remaining(),
            cancelled=ctx.cancelled.is_set(),
        )

    def _lease_lost(self, att: Attempt, lost: LeaseLost) -> None:
        """The lease is gone: count it, say so, tell the listeners."""
        with self.registry.lock:
            self.registry.counts["lease_losses"] += 1
        if lost.resume:
            worker_log(att.ctx).warning("lease did not survive the reconnect (%s)", lost.reason)
        else:
            detail = f" ({lost.detail})" if lost.detail else ""
            self._log.warning("lease of attempt %s: %s%s", att.id, lost.reason, detail)
        if self.hooks.listeners:
            self.hooks.emit("lease_lost", _lease_event(att, reason=lost.reason))

    # ------------------------------------------------------------------ the lease watchdog

    def renew_answered(self, attempt_id: str, answer: RenewAnswer) -> None:
        """The lease watchdog reports what became of a renewal: the attempt's machine decides."""
        att = self.registry.get(attempt_id)
        if att is not None:
            self.step(att, lambda m: m.renew_answered(answer))

    def send_renews(self, renewals: Sequence[tuple[str, str, RenewDone]]) -> None:
        """The watchdog's batch send: every renew in one write on the current connection; each
        answer (or failure) comes back through its own *on_done*, on the connection's reader
        thread, and a lost connection is reported to the link (neither ever blocks). Renewals
        that cannot be sent are told so after the write: nothing on the way to it may release
        the GIL (a log line in a callback could)."""
        with self.registry.lock:
            atts = [self.registry.attempts.get(attempt_id) for attempt_id, _, _ in renewals]
        current = self._link.current()
        refused: list[tuple[RenewDone, OrbitError]] = []
        requests: list[Submission] = []
        for (_, message_id, on_done), att in zip(renewals, atts, strict=True):
            if att is None:
                refused.append((on_done, NotConnected("attempt is no longer tracked")))
            elif current is None:
                refused.append((on_done, NotConnected("no connection")))
            else:
                # A slow answer closes its connection before the lease runs out (and is re-sent).
                timeout = min(self.options.request_timeout, max(1.0, att.ctx.remaining() / 2))
                done = partial(self._renew_done, on_done, current[1])
                requests.append(Submission("task.renew", att.ref, done, message_id, timeout))
        if requests:
            assert current is not None
            try:
                pipeline_of(current[0]).submit_many(requests)
            except OrbitError as exc:  # nothing was sent
                for request in requests:
                    request.on_done(None, exc)
        for on_done, error in refused:
            on_done(None, error)

    def _renew_done(
        self, on_done: RenewDone, gen: int, result: Any, error: OrbitError | None
    ) -> None:
        if error is None:
            on_done(result.lease, None)
            return
        if is_link_failure(error) and not isinstance(error, WorkerError):
            # (A fatal error answer ends the connection by itself, with that error.)
            self._link.broken(gen)
        on_done(None, error)
