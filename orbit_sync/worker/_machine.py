"""One attempt's life on the worker as a pure state machine: no sockets, no threads, no clock
of its own (time comes in as arguments).

The Worker's threaded shell feeds it what happened (the start's answer, a request's failure, the
handler's return, a reconnect, a lease answer from ``worker.resume``, a cancel, a shutdown step)
and performs the actions it returns, in order. The shell holds the attempt's lock around every
call, and performs the actions after releasing it (they send requests, write the outbox and call
listeners: never under a lock). Unit tests drive every transition directly.

About 600 lines, one module: the machine, the requests it keeps and the actions it returns are
one idea, and every transition reads the same few fields; split by phase, a reconnect's rules
(which touch every phase) would live in several files.

::

    ASSIGNED --begin--> STARTING --start answered, lease lets it run--> RUNNING
                          |   \\--start answered, started but may not run--\\
                          |    \\--start answered, not started----> NOT_RUN  |
                          |--start refused / worker stopped------> NOT_RUN  |
                          v                                                 v
                     (link failure: kept, re-sent on the next connection;  FINISHING
                      transient error: re-sent after a delay)   RUNNING --handler returned /
                                                                outbox refused the launch /
                                                                shutdown or the time limit
                                                                abandoned it-->
    FINISHING --finish answered--> DELIVERED
              --finish refused---> REFUSED
              --worker stopped---> UNREPORTED

A new connection resumes every held attempt first (PROTOCOL §5.5), beside its phase:

::

    held --reconnected--> resume on the new connection, before it is published
      RUNNING: lease lets it run --> lease refreshed (a renewal due went out behind the resume)
               cancel requested ---> handler cancelled
               refused / lost -----> handler cancelled, lease reported lost
      STARTING, FINISHING: nothing; the kept start or finish goes out right behind the resume
               and its answer decides (even if the start is answered first: RUNNING then)
      connection failed: the next connection resumes it; transient: re-sent after the delay

The outbox replay feeds a dead process's stored attempts to the same machine, on a session of
its own (docs/protocol.md §13), and sends their requests through the same path:

::

    ASSIGNED --replay--> RESUMING --resume answered or refused, finish stored--> FINISHING
                                  |   (the stored finish, its original message_id)
                                  |--active lease, no finish stored----------> FINISHING
                                  |   (UNKNOWN WORKER_LOST, recorded before it is sent)
                                  |--refused / inactive lease, no finish stored--> ENDED
                                  \\--the replay stopped first----------------> UNREPORTED

A handler with a time limit, past it (the shell's timer, on the worker's clock):

::

    RUNNING --time limit passed--> context cancelled (time_limit), the handler interrupted
      handler returns within the grace --> FINISHING (FAILED HANDLER_TIMEOUT, from its ending)
      thread still running past the grace --> FINISHING (UNKNOWN HANDLER_TIMEOUT), slot stuck
      (a child process is killed by the process executor instead: the handler's ending decides)

A request (start, resume or finish) keeps its ``message_id`` for as long as it lives, so every
re-send is the same operation to the server (PROTOCOL §7). The retry/fatal classification is
:mod:`._errors`'s, shared with the outbox replay.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs

from ..errors import OrbitError, WorkerBusy
from ..models import AttemptRef, AttemptState, CommandResult, Disposition, Finish, Lease, may_run_at
from ._errors import is_link_failure, is_transient
from ._outcomes import (
    Verdict,
    abandoned,
    not_run,
    outbox_unavailable,
    timed_out,
    worker_error,
    worker_lost,
)
from ._outcomes import stored as stored_verdict
from ._time_limits import TimeLimit

__all__ = [
    "BUSY_DELAY",
    "SETTLED",
    "AttemptMachine",
    "AwaitConnection",
    "BreakConnection",
    "CancelContext",
    "Ended",
    "InterruptHandler",
    "LeaseLost",
    "LeaseView",
    "NotStarted",
    "Phase",
    "RecordFinish",
    "RefreshLease",
    "Release",
    "Reported",
    "Request",
    "ResumeEnded",
    "RetryAfter",
    "RunHandler",
    "Send",
    "SlotFreed",
    "SlotStuck",
    "TrackLease",
    "UntrackLease",
]

#: Retry delay after ``busy`` (nothing was sent; a slot frees within a round trip).
BUSY_DELAY = 0.05


class Phase(enum.Enum):
    ASSIGNED = "assigned"
    STARTING = "starting"
    #: Replay: a stored attempt's lease is being resumed on the replay session.
    RESUMING = "resuming"
    RUNNING = "running"
    FINISHING = "finishing"
    #: Settled phases: the worker is done with the attempt.
    DELIVERED = "delivered"
    REFUSED = "refused"
    NOT_RUN = "not_run"
    UNREPORTED = "unreported"
    #: Replay: the server had already ended the attempt and nothing was stored to send.
    ENDED = "ended"


SETTLED = frozenset({Phase.DELIVERED, Phase.REFUSED, Phase.NOT_RUN, Phase.UNREPORTED, Phase.ENDED})


@attrs.frozen(eq=False)
class Request:
    """A start, resume or finish, with the ``message_id`` every send of it carries."""

    request_type: str
    body: AttemptRef | Finish
    message_id: str

    @property
    def early(self) -> bool:
        """A resume: it may go out on a connection not yet published, since publishing waits
        for it to go out (every other request of the attempts waits for the publishing)."""
        return self.request_type == "worker.resume"


@attrs.frozen
class LeaseView:
    """What the shell knows of an attempt's lease when a live resume's outcome arrives: the
    clock's time, the seconds left before the local deadline, and whether the handler's context
    is already cancelled."""

    now: float
    remaining: float
    cancelled: bool


# ---------------------------------------------------------------------------------- actions


@attrs.frozen
class Send:
    """Send *request* on the current connection (pipelined; its answer comes back as an event)."""

    request: Request


@attrs.frozen
class BreakConnection:
    """Connection *gen* is unusable: close it, so the session reconnects at once."""

    gen: int


@attrs.frozen
class AwaitConnection:
    """Keep *request*; send it again on the first connection newer than *gen*."""

    gen: int
    request: Request


@attrs.frozen
class RetryAfter:
    """Send *request* again after *delay* seconds (a transient error answer)."""

    delay: float
    error: OrbitError
    request: Request


@attrs.frozen
class TrackLease:
    """Renew the attempt's lease from now on, until *deadline* unless renewed."""

    deadline: float


