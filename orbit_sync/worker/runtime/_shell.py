"""The attempts' threaded shell: performs what each attempt's state machine (:mod:`..core._machine`)
decides, on whichever thread the event arrives (docs/architecture.md follows one attempt across
them). Starts and finishes take :mod:`._requests`; a new connection's resumes are the connection
thread's to send (``session._resumes``), renewals the watchdog thread's (``._renewals``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ...errors import OrbitError
from ...models import Disposition, Finish, Outcome
from .._context import cancel_context, set_lease_deadline, worker_log
from .._listeners import AttemptFinished, Hooks, LeaseEvent, StuckEvent
from .._options import WorkerOptions
from ..core._machine import (
    Action,
    AttemptMachine,
    BreakConnection,
    CancelContext,
    Event,
    HandlerOutcome,
    InterruptHandler,
    Keep,
    LeaseLost,
    LeaseRenewed,
    LeaseView,
    NotStarted,
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
from ..core._outcomes import (
    DEFAULT_ENCODER,
    HANDLER_ERROR,
    ResultEncoder,
    TimeLimitExceeded,
)
from ..outbox._outbox import Outbox, OutboxError
from ._handlers import Handlers
from ._link import Resumes
from ._registry import Attempt, LinkControls, Registry, WorkerThreads, attempt_event
from ._requests import Caller, may_wait
from ._window import CapacityWindow

#: Per thread: the events stepped while one of its steps is being performed (see step).
_STEPS = threading.local()

__all__ = ["AttemptShell"]


def _lease_event(att: Attempt, *, lag: float = 0.0, reason: str | None = None) -> LeaseEvent:
    return LeaseEvent(att.task.task_id, att.id, att.task.handler, lag, reason)


class AttemptShell:
    """Performs the attempts' actions: sends and re-sends, runs handlers, writes the outbox,
    counts, logs and tells the listeners."""

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
        self.resumes = Resumes(controls.wake.set)
        self.options = options
        self._log = options.logger
        self.caller = Caller(controls.link, options)
        #: Resumes decided and not taken yet by the connection thread (its alone).
        self._unsent: list[tuple[Attempt, Request]] = []
        self.registry = registry
        self.controls = controls
        self.threads = threads
        self.window = CapacityWindow(options.capacity)
        self.hooks = Hooks(options.listeners, logger=options.logger)
        #: Its ``instance_id`` (new in a forked child) goes into the outbox's records.
        self.handlers = handlers
        #: How a returned result becomes the JSON the server records.
        self.encoder = (
            DEFAULT_ENCODER
            if options.result_converter is None
            else ResultEncoder(options.result_converter)
        )
        #: The durable outbox, once start() opened it (the shutdown closes it last).
        self.outbox: Outbox | None = None

    def step(self, att: Attempt, event: Event) -> None:
        """Feed *event* to the machine and perform its actions. On a thread already performing
        a step, the event is queued behind it: a loop, never a recursion as deep as the retries."""
        pending: collections.deque[tuple[Attempt, Event]] | None = getattr(_STEPS, "pending", None)
        if pending is not None:
            pending.append((att, event))
            return
        pending = _STEPS.pending = collections.deque([(att, event)])
        try:
            while pending:
                att, event = pending.popleft()
                try:
                    with att.lock:
                        actions = self.lease_actions(att, event(att.machine))
                    self.perform(att, actions)
                except Exception:
                    # A bug of ours: the attempt is finished UNKNOWN instead of dropped.
                    worker_log(att.ctx).exception(
                        "worker error while processing the attempt; finishing UNKNOWN"
                    )
                    self.crashed(att)
                self.notify()
        finally:
            _STEPS.pending = None

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
        """Perform the lease and context actions under the attempt's lock (shutdown's abandon
        must never see a lease tracked after its untrack); return the rest."""
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
        """Perform *actions* in order. A thread that must not wait (a reader, the watchdog, the
        shutdown) hands a list that waits to a sender thread; resumes go to the connection
        thread, batched."""
        if not may_wait() and any(_waits(a) for a in actions):
            self.caller.elsewhere(partial(self.perform, att, actions))
            return
        for action in actions:
            if isinstance(action, Send) and action.request.early:
                self.resumes.add(action.request)
                self._unsent.append((att, action.request))  # the connection thread sends them
            elif isinstance(action, RunHandler):
                self._run_handler(att)
            elif isinstance(action, RecordFinish):
                self._record_finish(att, action.request)
            elif isinstance(action, HandlerOutcome):
                self._handler_outcome(att, action)
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
            elif isinstance(action, Send):
                self._send(att, action.request)
            elif isinstance(action, Keep):
                self._keep(att, action)
            elif isinstance(action, BreakConnection):
                if action.gen:  # 0: nothing was sent, there is no connection to break
                    self.controls.link.broken(action.gen)
            else:
                raise AssertionError(f"unexpected attempt action {action!r}")

    def _send(self, att: Attempt, request: Request) -> None:
        outcome = self.caller.call(request)
        if outcome.gave_up:
            self.step(att, partial(AttemptMachine.gave_up, request=request))
        elif outcome.error is not None:
            self.step(att, self.failure(att, request, outcome.error, outcome.gen))
        else:
            self.step(att, self.answer(att, request, outcome.value))

    def _keep(self, att: Attempt, kept: Keep) -> None:
        request = kept.request
        if request.early:
            # A resume's transient error: the connection thread re-sends it.
            job = partial(self.step, att, partial(AttemptMachine.resend, request=request))
            link = self.controls.link
            if link.keep(job, newer_than=kept.newer_than, delay=kept.delay, early=True):
                self.controls.wake.set()
            else:
                self.step(att, partial(AttemptMachine.gave_up, request=request))
            return
        # This thread waits holding its attempt: another takes the assignments meanwhile (the
        # server may assign in place of a lease it ended before this worker learned it).
        if self.threads.pool.owns_current_thread():
            self.threads.pool.ensure_taker()
        again = self.caller.wait_to_resend(kept)
        event = AttemptMachine.resend if again else AttemptMachine.gave_up
        self.step(att, partial(event, request=request))

    def take_resumes(self) -> list[tuple[Attempt, Request]]:
        taken, self._unsent = self._unsent, []
        return taken

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

    def _run_handler(self, att: Attempt) -> None:
        # Without the launch record a kill would leave no trace of the run: do not run.
        launched = self._outbox_write(
            att,
            lambda o: o.launch(self.handlers.instance_id, att.ref, att.task.handler),
            failed="outbox unavailable: handler not run",
        )
        self.step(att, self.execute(att) if launched else AttemptMachine.launch_refused)

    def execute(self, att: Attempt) -> Event:
        """Run the handler in a free handler slot; return the event of how it ended."""
        running = self.threads.pool.running
        if not running.acquire(blocking=False):
            self.threads.pool.ensure_taker()  # it waits: another thread takes what comes
            running.acquire()
        ctx = att.ctx
        error: BaseException | None = None
        value: Any = None
        timer = None
        try:
            with self.registry.lock:
                self.registry.running += 1
            if self.hooks.listeners:
                self.hooks.emit("attempt_started", attempt_event(att))
            limit = att.machine.time_limit
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
            duration = time.perf_counter() - began
        finally:
            if timer is not None:
                self.threads.timers.cancel(timer)
            with self.registry.lock:
                self.registry.running -= 1
            running.release()
        return partial(
            AttemptMachine.handler_ended,
            value=value,
            error=error,
            cancel_requested=ctx.cancel_requested,
            cancel_reason=ctx.cancel_reason,
            duration=duration,
        )

    def _handler_outcome(self, att: Attempt, told: HandlerOutcome) -> None:
        verdict, error, ctx = told.verdict, told.error, att.ctx
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

    def _call_handler(self, att: Attempt) -> Any:
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

    def _interrupt(self, att: Attempt, grace: float) -> None:
        """Past its time limit: raise ``TimeLimitExceeded`` in the handler's thread."""
        limit = att.machine.time_limit
        assert att.running_on is not None and limit is not None
        marked = att.running_on.interrupt(TimeLimitExceeded)
        worker_log(att.ctx).warning(
            "handler %s ran past its time limit of %gs: %s",
            att.task.handler,
            limit.seconds,
            "interrupted" if marked else "context cancelled (the thread cannot be interrupted)",
        )
        # From the limit, not from now: at most limit + grace, however late this thread woke.
        self.threads.timers.call_at(
            att.limit_at + grace, lambda: self.step(att, lambda m: m.time_limit_grace_passed())
        )

    def _stuck(self, att: Attempt, reason: str) -> None:
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
        stuck = self._count_stuck(att, False)
        worker_log(att.ctx).warning(
            "handler returned after it was finished UNKNOWN; its result is dropped and its "
            "slot is free again"
        )
        if self.hooks.listeners:
            reason = "time_limit" if att.machine.timed_out else "shutdown"
            self.hooks.emit("handler_unstuck", self._stuck_event(att, reason, stuck))

    def _count_stuck(self, att: Attempt, stuck: bool) -> int:
        """Count *att*'s slot stuck (or free); return how many are. The reported capacity
        leaves them out: no task waits behind a thread that cannot be stopped."""
        with self.registry.lock:
            if stuck:
                self.registry.stuck[att.id] = att.info
            else:
                self.registry.stuck.pop(att.id, None)
            count = len(self.registry.stuck)
        with self.window.lock:
            self.window.stuck = count
        self.controls.wake.set()
        return count

    def _stuck_event(self, att: Attempt, reason: str, stuck: int) -> StuckEvent:
        task = att.task
        return StuckEvent(task.task_id, att.id, task.handler, reason, stuck, self.options.capacity)

    def _outbox_write(
        self, att: Attempt, write: Callable[[Outbox], None], failed: str = "outbox write failed"
    ) -> bool:
        """Write to the outbox, if any; False (logged) if that failed. A finish is still sent:
        a failing outbox must not hold up a result."""
        if self.outbox is None:
            return True
        try:
            write(self.outbox)
        except OutboxError:
            worker_log(att.ctx).exception(failed)
            return False
        return True

    def settle(self, att: Attempt) -> None:
        with self.registry.lock:
            self.registry.attempts.pop(att.id, None)
            if self.registry.stop_requested:
                self.registry.cond.notify_all()

    def notify(self) -> None:
        # Only the shutdown waits on the condition, once a stop was requested.
        if self.registry.stop_requested:
            with self.registry.lock:
                self.registry.cond.notify_all()

    def _lease_view(self, att: Attempt) -> LeaseView:
        ctx = att.ctx
        return LeaseView(
            now=self.options.clock.now(),
            remaining=ctx.remaining(),
            cancelled=ctx.cancelled.is_set(),
        )

    def _lease_lost(self, att: Attempt, lost: LeaseLost) -> None:
        with self.registry.lock:
            self.registry.counts["lease_losses"] += 1
        if lost.resume:
            worker_log(att.ctx).warning("lease did not survive the reconnect (%s)", lost.reason)
        else:
            detail = f" ({lost.detail})" if lost.detail else ""
            self._log.warning("lease of attempt %s: %s%s", att.id, lost.reason, detail)
        if self.hooks.listeners:
            self.hooks.emit("lease_lost", _lease_event(att, reason=lost.reason))

    def renew_answered(self, attempt_id: str, answer: RenewAnswer) -> None:
        """The lease watchdog reports what became of a renewal."""
        att = self.registry.get(attempt_id)
        if att is not None:
            self.step(att, lambda m: m.renew_answered(answer))


def _waits(action: Action) -> bool:
    if isinstance(action, Send | Keep):
        return not action.request.early
    return isinstance(action, RunHandler)
