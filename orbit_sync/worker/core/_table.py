"""What an attempt's machine (:mod:`._machine`) works with, and its one table (h11's way).

The requests it sends, what the shell knows of a lease when it asks, the watchdog's report of a
renewal, and the actions it returns for the shell to perform. ``TABLE[trigger][phase]`` is the
phase a trigger moves the attempt to and the kinds (classes) of the actions it returns, in
order; the phases that refuse a trigger (:data:`REFUSED`), and those it can never arrive in
(:data:`IMPOSSIBLE`, a bug: :class:`MachineError`). The diagrams: docs/architecture.md, "One
attempt"."""

from __future__ import annotations

import enum

import attrs

from ...errors import OrbitError
from ...models import AttemptRef, CommandResult, Finish, Lease
from ._outcomes import Verdict


@attrs.frozen(eq=False)
class Request:
    """A start, resume or finish, with the ``message_id`` every send of it carries."""

    request_type: str
    body: AttemptRef | Finish
    message_id: str

    @property
    def early(self) -> bool:
        """A resume: it may go out on a connection not yet published (publishing waits for it)."""
        return self.request_type == "worker.resume"


@attrs.frozen
class LeaseView:
    """The lease as the shell knows it when a live resume's outcome arrives: the clock's time,
    the seconds left before the local deadline, whether the handler's context is cancelled."""

    now: float
    remaining: float
    cancelled: bool


@attrs.frozen
class RenewAnswer:
    """What became of a renewal, as the lease watchdog reports it: the server's *lease*, or the
    *error* it failed with, or neither (the local deadline passed first). *behind_resume*: it
    went out right behind a new connection's resumes, so a loss answering it is the resume's.
    *lag*: how late the watchdog sent it."""

    lease: Lease | None = None
    error: BaseException | None = None
    behind_resume: bool = False
    lag: float = 0.0


# ---------------------------------------------------------------------------------- actions


@attrs.frozen
class Action:
    """Something the shell is to do for the attempt; the table names each by its class."""


@attrs.frozen
class Send(Action):
    """Send *request* on the current connection (pipelined; its answer comes back as an event)."""

    request: Request


@attrs.frozen
class BreakConnection(Action):
    """Close connection *gen*, so the session reconnects at once (0: there was none)."""

    gen: int


@attrs.frozen
class Keep(Action):
    """Keep *request*; send it again on the first connection newer than *newer_than*, after
    *delay* seconds (*error*: the transient answer that delays it)."""

    request: Request
    newer_than: int = 0
    delay: float = 0.0
    error: OrbitError | None = None


@attrs.frozen
class TrackLease(Action):
    """Renew the lease (just granted, until *deadline*) from now on."""

    deadline: float


@attrs.frozen
class RefreshLease(Action):
    """The lease survived a reconnect: watch *deadline*."""

    deadline: float


@attrs.frozen
class UntrackLease(Action):
    """Stop renewing the lease."""


@attrs.frozen
class CancelContext(Action):
    """Cancel the handler's context with *reason*."""

    reason: str


@attrs.frozen
class LeaseLost(Action):
    """The lease is gone (*detail*: the server's error code): count it, say so, tell the
    listeners. *resume*: a reconnect's resume found it lost (else a renewal or the deadline)."""

    reason: str
    resume: bool = True
    detail: str = ""


@attrs.frozen
class LeaseRenewed(Action):
    """Tell the listeners that a renewal was granted (*lag*: how late it went out)."""

    lag: float


@attrs.frozen
class RenewAfter(Action):
    """Renew again, same ``message_id``, after *delay* seconds (or at the deadline if sooner)."""

    delay: float
    error: BaseException


@attrs.frozen
class InterruptHandler(Action):
    """Raise ``TimeLimitExceeded`` in the handler's thread; step
    :meth:`AttemptMachine.time_limit_grace_passed` *grace* seconds from now."""

    grace: float


@attrs.frozen
class SlotStuck(Action):
    """Finished while its handler still runs past the cancel grace of *reason*: its thread
    holds a slot until it returns, if it ever does."""

    reason: str