@attrs.frozen
class RefreshLease:
    """The lease survived a reconnect: watch *deadline*."""

    deadline: float


@attrs.frozen
class UntrackLease:
    """Stop renewing the lease."""


@attrs.frozen
class CancelContext:
    """Cancel the handler's context with *reason*."""

    reason: str


@attrs.frozen
class LeaseLost:
    """The lease did not survive a reconnect (*reason*): count it and tell the listeners."""

    reason: str


@attrs.frozen
class InterruptHandler:
    """Raise ``TimeLimitExceeded`` in the handler's thread, and step
    :meth:`AttemptMachine.time_limit_grace_passed` *grace* seconds from now."""

    grace: float


@attrs.frozen
class SlotStuck:
    """The attempt was finished while its handler still runs, past the cancel grace of
    *reason* (``time_limit`` or ``shutdown``): its thread holds a slot until it returns, if it
    ever does."""

    reason: str


@attrs.frozen
class SlotFreed:
    """A stuck handler returned at last: its slot is free (its result is dropped)."""


@attrs.frozen
class RunHandler:
    """Record the launch (outbox) and run the handler on a pool thread."""


@attrs.frozen
class RecordFinish:
    """Commit the finish to the outbox before it is sent."""

    request: Request


@attrs.frozen
class NotStarted:
    """The handler will not run and there is nothing to finish: say why."""

    why: str
    error: OrbitError | None = None


