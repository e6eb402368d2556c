"""One attempt's life on the worker as a pure state machine: no sockets, no threads, no clock
of its own. Each event is a method of :class:`AttemptMachine`, which returns the actions the
shell performs, in order; every decision goes through one table, :data:`TABLE`, ``(trigger,
phase) -> (phase, actions)`` as h11 keeps its state machine. The diagrams: docs/architecture.md,
"One attempt". A request keeps its ``message_id`` for as long as it lives, so every re-send is
the same operation to the server (PROTOCOL §7).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import attrs

from ...errors import OrbitError, WorkerBusy, WorkerError
from ...models import (
    AttemptRef,
    AttemptState,
    CommandResult,
    Disposition,
    Finish,
    Lease,
    grants_run,
    may_run_at,
)
from ._errors import is_link_failure, is_transient
from ._outcomes import (
    DEFAULT_ENCODER,
    HANDLER_TIMEOUT,
    WORKER_ERROR,
    WORKER_LOST,
    ResultEncoder,
    Verdict,
    abandoned,
    not_run,
    outbox_unavailable,
    outcome_of,
    unknown,
)
from ._outcomes import stored as stored_verdict
from ._table import (
    ANY_PHASE,
    IMPOSSIBLE,
    REFUSED,
    SETTLED,
    TABLE,
    Action,
    BreakConnection,
    CancelContext,
    Ended,
    HandlerOutcome,
    InterruptHandler,
    Keep,
    LeaseLost,
    LeaseRenewed,
    LeaseView,
    MachineError,
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
    Skipped,
    SlotFreed,
    SlotStuck,
    TrackLease,
    Trigger,
    UntrackLease,
)
from ._time_limits import TimeLimit

__all__ = [
    "ANY_PHASE",
    "BUSY_DELAY",
    "IMPOSSIBLE",
    "REFUSED",
    "SETTLED",
    "TABLE",
    "Action",
    "AttemptMachine",
    "BreakConnection",
    "CancelContext",
    "Ended",
    "Event",
    "HandlerOutcome",
    "InterruptHandler",
    "Keep",
    "LeaseLost",
    "LeaseRenewed",
    "LeaseView",
    "MachineError",
    "NotStarted",
    "Phase",
    "RecordFinish",
    "RefreshLease",
    "Release",
    "RenewAfter",
    "RenewAnswer",
    "Reported",
    "Request",
    "ResumeEnded",
    "RunHandler",
    "Send",
    "Skipped",
    "SlotFreed",
    "SlotStuck",
    "TrackLease",
    "Trigger",
    "UntrackLease",
    "answered",
    "failed",
    "retry_delay",
]

#: Retry delay after ``busy`` (nothing was sent; a slot frees within a round trip).
BUSY_DELAY = 0.05
#: The bounds of the worker's retry delay (``renew_retry_delay``).
MIN_RETRY_DELAY = 0.1
MAX_RETRY_DELAY = 5.0


@attrs.define(eq=False)
class AttemptMachine:
    """The phase of one attempt and the requests it has on its way (the shell calls it under
    the attempt's lock)."""

    ref: AttemptRef
    _new_id: Callable[[], str] = attrs.field(kw_only=True)
    retry_delay: float = attrs.field(kw_only=True)
    #: The handler's time limit, if it has one.
    time_limit: TimeLimit | None = attrs.field(default=None, kw_only=True)
    #: Encodes a returned result as the JSON the server records (the worker's result_converter).
    encoder: ResultEncoder = attrs.field(default=DEFAULT_ENCODER, kw_only=True)
    phase: Phase = attrs.field(default=Phase.ASSIGNED, init=False)
    #: The handler ran past its time limit and was interrupted.
    timed_out: bool = attrs.field(default=False, init=False)
    #: The lease is tracked (renewed): from the start's grant until the handler is told to
    #: stop or returns. Only then does a renewal's answer speak for it.
    renewing: bool = attrs.field(default=False, init=False)
    #: The start or finish on its way (sent, queued, or kept for a re-send).
    request: Request | None = attrs.field(default=None, init=False)
    #: The verdict being finished (FINISHING and after).
    verdict: Verdict | None = attrs.field(default=None, init=False)
    #: Shutdown gave up on the handler and finished it UNKNOWN: its late result is dropped.
    abandoned: bool = attrs.field(default=False, init=False)
    #: The handler's thread is done with the attempt (an abandoned handler may never be).
    handler_done: bool = attrs.field(default=False, init=False)
    #: Replay: the finish the dead process stored, with its original message_id.
    stored: Request | None = attrs.field(default=None, init=False)
    #: The live resume on its way on a new connection, beside ``request`` (which may hold
    #: a start or finish kept for that connection).
    resume: Request | None = attrs.field(default=None, init=False)
    #: Was the attempt RUNNING when ``resume`` was sent? Only then does its answer speak
    #: for the lease the handler runs on.
    resumed_running: bool = attrs.field(default=False, init=False)

    @property
    def settled(self) -> bool:
        return self.phase in SETTLED

    def fire(self, trigger: Trigger) -> bool:
        """Move by :data:`TABLE`: False if the phase refuses *trigger* (:data:`REFUSED`, only ever
        for a trigger of :data:`ANY_PHASE`, so any other one moves or raises); raise
        :class:`MachineError` for a pair the table does not list. A move to another phase ends
        the request on its way (the method sets the next, if any)."""
        move = TABLE[trigger].get(self.phase)
        if move is None:
            if self.phase in REFUSED[trigger]:
                return False
            raise MachineError(f"{trigger.name} cannot arrive in phase {self.phase.name}")
        if move.to is not self.phase:
            self.request = None
        self.phase = move.to
        if TrackLease in move.actions:
            self.renewing = True
        elif UntrackLease in move.actions:
            self.renewing = False
        return True

    def _take(self, trigger: Trigger, *actions: Action) -> list[Action]:
        """*actions* if the phase takes *trigger*, else none."""
        return list(actions) if self.fire(trigger) else []

    # ------------------------------------------------------------------ the assignment

    def assigned(self, *, again: bool, runnable: bool, stopping: bool) -> list[Action]:
        """The intake took the assignment: *again*, it was assigned before; *runnable*, a
        handler of this process can run it; *stopping*, the shutdown's drain is over (it starts
        with its context cancelled: the protocol cannot hand it back, PROTOCOL §5.7)."""
        attempt_id = self.ref.attempt_id
        if again:
            why = f"attempt {attempt_id} assigned twice; ignored"
            return self._take(Trigger.SKIPPED, Skipped(why))
        if not runnable:
            why = f"attempt {attempt_id} not started: no handler registered"
            return self._take(Trigger.SKIPPED, Skipped(why, "skipped"))
        self.fire(Trigger.ADMITTED_STOPPING if stopping else Trigger.ADMITTED)
        self.request = Request("task.start", self.ref, self._new_id())
        send = Send(self.request)
        return [CancelContext("shutdown"), send] if stopping else [send]

    # ------------------------------------------------------------------ requests

    def start_answered(
        self,
        request: Request,
        result: CommandResult,
        *,
        now: float,
        cancel_reason: str | None,
        cancel_requested: bool,
    ) -> list[Action]:
        """The start's answer: run the handler if the lease lets it (PROTOCOL §6.5).
        *cancel_reason*: the context's, if it is already cancelled (not by this lease)."""
        if request is not self.request:
            return []  # a stale answer: the request was given up meanwhile
        lease, receipt = result.lease, result.receipt
        if cancel_reason is None and lease.deadline is not None and may_run_at(lease, now):
            return self._take(Trigger.START_RUNS, TrackLease(lease.deadline), RunHandler())
        asked = lease.cancel_requested
        cancel: list[Action] = [CancelContext("cancel_requested")] if asked else []
        if (
            receipt.disposition is not Disposition.APPLIED
            or receipt.attempt_state is not AttemptState.RUNNING
        ):
            trigger = Trigger.START_NOT_STARTED_CANCELLED if asked else Trigger.START_NOT_STARTED
            why = f"not started (lease {lease.state}, active={lease.active})"
            return self._take(trigger, *cancel, NotStarted(why), Release())
        reason = cancel_reason or ("lease_lost" if not lease.active else "lease_expired")
        verdict = not_run(cancel_requested=cancel_requested or asked, reason=reason)
        trigger = Trigger.START_CANCEL_REQUESTED if asked else Trigger.START_MAY_NOT_RUN
        return self._finishing(trigger, verdict, *cancel)

    def finish_answered(self, request: Request, result: CommandResult) -> list[Action]:
        """The finish was accepted (applied, kept as evidence, or deduplicated)."""
        if request is not self.request:
            return []
        return self._reported(Trigger.FINISH_ANSWERED, result=result)

    def failed(
        self, request: Request, error: OrbitError, *, gen: int, view: LeaseView | None = None
    ) -> list[Action]:
        """*request*, sent on connection *gen* (0: it could not be sent), failed with *error*.
        *view*: the lease as the shell knows it (needed for a live resume's refusal)."""
        if request is self.resume:
            if is_link_failure(error):
                # The next connection resumes the attempt again with a resume of its own.
                return self._resume_over(Trigger.RESUME_LINK_FAILED, BreakConnection(gen), cut=True)
            if self.settled:
                return self._resume_over(Trigger.RESUME_OVER)  # nothing left to resume
            if is_transient(error):
                return self._take(Trigger.TRANSIENT, self._retry(request, error))
            assert view is not None, "a live resume's refusal is judged on the lease"
            return self._live_resumed(None, view, refused=error)
        if request is not self.request:
            return []
        if is_link_failure(error):
            # Maybe sent, maybe applied: the same operation goes out again after the reconnect.
            kept = Keep(request, newer_than=gen)
            return self._take(Trigger.LINK_FAILED, BreakConnection(gen), kept)
        if is_transient(error):
            return self._take(Trigger.TRANSIENT, self._retry(request, error))
        if self.phase is Phase.RESUMING:
            return self._resumed(None)  # refused: the lease is gone
        if self.phase is Phase.STARTING:
            code = getattr(error, "code", type(error).__name__)
            why = f"start refused ({code}); handler not run"
            return self._take(Trigger.REFUSED, NotStarted(why, error), Release())
        return self._reported(Trigger.REFUSED, error=error)

    def resend(self, request: Request) -> list[Action]:
        """A connection (or the retry delay) came for *request*: send it again, same id."""
        if request is self.resume:
            if self.settled:
                return self._resume_over(Trigger.RESUME_OVER)  # nothing left to resume
        elif request is not self.request:
            return []
        return self._take(Trigger.RESEND, Send(request))

    def gave_up(self, request: Request) -> list[Action]:
        """The worker stopped before *request* was answered."""
        if request is self.resume:
            return self._resume_over(Trigger.RESUME_OVER)
        if request is not self.request:
            return []
        if self.phase is Phase.STARTING:
            why = "not started: the worker stopped before start was answered"
            return self._take(Trigger.GAVE_UP, NotStarted(why), Release())
        if self.phase is Phase.RESUMING:
            # Nothing sent for the stored attempt: a later replay resumes it again.
            return self._take(Trigger.GAVE_UP, Release())
        return self._reported(Trigger.GAVE_UP)

    # ------------------------------------------------------------------ outbox replay

    def replay(self, finish: Finish | None, message_id: str | None) -> list[Action]:
        """A stored attempt of a dead instance: resume its lease first (the replay session
        takes it over); *finish* and *message_id*: its stored finish, if any."""
        self.fire(Trigger.REPLAY)
        if finish is not None and message_id is not None:
            self.stored = Request("task.finish", finish, message_id)
        self.request = Request("worker.resume", self.ref, self._new_id())
        return [Send(self.request)]

    def resume_answered(
        self, request: Request, lease: Lease, view: LeaseView | None = None
    ) -> list[Action]:
        """A resume was answered with *lease*: a live one (*view*: the lease as the shell
        knows it), or the replay's."""
        if request is self.resume:
            assert view is not None, "a live resume's answer is judged on the lease"
            return self._live_resumed(lease, view)
        if request is not self.request or self.phase is not Phase.RESUMING:
            return []
        return self._resumed(lease)

    def _resumed(self, lease: Lease | None) -> list[Action]:
        """The replay's resume is over (answered with *lease*, or refused: ``None``)."""
        stored = self.stored
        if stored is not None:
            # Sent either way: the server applies it within the lease, keeps it as evidence
            # after, and answers a repeat with the original receipt.
            self.fire(Trigger.REPLAY_STORED)
            assert isinstance(stored.body, Finish)
            self.verdict = stored_verdict(stored.body)
            self.request = stored
            return [Send(stored)]
        if lease is not None and lease.active:
            # Launched, never finished, still leased: its effect is uncertain; say so now
            # rather than at lease expiry. Recorded first: a cut replay re-sends the same one.
            return self._finishing(Trigger.REPLAY_LEASE_ACTIVE, unknown(WORKER_LOST))
        why = "refused" if lease is None else f"lease {lease.state}"
        return self._take(Trigger.REPLAY_LEASE_GONE, Ended(why), Release())

    # ------------------------------------------------------------------ the handler

    def handler_returned(self, verdict: Verdict) -> list[Action]:
        """The handler ended with *verdict*: finish it, unless it was abandoned already."""
        if self.handler_done:
            return []
        self.handler_done = True
        if self.abandoned:
            # Finished UNKNOWN already: this result is dropped.
            return self._take(Trigger.STUCK_HANDLER_RETURNED, SlotFreed())
        return self._finishing(Trigger.HANDLER_RETURNED, verdict, UntrackLease())

    def handler_ended(
        self,
        *,
        value: Any = None,
        error: BaseException | None = None,
        cancel_requested: bool = False,
        cancel_reason: str | None = None,
        duration: float | None = None,
    ) -> list[Action]:
        """The handler returned *value* or raised *error* after *duration* seconds, its context
        cancelled (*cancel_reason*) or not, and the server asked to cancel it or not: the outcome
        rules give the verdict, which is finished, unless it was abandoned already."""
        if self.handler_done:
            return []
        limit = self.time_limit
        verdict = outcome_of(
            value=value,
            error=error,
            cancel_requested=cancel_requested,
            cancel_reason=cancel_reason,
            encoder=self.encoder,
            duration=duration,
            timeout_retryable=limit is not None and limit.retryable,
        )
        if self.abandoned:
            return self.handler_returned(verdict)  # its result is dropped
        self.handler_done = True
        return self._finishing(
            Trigger.HANDLER_ENDED, verdict, HandlerOutcome(verdict, error), UntrackLease()
        )

    def launch_refused(self) -> list[Action]:
        """The outbox could not record the launch: the handler must not run."""
        return self.handler_returned(outbox_unavailable())

    def crashed(self) -> list[Action]:
        """A step of this attempt raised (a bug of ours): finish it UNKNOWN rather than drop
        it, or keep a decided finish for a re-send (a copy that did go out is answered as a
        duplicate). A live resume is over: its connection must not wait for it."""
        if self.resume is not None:
            return [*self._resume_over(Trigger.RESUME_OVER), *self.crashed()]
        if self.phase is Phase.ASSIGNED:
            return self._take(Trigger.CRASHED, NotStarted("not started: worker error"), Release())
        if self.phase is Phase.FINISHING:
            assert self.request is not None, "a finishing attempt has its finish on its way"
            return self._take(Trigger.CRASHED, Keep(self.request))
        actions = self._finishing(Trigger.CRASHED, unknown(WORKER_ERROR), UntrackLease())
        if actions:
            self.handler_done = True
        return actions

    # ------------------------------------------------------------------ leases and cancels

    def reconnected(self) -> list[Action]:
        """A new connection is open (not yet published): resume the lease there first
        (PROTOCOL §5.5). A start or finish kept for it goes out once it is published, which
        waits for every resume to go out."""
        if not self.fire(Trigger.RECONNECTED):
            return []  # not held: nothing to resume (RESUMING: the replay's own session)
        self.resume = Request("worker.resume", self.ref, self._new_id())
        self.resumed_running = self.phase is Phase.RUNNING
        return [Send(self.resume)]

    def renew_answered(self, answer: RenewAnswer) -> list[Action]:
        """The lease watchdog reports what became of a renewal (PROTOCOL §6.3-6.6)."""
        if not self.renewing:
            return []  # told to stop or returned meanwhile: nothing is renewed any more
        lease, error = answer.lease, answer.error
        if error is not None and (is_transient(error) or not isinstance(error, WorkerError)):
            # (A send that raised something else is a bug of ours: retried, never a loss.)
            delay = retry_delay(error, self.retry_delay)
            return self._take(Trigger.RENEW_FAILED, RenewAfter(delay, error))
        if lease is not None and lease.cancel_requested:
            return self._lease_over(Trigger.STOP_RUNNING, "cancel_requested")
        if lease is not None and lease.deadline is not None and grants_run(lease):
            renewed = LeaseRenewed(answer.lag)
            return self._take(Trigger.RENEWED, TrackLease(lease.deadline), renewed)
        if lease is None and error is None:
            reason = "lease_expired"
        else:
            reason = "session_replaced" if answer.behind_resume else "lease_lost"
        detail = error.code if isinstance(error, WorkerError) else ""
        lost = LeaseLost(reason, resume=False, detail=detail)
        return self._lease_over(Trigger.LEASE_ENDED, reason, lost)

    def cancel_pushed(self) -> list[Action]:
        """A ``task.cancel`` push: the handler is told to stop (or never starts)."""
        return self._lease_over(Trigger.CANCEL_PUSHED, "cancel_requested")

    def shutdown_cancel(self) -> list[Action]:
        """Shutdown's cancel step: a starting or running handler is told to stop."""
        return self._lease_over(Trigger.SHUTDOWN_CANCEL, "shutdown")

    def abandon(self) -> list[Action]:
        """Shutdown gave up waiting for the handler: finish UNKNOWN (``SHUTDOWN_TIMEOUT``)."""
        return self._abandon(abandoned(), "shutdown")

    def time_limit_passed(self) -> list[Action]:
        """The handler has run for its time limit: cancel its context and, on a thread,
        interrupt it (in a child process, the process executor interrupts it and kills the
        child past the grace)."""
        limit = self.time_limit
        if limit is None or self.timed_out or self.handler_done:
            return []
        if limit.in_process:
            actions = self._lease_over(Trigger.STOP_RUNNING, "time_limit")
        else:
            actions = self._lease_over(
                Trigger.TIME_LIMIT, "time_limit", InterruptHandler(limit.grace)
            )
        self.timed_out = bool(actions)
        return actions

    def time_limit_grace_passed(self) -> list[Action]:
        """The handler's thread still runs past the time limit's grace: it cannot be stopped,
        its effect is uncertain: finish UNKNOWN (``HANDLER_TIMEOUT``)."""
        if not self.timed_out:
            return []
        return self._abandon(unknown(HANDLER_TIMEOUT), "time_limit")

    # ------------------------------------------------------------------ internal

    def _lease_over(self, trigger: Trigger, reason: str, *more: Action) -> list[Action]:
        """Cancel the context with *reason*; a running handler's lease is renewed no more."""
        if not self.fire(trigger):
            return []
        cancel = CancelContext(reason)
        if self.phase is Phase.RUNNING:
            return [UntrackLease(), cancel, *more]
        return [cancel, *more]

    def _abandon(self, verdict: Verdict, reason: str) -> list[Action]:
        """Give up on a handler that does not stop: finish with *verdict* (UNKNOWN) now; its
        thread keeps a slot (stuck) until it returns, and its late result is dropped."""
        if self.handler_done:
            return []
        actions = self._finishing(Trigger.ABANDON, verdict, UntrackLease(), SlotStuck(reason))
        if actions:
            self.abandoned = True
        return actions

    def _live_resumed(
        self, lease: Lease | None, view: LeaseView, *, refused: OrbitError | None = None
    ) -> list[Action]:
        """A live resume is over (answered with *lease*, or refused): what it says of the
        lease the handler runs on, then its end. It speaks only for an attempt running when it
        was sent, context not cancelled: a starting or finishing one has its own request right
        behind the resume, whose answer decides. A start kept for the connection may be answered
        first (on the reader): the resume's lease, from before it, says nothing of the new one."""
        speaks = self.resumed_running and self.phase is Phase.RUNNING and not view.cancelled
        if not speaks:
            return self._resume_over(Trigger.RESUME_OVER, refused=refused)
        if lease is not None and lease.cancel_requested:
            stop: list[Action] = [UntrackLease(), CancelContext("cancel_requested")]
            return self._resume_over(Trigger.RESUME_CANCEL_REQUESTED, *stop, refused=refused)
        if lease is not None and lease.deadline is not None and may_run_at(lease, view.now):
            refresh = RefreshLease(lease.deadline)
            return self._resume_over(Trigger.RESUME_HOLDS, refresh, refused=refused)
        reason = "lease_expired" if view.remaining <= 0 else "session_replaced"
        lost: list[Action] = [UntrackLease(), CancelContext(reason), LeaseLost(reason)]
        return self._resume_over(Trigger.RESUME_LOST, *lost, refused=refused)

    def _resume_over(
        self,
        trigger: Trigger,
        *first: Action,
        refused: OrbitError | None = None,
        cut: bool = False,
    ) -> list[Action]:
        """The live resume is over: *first*, then its end, which the connection counts."""
        request = self.resume
        if request is None or not self.fire(trigger):
            return []
        self.resume = None
        return [*first, ResumeEnded(request, refused, cut)]

    def _reported(
        self,
        trigger: Trigger,
        *,
        result: CommandResult | None = None,
        error: OrbitError | None = None,
    ) -> list[Action]:
        """The finish's fate: *result* (accepted), *error* (refused), or neither."""
        self.fire(trigger)
        assert self.verdict is not None
        return [Reported(self.verdict, result, error), Release()]

    def _finishing(self, trigger: Trigger, verdict: Verdict, *first: Action) -> list[Action]:
        """*first*, then the finish of *verdict*, recorded before it is sent."""
        if not self.fire(trigger):
            return []
        self.verdict = verdict
        self.request = Request("task.finish", verdict.finish(self.ref), self._new_id())
        return [*first, RecordFinish(self.request), Send(self.request)]

    def _retry(self, request: Request, error: OrbitError) -> Keep:
        return Keep(request, delay=retry_delay(error, self.retry_delay), error=error)


#: Something that happened to an attempt, as a call of its machine returning the actions (an
#: event method of :class:`AttemptMachine` with its data bound).
Event = Callable[[AttemptMachine], list[Action]]


def answered(request: Request, value: Any) -> Event:
    """The event of *request*'s answer *value*, for a finish or the replay's resume (a start's
    and a live resume's need what the shell knows of the attempt: it binds those itself)."""
    if request.request_type == "task.finish":
        return partial(AttemptMachine.finish_answered, request=request, result=value)
    if request.request_type == "worker.resume":
        return partial(AttemptMachine.resume_answered, request=request, lease=value)
    raise AssertionError(f"no answer event for {request.request_type}")


def failed(request: Request, error: OrbitError, gen: int, view: LeaseView | None = None) -> Event:
    """The event of *request*'s failure with *error* on connection *gen* (0: none)."""
    return partial(AttemptMachine.failed, request=request, error=error, gen=gen, view=view)


def retry_delay(error: BaseException, delay: float) -> float:
    """The delay before a request answered with the transient *error* goes out again:
    *delay*, or :data:`BUSY_DELAY` when the worker's own request slots were full."""
    return BUSY_DELAY if isinstance(error, WorkerBusy) else delay