@attrs.frozen
class SlotFreed(Action):
    """A stuck handler returned at last: its slot is free (its result is dropped)."""


@attrs.frozen
class RunHandler(Action):
    """Record the launch (outbox) and run the handler on a pool thread."""


@attrs.frozen
class HandlerOutcome(Action):
    """Say how the handler ended: the *verdict* the outcome rules gave it, and the exception it
    raised (*error*), whose traceback stays in the worker's log."""

    verdict: Verdict
    error: BaseException | None = None


@attrs.frozen
class RecordFinish(Action):
    """Commit the finish to the outbox before it is sent."""

    request: Request


@attrs.frozen
class NotStarted(Action):
    """The handler will not run and there is nothing to finish: say why."""

    why: str
    error: OrbitError | None = None


@attrs.frozen
class Reported(Action):
    """The finish's fate: *result* (accepted), *error* (refused), or neither (unreported)."""

    verdict: Verdict
    result: CommandResult | None = None
    error: OrbitError | None = None

    @property
    def delivered(self) -> bool:
        return self.result is not None


@attrs.frozen
class Ended(Action):
    """Replay: the server already ended the attempt and nothing was stored to send: drop its
    record (reporting it lost would only contradict what the server knows)."""

    why: str


@attrs.frozen
class ResumeEnded(Action):
    """The live resume *request* is over, for the connection waiting for its resumes;
    *refused*: the server's refusal; *cut*: its connection failed first."""

    request: Request
    refused: OrbitError | None = None
    cut: bool = False


@attrs.frozen
class Release(Action):
    """The worker is done with the attempt."""


@attrs.frozen
class Skipped(Action):
    """The assignment is not taken (*why*); *count*: the counter it adds to, if any."""

    why: str
    count: str | None = None


# ---------------------------------------------------------------------- phases, triggers, table


class Phase(enum.Enum):
    # Members are singletons equal only to themselves: the identity hash (C) spares every
    # lookup in TABLE a call of Enum.__hash__, which is Python code hashing the name.
    __hash__ = object.__hash__

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


class Trigger(enum.Enum):
    """What happened to an attempt, as the table knows it: each event method reads its data
    into one trigger."""

    __hash__ = object.__hash__  # as Phase's

    ADMITTED = "admitted: send the start"
    ADMITTED_STOPPING = "admitted after the drain: started with its context cancelled"
    SKIPPED = "not taken: assigned again (a handler runs once, PROTOCOL §6.1), or no handler"
    START_RUNS = "start: the lease lets the handler run"
    START_MAY_NOT_RUN = "start: started, but the lease (or the context) forbids the run"
    START_CANCEL_REQUESTED = "start: started, cancel requested"
    START_NOT_STARTED = "start: not started"
    START_NOT_STARTED_CANCELLED = "start: not started, cancel requested"
    FINISH_ANSWERED = "finish answered"
    LINK_FAILED = "request: connection failed (maybe sent): kept for the next connection"
    TRANSIENT = "request: transient error: sent again after the retry delay"
    REFUSED = "request: refused for good"
    RESEND = "request: a connection (or the retry delay) came for it"
    GAVE_UP = "request: the worker stopped before it was answered"
    REPLAY = "replay: a stored attempt of a dead process enters the machine"
    REPLAY_STORED = "replay: resumed, a finish is stored: send it"
    REPLAY_LEASE_ACTIVE = "replay: resumed, nothing stored, lease active: UNKNOWN WORKER_LOST"
    REPLAY_LEASE_GONE = "replay: resumed, nothing stored, lease gone: drop the record"
    HANDLER_RETURNED = "handler returned"
    HANDLER_ENDED = "handler ended: the outcome rules give its verdict"
    STUCK_HANDLER_RETURNED = "an abandoned attempt's handler returned at last"
    CRASHED = "a step of the attempt raised (a bug of ours)"
    RECONNECTED = "reconnected: resume the lease there first (PROTOCOL §5.5)"
    RESUME_HOLDS = "resume: the lease the handler runs on holds"
    RESUME_CANCEL_REQUESTED = "resume: cancel requested"
    RESUME_LOST = "resume: the lease did not survive the reconnect"
    RESUME_OVER = "resume: over, saying nothing of the lease the handler runs on"
    RESUME_LINK_FAILED = "resume: link failed"
    RENEWED = "renewal: granted"
    RENEW_FAILED = "renewal: failed for now (transient, or nothing sent): sent again later"
    STOP_RUNNING = "renewal: cancel requested; or time limit: a child process's handler reached it"
    LEASE_ENDED = "lease: the deadline passed unrenewed, or a renewal says it is gone"
    CANCEL_PUSHED = "task.cancel pushed"
    SHUTDOWN_CANCEL = "shutdown: cancel"
    ABANDON = "the handler does not stop: shutdown's wait, or a time limit's grace, is over"
    TIME_LIMIT = "time limit: the handler on a thread reached it"