@attrs.frozen
class Reported:
    """The finish's fate: *result* (accepted), *error* (refused), or neither (the worker
    stopped first: unreported). Close the outbox entry unless unreported, count, log, tell the
    listeners."""

    verdict: Verdict
    result: CommandResult | None = None
    error: OrbitError | None = None

    @property
    def delivered(self) -> bool:
        return self.result is not None


@attrs.frozen
class Ended:
    """Replay: the server already ended the attempt (lease expired, or a finish the dead process
    delivered but could not record) and nothing was stored to send: drop its record, since
    reporting it lost would only contradict what the server knows."""

    why: str


@attrs.frozen
class ResumeEnded:
    """The live resume *request* is over (answered, refused, or its connection failed): the
    connection waiting for its resumes counts it; *refused*: the server's refusal, to log;
    *cut*: its connection failed before it was answered (that session is not established)."""

    request: Request
    refused: OrbitError | None = None
    cut: bool = False


@attrs.frozen
class Release:
    """The worker is done with the attempt."""


Action = (
    Send
    | BreakConnection
    | AwaitConnection
    | RetryAfter
    | TrackLease
    | RefreshLease
    | UntrackLease
    | CancelContext
    | InterruptHandler
    | SlotStuck
    | SlotFreed
    | LeaseLost
    | RunHandler
    | RecordFinish
    | NotStarted
    | Reported
    | Ended
    | ResumeEnded
    | Release
)

_TRACK_END = (UntrackLease(),)