@attrs.frozen
class Transition:
    """What a trigger does in a phase: the phase after it, and its actions' kinds in order."""

    to: Phase
    actions: tuple[type[Action], ...]


_A, _S, _R, _F = Phase.ASSIGNED, Phase.STARTING, Phase.RUNNING, Phase.FINISHING
_RS = Phase.RESUMING
#: Phases in which the worker holds a live attempt (and a reconnect resumes its lease).
_HELD = (_S, _R, _F)
#: Where a finish ends (and an abandoned handler may still return).
_FINISHED = (Phase.DELIVERED, Phase.REFUSED, Phase.UNREPORTED)
#: Where a live resume may be on its way: it outlives the phase it was sent in.
_RESUMED = (*_HELD, *_FINISHED, Phase.NOT_RUN)
_FINISH = (RecordFinish, Send)
_STARTS_FINISH = (UntrackLease, RecordFinish, Send)
#: A running handler told to stop: its lease is renewed no more, its context cancelled.
_STOP = (UntrackLease, CancelContext)


def _stay(phases: tuple[Phase, ...], *actions: type[Action]) -> dict[Phase, Transition]:
    return {phase: Transition(phase, actions) for phase in phases}


#: The transitions: ``TABLE[trigger][phase]``. A phase not listed for a trigger refuses it (a
#: stale answer, an event its phase is past): no move, no action.
TABLE: dict[Trigger, dict[Phase, Transition]] = {
    Trigger.ADMITTED: {_A: Transition(_S, (Send,))},
    Trigger.ADMITTED_STOPPING: {_A: Transition(_S, (CancelContext, Send))},
    Trigger.SKIPPED: {_A: Transition(Phase.NOT_RUN, (Skipped,))},
    Trigger.START_RUNS: {_S: Transition(_R, (TrackLease, RunHandler))},
    Trigger.START_MAY_NOT_RUN: {_S: Transition(_F, _FINISH)},
    Trigger.START_CANCEL_REQUESTED: {_S: Transition(_F, (CancelContext, *_FINISH))},
    Trigger.START_NOT_STARTED: {_S: Transition(Phase.NOT_RUN, (NotStarted, Release))},
    Trigger.START_NOT_STARTED_CANCELLED: {
        _S: Transition(Phase.NOT_RUN, (CancelContext, NotStarted, Release))
    },
    Trigger.FINISH_ANSWERED: {_F: Transition(Phase.DELIVERED, (Reported, Release))},
    Trigger.LINK_FAILED: _stay((_S, _F, _RS), BreakConnection, Keep),
    Trigger.TRANSIENT: _stay((*_HELD, _RS), Keep),
    Trigger.REFUSED: {
        _S: Transition(Phase.NOT_RUN, (NotStarted, Release)),
        _F: Transition(Phase.REFUSED, (Reported, Release)),
    },
    Trigger.RESEND: _stay((*_HELD, _RS), Send),
    Trigger.GAVE_UP: {
        _S: Transition(Phase.NOT_RUN, (NotStarted, Release)),
        _F: Transition(Phase.UNREPORTED, (Reported, Release)),
        _RS: Transition(Phase.UNREPORTED, (Release,)),
    },
    Trigger.REPLAY: {_A: Transition(_RS, (Send,))},
    Trigger.REPLAY_STORED: {_RS: Transition(_F, (Send,))},
    Trigger.REPLAY_LEASE_ACTIVE: {_RS: Transition(_F, _FINISH)},
    Trigger.REPLAY_LEASE_GONE: {_RS: Transition(Phase.ENDED, (Ended, Release))},
    Trigger.HANDLER_RETURNED: {_R: Transition(_F, _STARTS_FINISH)},
    Trigger.HANDLER_ENDED: {_R: Transition(_F, (HandlerOutcome, *_STARTS_FINISH))},
    Trigger.STUCK_HANDLER_RETURNED: _stay((_F, *_FINISHED), SlotFreed),
    Trigger.CRASHED: {
        _A: Transition(Phase.NOT_RUN, (NotStarted, Release)),
        _S: Transition(_F, _STARTS_FINISH),
        _R: Transition(_F, _STARTS_FINISH),
        _F: Transition(_F, (Keep,)),
    },
    Trigger.RECONNECTED: _stay(_HELD, Send),
    Trigger.RESUME_HOLDS: _stay((_R,), RefreshLease, ResumeEnded),
    Trigger.RESUME_CANCEL_REQUESTED: _stay((_R,), *_STOP, ResumeEnded),
    Trigger.RESUME_LOST: _stay((_R,), *_STOP, LeaseLost, ResumeEnded),
    Trigger.RESUME_OVER: _stay(_RESUMED, ResumeEnded),
    Trigger.RESUME_LINK_FAILED: _stay(_RESUMED, BreakConnection, ResumeEnded),
    Trigger.RENEWED: _stay((_R,), TrackLease, LeaseRenewed),
    Trigger.RENEW_FAILED: _stay((_R,), RenewAfter),
    Trigger.STOP_RUNNING: _stay((_R,), *_STOP),
    Trigger.LEASE_ENDED: _stay((_R,), *_STOP, LeaseLost),
    Trigger.CANCEL_PUSHED: {**_stay((_A, _S), CancelContext), **_stay((_R,), *_STOP)},
    Trigger.SHUTDOWN_CANCEL: {**_stay((_S,), CancelContext), **_stay((_R,), *_STOP)},
    Trigger.ABANDON: {_R: Transition(_F, (UntrackLease, SlotStuck, *_FINISH))},
    Trigger.TIME_LIMIT: _stay((_R,), *_STOP, InterruptHandler),
}