class AttemptMachine:
    """The phase of one attempt and the request it has on its way. Not thread-safe by itself:
    the shell calls it under the attempt's lock."""

    __slots__ = (
        "_new_id",
        "abandoned",
        "handler_done",
        "phase",
        "ref",
        "request",
        "resume",
        "resumed_running",
        "retry_delay",
        "stored",
        "time_limit",
        "timed_out",
        "verdict",
    )

    def __init__(
        self,
        ref: AttemptRef,
        *,
        new_id: Callable[[], str],
        retry_delay: float,
        time_limit: TimeLimit | None = None,
    ) -> None:
        self.ref = ref
        #: The handler's time limit, if it has one.
        self.time_limit = time_limit
        #: The handler ran past its time limit and was interrupted.
        self.timed_out = False
        self._new_id = new_id
        self.retry_delay = retry_delay
        self.phase = Phase.ASSIGNED
        #: The start or finish on its way (sent, queued, or kept for a re-send).
        self.request: Request | None = None
        #: The verdict being finished (FINISHING and after).
        self.verdict: Verdict | None = None
        #: Shutdown gave up on the handler and finished it UNKNOWN: its late result is dropped.
        self.abandoned = False
        #: The handler's thread is done with the attempt (an abandoned handler may never be).
        self.handler_done = False
        #: Replay: the finish the dead process stored, with its original message_id.
        self.stored: Request | None = None
        #: The live resume on its way on a new connection, beside ``request`` (which may hold
        #: a start or finish kept for that connection).
        self.resume: Request | None = None
        #: Was the attempt RUNNING when ``resume`` was sent? Only then does its answer speak
        #: for the lease the handler runs on.
        self.resumed_running = False

    @property
    def settled(self) -> bool:
        return self.phase in SETTLED

    # ------------------------------------------------------------------ requests

    def begin(self) -> list[Action]:
        """The assignment was accepted: send its start."""
        if self.phase is not Phase.ASSIGNED:
            return []
        self.phase = Phase.STARTING
        self.request = Request("task.start", self.ref, self._new_id())
        return [Send(self.request)]

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
        if request is not self.request or self.phase is not Phase.STARTING:
            return []  # a stale answer: the request was given up meanwhile
        self.request = None
        lease = result.lease
        actions: list[Action] = []
        if lease.cancel_requested:
            actions.append(CancelContext("cancel_requested"))
            cancel_reason = cancel_reason or "cancel_requested"
            cancel_requested = True
        if cancel_reason is None and lease.deadline is not None and may_run_at(lease, now):
            self.phase = Phase.RUNNING
            return [*actions, TrackLease(lease.deadline), RunHandler()]
        receipt = result.receipt
        started = (
            receipt.disposition is Disposition.APPLIED
            and receipt.attempt_state is AttemptState.RUNNING
        )
        if not started:
            self.phase = Phase.NOT_RUN
            why = f"not started (lease {lease.state}, active={lease.active})"
            return [*actions, NotStarted(why), Release()]
        reason = cancel_reason or ("lease_lost" if not lease.active else "lease_expired")
        return [*actions, *self._finish(not_run(cancel_requested=cancel_requested, reason=reason))]

    def finish_answered(self, request: Request, result: CommandResult) -> list[Action]:
        """The finish was accepted (applied, kept as evidence, or deduplicated)."""
        if request is not self.request or self.phase is not Phase.FINISHING:
            return []
        assert self.verdict is not None
        self.request = None
        self.phase = Phase.DELIVERED
        return [Reported(self.verdict, result=result), Release()]

    def failed(
        self, request: Request, error: OrbitError, *, gen: int, view: LeaseView | None = None
    ) -> list[Action]:
        """*request*, sent on connection *gen* (0: it could not be sent), failed with *error*.
        *view*: the lease as the shell knows it (needed for a live resume's refusal)."""
        live_resume = request is self.resume
        if not live_resume and (request is not self.request or self.settled):
            return []
        if is_link_failure(error):
            if live_resume:
                # The next connection resumes the attempt again with a resume of its own.
                self.resume = None
                over: Action = ResumeEnded(request, cut=True)
            else:
                # Maybe sent, maybe applied: the same operation goes out again after the
                # reconnect.
                over = AwaitConnection(gen, request)
            return [BreakConnection(gen), over] if gen else [over]
        if is_transient(error):
            delay = BUSY_DELAY if isinstance(error, WorkerBusy) else self.retry_delay
            return [RetryAfter(delay, error, request)]
        if live_resume:
            assert view is not None, "a live resume's refusal is judged on the lease"
            return self._live_resumed(request, None, view, refused=error)
        self.request = None
        if self.phase is Phase.RESUMING:
            return self._resumed(None)  # refused: the lease is gone
        if self.phase is Phase.STARTING:
            self.phase = Phase.NOT_RUN
            code = getattr(error, "code", type(error).__name__)
            return [NotStarted(f"start refused ({code}); handler not run", error), Release()]
        assert self.verdict is not None
        self.phase = Phase.REFUSED
        return [Reported(self.verdict, error=error), Release()]

    def resend(self, request: Request) -> list[Action]:
        """A connection (or the retry delay) came for *request*: send it again, same id."""
        if request is self.resume and self.settled:
            return self._end_resume()  # nothing left to resume it for
        if request is not self.resume and (request is not self.request or self.settled):
            return []
        return [Send(request)]

    def gave_up(self, request: Request) -> list[Action]:
        """The worker stopped before *request* was answered."""
        if request is self.resume:
            return self._end_resume()
        if request is not self.request or self.settled:
            return []
        self.request = None
        if self.phase is Phase.RESUMING:
            self.phase = Phase.UNREPORTED  # still stored: a later replay resumes it again
            return [Release()]
        if self.phase is Phase.STARTING:
            self.phase = Phase.NOT_RUN
            return [
                NotStarted("not started: the worker stopped before start was answered"),
                Release(),
            ]
        assert self.verdict is not None
        self.phase = Phase.UNREPORTED
        return [Reported(self.verdict), Release()]

    # ------------------------------------------------------------------ outbox replay

    def replay(self, finish: Finish | None, message_id: str | None) -> list[Action]:
        """A stored attempt of a dead instance, on the replay session: resume its lease first
        (the session takes it over); *finish* and *message_id*: its stored finish, if any."""
        if self.phase is not Phase.ASSIGNED:
            return []
        if finish is not None and message_id is not None:
            self.stored = Request("task.finish", finish, message_id)
        self.phase = Phase.RESUMING
        self.request = Request("worker.resume", self.ref, self._new_id())
        return [Send(self.request)]

    def resume_answered(
        self, request: Request, lease: Lease, view: LeaseView | None = None
    ) -> list[Action]:
        """A resume was answered with *lease*: a live one (*view*: the lease as the shell
        knows it), or the replay's."""
        if request is self.resume:
            assert view is not None, "a live resume's answer is judged on the lease"
            return self._live_resumed(request, lease, view)
        if request is not self.request or self.phase is not Phase.RESUMING:
            return []
        self.request = None
        return self._resumed(lease)

    def _resumed(self, lease: Lease | None) -> list[Action]:
        stored = self.stored
        if stored is not None:
            # Sent either way: the server applies it within the lease, keeps it as evidence
            # after, and answers a repeat with the original receipt.
            assert isinstance(stored.body, Finish)
            self.phase = Phase.FINISHING
            self.verdict = stored_verdict(stored.body)
            self.request = stored
            return [Send(stored)]
        if lease is not None and lease.active:
            # Launched, never finished, still leased: its effect is uncertain; say so now
            # rather than at lease expiry. Recorded first: a cut replay re-sends the same one.
            return self._finish(worker_lost())
        self.phase = Phase.ENDED
        return [Ended("refused" if lease is None else f"lease {lease.state}"), Release()]

    # ------------------------------------------------------------------ the handler

    def handler_returned(self, verdict: Verdict) -> list[Action]:
        """The handler ended with *verdict*: finish it, unless it was abandoned already."""
        if self.handler_done:
            return []
        self.handler_done = True
        if self.abandoned:
            return [SlotFreed()]  # finished UNKNOWN already: this result is dropped
        if self.phase is not Phase.RUNNING:
            return []
        return [*_TRACK_END, *self._finish(verdict)]

    def launch_refused(self) -> list[Action]:
        """The outbox could not record the launch: the handler must not run."""
        return self.handler_returned(outbox_unavailable())

    def crashed(self) -> list[Action]:
        """A step of this attempt raised unexpectedly (a bug of ours): finish it UNKNOWN rather
        than drop it; if its finish was already decided, keep it for a re-send (same
        ``message_id``: a copy that did go out is answered as a duplicate). A live resume on
        its way is over: its connection must not wait for it."""
        if self.resume is not None:
            return [*self._end_resume(), *self.crashed()]
        if self.phase in (Phase.STARTING, Phase.RUNNING):
            self.handler_done = True
            return [*_TRACK_END, *self._finish(worker_error())]
        if self.phase is Phase.ASSIGNED:
            self.phase = Phase.NOT_RUN
            return [NotStarted("not started: worker error"), Release()]
        if self.phase is Phase.FINISHING and self.request is not None:
            return [AwaitConnection(0, self.request)]
        return []

    # ------------------------------------------------------------------ leases and cancels

    def reconnected(self) -> list[Action]:
        """A new connection is open (not yet published) while the worker holds the attempt:
        resume its lease there first (PROTOCOL §5.5). A start or finish kept for the new
        connection stays kept: it goes out, same ``message_id``, once the connection is
        published, which waits for every resume to go out (so it follows this one)."""
        if self.settled or self.phase is Phase.RESUMING:
            return []  # settled: nothing to resume; RESUMING: the replay's own session
        self.resume = Request("worker.resume", self.ref, self._new_id())
        self.resumed_running = self.phase is Phase.RUNNING
        return [Send(self.resume)]

    def resumed(
        self,
        lease: Lease | None,
        *,
        now: float,
        remaining: float,
        cancelled: bool,
    ) -> list[Action]:
        """What a live resume's answer means for the attempt (``None``: refused). (A renew the
        old connection left unanswered went out behind the resume: the watchdog's.)"""
        if not self.resumed_running or self.phase is not Phase.RUNNING or cancelled:
            # Starting or finishing when the resume was sent: their own request goes out right
            # behind it, and its answer decides. A start kept for the connection may already
            # be answered (its answer is stepped on the reader, the resume's on the connection
            # thread): the resume's lease, from before the start was applied, is then a
            # reservation that says nothing of the lease the handler now runs on.
            return []
        if lease is not None and lease.cancel_requested:
            return [UntrackLease(), CancelContext("cancel_requested")]
        if lease is not None and lease.deadline is not None and may_run_at(lease, now):
            return [RefreshLease(lease.deadline)]
        reason = "lease_expired" if remaining <= 0 else "session_replaced"
        return [UntrackLease(), CancelContext(reason), LeaseLost(reason)]

    def shutdown_cancel(self) -> list[Action]:
        """Shutdown's cancel step: a starting or running handler is told to stop."""
        if self.phase in (Phase.STARTING, Phase.RUNNING):
            return [CancelContext("shutdown")]
        return []

    def abandon(self) -> list[Action]:
        """Shutdown gave up waiting for the handler: finish UNKNOWN (``SHUTDOWN_TIMEOUT``)."""
        return self._abandon(abandoned(), "shutdown")

    def time_limit_passed(self) -> list[Action]:
        """The handler has run for its time limit: cancel its context (``time_limit``) and, on a
        thread, interrupt it, giving it the grace to stop. A handler in a child process is
        interrupted there by the process executor, which kills the child past the grace."""
        limit = self.time_limit
        if limit is None or self.timed_out or self.phase is not Phase.RUNNING:
            return []
        if self.handler_done:
            return []
        self.timed_out = True
        if limit.in_process:
            return [CancelContext("time_limit")]
        return [CancelContext("time_limit"), InterruptHandler(limit.grace)]

    def time_limit_grace_passed(self) -> list[Action]:
        """The grace after the time limit is over and the handler's thread still runs: it cannot
        be stopped, so its effect is uncertain: finish UNKNOWN (``HANDLER_TIMEOUT``)."""
        if not self.timed_out:
            return []
        return self._abandon(timed_out(), "time_limit")

    # ------------------------------------------------------------------ internal

    def _abandon(self, verdict: Verdict, reason: str) -> list[Action]:
        """Give up waiting for a handler that does not stop: finish with *verdict* (UNKNOWN)
        now; its thread keeps a slot (stuck) until it returns, and its late result is dropped."""
        if self.phase is not Phase.RUNNING or self.handler_done:
            return []
        self.abandoned = True
        return [*_TRACK_END, SlotStuck(reason), *self._finish(verdict)]

    def _live_resumed(
        self,
        request: Request,
        lease: Lease | None,
        view: LeaseView,
        *,
        refused: OrbitError | None = None,
    ) -> list[Action]:
        """A live resume is over: its answer's meaning, then the end the connection counts."""
        self.resume = None
        meaning = self.resumed(
            lease,
            now=view.now,
            remaining=view.remaining,
            cancelled=view.cancelled,
        )
        return [*meaning, ResumeEnded(request, refused)]

    def _end_resume(self) -> list[Action]:
        request, self.resume = self.resume, None
        return [] if request is None else [ResumeEnded(request)]

    def _finish(self, verdict: Verdict) -> list[Action]:
        self.phase = Phase.FINISHING
        self.verdict = verdict
        self.request = Request("task.finish", verdict.finish(self.ref), self._new_id())
        return [RecordFinish(self.request), Send(self.request)]