#: The triggers that may arrive in any phase, racing whatever moved the attempt on: a cancel
#: push, a shutdown step, the watchdog's report of a renewal, a time limit's timer, a reconnect
#: (it steps every attempt held), a bug's recovery. In a phase the table does not list for them
#: they do nothing. Every other trigger arrives only in a phase the table lists (its method
#: checks that the request or handler it speaks of is still the attempt's first): anywhere else it
#: is a bug of ours, and :meth:`AttemptMachine.fire` raises :class:`MachineError`, as h11 does.
ANY_PHASE = frozenset(
    {
        Trigger.CANCEL_PUSHED,
        Trigger.SHUTDOWN_CANCEL,
        Trigger.ABANDON,
        Trigger.RENEWED,
        Trigger.RENEW_FAILED,
        Trigger.STOP_RUNNING,
        Trigger.LEASE_ENDED,
        Trigger.TIME_LIMIT,
        Trigger.RECONNECTED,
        Trigger.CRASHED,
    }
)

#: For each trigger, the phases that refuse it: no move, no action (the phases the table does
#: not list for it, when it is one of :data:`ANY_PHASE`).
REFUSED: dict[Trigger, frozenset[Phase]] = {
    trigger: frozenset(Phase) - moves.keys() if trigger in ANY_PHASE else frozenset()
    for trigger, moves in TABLE.items()
}

#: For each trigger, the phases it can never arrive in: firing it there raises MachineError.
IMPOSSIBLE: dict[Trigger, frozenset[Phase]] = {
    trigger: frozenset(Phase) - moves.keys() - REFUSED[trigger] for trigger, moves in TABLE.items()
}


class MachineError(AssertionError):
    """An event arrived in a phase the table does not list for it: a bug of the worker's (the
    shell finishes the attempt UNKNOWN, logged with the traceback)."""
