"""The attempt state machine, driven through every transition with no sockets and no threads."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest

from orbit_sync.errors import WorkerBusy, WorkerDisconnected, WorkerError
from orbit_sync.models import (
    AttemptRef,
    AttemptState,
    CommandResult,
    Disposition,
    Lease,
    Operation,
    Outcome,
    Receipt,
    TaskState,
    new_id,
    new_secret,
)
from orbit_sync.worker.core._errors import NotConnected
from orbit_sync.worker.core._machine import (
    BUSY_DELAY,
    AttemptMachine,
    BreakConnection,
    CancelContext,
    Keep,
    LeaseLost,
    LeaseView,
    MachineError,
    NotStarted,
    Phase,
    RecordFinish,
    RefreshLease,
    Release,
    Reported,
    ResumeEnded,
    RunHandler,
    Send,
    SlotFreed,
    SlotStuck,
    TrackLease,
    UntrackLease,
)
from orbit_sync.worker.core._outcomes import outcome_of

_T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
NOW = 100.0


def _lease(
    *, active: bool = True, state: AttemptState = AttemptState.RUNNING, cancel: bool = False
) -> Lease:
    lease = Lease(active, state, _T0 + dt.timedelta(seconds=30), _T0, _T0 if cancel else None)
    return lease.with_deadline(NOW)


def _result(
    lease: Lease | None = None,
    *,
    applied: bool = True,
    attempt_state: AttemptState = AttemptState.RUNNING,
) -> CommandResult:
    lease = lease or _lease()
    disposition = Disposition.APPLIED if applied else Disposition.EVIDENCE_ONLY
    receipt = Receipt(
        Operation.START, TaskState.RUNNING, attempt_state, 1, lease.lease_until, disposition
    )
    return CommandResult(receipt, lease, False)


def _machine() -> AttemptMachine:
    ref = AttemptRef(new_id(), new_id(), 1, new_secret())
    ids = (f"{n:032x}" for n in itertools.count(1))
    return AttemptMachine(ref, new_id=lambda: next(ids), retry_delay=1.0)


def _kinds(actions: list[object]) -> list[type]:
    return [type(a) for a in actions]


def _begin(m: AttemptMachine) -> list[object]:
    """The intake took the assignment and a handler here runs it: the start goes out."""
    return m.assigned(again=False, runnable=True, stopping=False)


def _started(m: AttemptMachine) -> None:
    _begin(m)
    assert m.request is not None
    m.start_answered(m.request, _result(), now=NOW, cancel_reason=None, cancel_requested=False)


def _finishing(m: AttemptMachine) -> None:
    _started(m)
    m.handler_returned(outcome_of(value={"ok": 1}))


def test_an_admitted_assignment_sends_the_start_once() -> None:
    """An accepted assignment sends one start; admitting the same machine again is a bug of the
    worker's, raised (MachineError) with nothing sent and the phase kept."""
    m = _machine()
    actions = _begin(m)
    assert actions == [Send(m.request)] and m.phase is Phase.STARTING
    assert m.request is not None and m.request.request_type == "task.start"
    request = m.request
    with pytest.raises(MachineError):
        _begin(m)
    assert m.phase is Phase.STARTING and m.request is request


def test_start_answered_with_a_running_lease_runs_the_handler() -> None:
    """A start whose lease lets the handler run tracks the lease and runs it."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    actions = m.start_answered(
        m.request, _result(), now=NOW, cancel_reason=None, cancel_requested=False
    )
    assert _kinds(actions) == [TrackLease, RunHandler] and m.phase is Phase.RUNNING
    assert m.request is None


def test_start_answered_not_started_releases_without_a_finish() -> None:
    """A start that did not start the attempt (evidence only) runs nothing and sends nothing."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    lease = _lease(active=False, state=AttemptState.EXPIRED)
    actions = m.start_answered(
        m.request,
        _result(lease, applied=False),
        now=NOW,
        cancel_reason=None,
        cancel_requested=False,
    )
    assert _kinds(actions) == [NotStarted, Release] and m.phase is Phase.NOT_RUN


def test_start_answered_with_a_cancel_request_finishes_cancelled_without_running() -> None:
    """A lease carrying a cancel request cancels the context and finishes CANCELLED, not run."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    actions = m.start_answered(
        m.request,
        _result(_lease(cancel=True)),
        now=NOW,
        cancel_reason=None,
        cancel_requested=False,
    )
    assert _kinds(actions) == [CancelContext, RecordFinish, Send]
    assert actions[0] == CancelContext("cancel_requested")
    assert m.phase is Phase.FINISHING and m.verdict is not None
    assert m.verdict.outcome is Outcome.CANCELLED and not m.verdict.ran


def test_start_answered_after_a_cancelled_context_finishes_not_run() -> None:
    """A context cancelled (shutdown) before the start's answer finishes FAILED, not run."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    actions = m.start_answered(
        m.request, _result(), now=NOW, cancel_reason="shutdown", cancel_requested=False
    )
    assert _kinds(actions) == [RecordFinish, Send]
    assert m.verdict is not None and m.verdict.error_code == "WORKER_SHUTDOWN"


def test_start_answered_past_the_deadline_finishes_lease_expired() -> None:
    """A lease whose local deadline has already passed does not run the handler."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    actions = m.start_answered(
        m.request, _result(), now=NOW + 3600, cancel_reason=None, cancel_requested=False
    )
    assert _kinds(actions) == [RecordFinish, Send]
    assert m.verdict is not None and m.verdict.error_code == "LEASE_EXPIRED"


def test_a_stale_answer_is_ignored() -> None:
    """An answer to a request the machine no longer has changes nothing."""
    m = _machine()
    _begin(m)
    old = m.request
    assert old is not None
    m.gave_up(old)
    assert (
        m.start_answered(old, _result(), now=NOW, cancel_reason=None, cancel_requested=False) == []
    )
    assert m.failed(old, WorkerDisconnected("x"), gen=1) == []
    assert m.resend(old) == []


def test_link_failure_keeps_the_request_for_the_next_connection() -> None:
    """A start cut with its connection closes it and waits for a newer one, same message_id."""
    m = _machine()
    _begin(m)
    request = m.request
    assert request is not None
    actions = m.failed(request, WorkerDisconnected("cut"), gen=3)
    assert actions == [BreakConnection(3), Keep(request, newer_than=3)]
    assert m.request is request and m.phase is Phase.STARTING
    assert m.resend(request) == [Send(request)]
    # Nothing was sent (no connection 0 to break): only wait.
    assert m.failed(request, WorkerDisconnected("none"), gen=0) == [
        BreakConnection(0),
        Keep(request),
    ]


def test_no_connection_waits_for_the_first_one_published() -> None:
    """A start or finish that found no connection waits for one, not for a retry delay."""
    m = _machine()
    _begin(m)
    start = m.request
    assert start is not None
    # An assignment read while its connection is still being reconciled (not yet published).
    assert m.failed(start, NotConnected("no connection"), gen=0) == [
        BreakConnection(0),
        Keep(start),
    ]
    assert m.request is start and m.phase is Phase.STARTING
    m = _machine()
    _finishing(m)
    finish = m.request
    assert finish is not None and m.phase is Phase.FINISHING
    assert m.failed(finish, NotConnected("no connection"), gen=0) == [
        BreakConnection(0),
        Keep(finish),
    ]


def test_stale_session_is_a_link_failure() -> None:
    """STALE_SESSION means the connection is dead: re-send after the reconnect."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    error = WorkerError("STALE_SESSION", "old")
    assert _kinds(m.failed(m.request, error, gen=2)) == [BreakConnection, Keep]


def test_transient_answers_retry_after_a_delay() -> None:
    """RATE_LIMITED retries after the retry delay; our own busy after the short busy delay."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    limited = WorkerError("RATE_LIMITED", "slow down")
    assert m.failed(m.request, limited, gen=1) == [Keep(m.request, delay=1.0, error=limited)]
    busy = WorkerBusy("full")
    assert m.failed(m.request, busy, gen=1) == [Keep(m.request, delay=BUSY_DELAY, error=busy)]
    assert m.phase is Phase.STARTING


def test_a_refused_start_releases_without_running() -> None:
    """A start refused for good (LEASE_LOST) runs nothing and releases the attempt."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    actions = m.failed(m.request, WorkerError("LEASE_LOST", "gone"), gen=1)
    assert _kinds(actions) == [NotStarted, Release] and m.phase is Phase.NOT_RUN


def test_handler_return_finishes_with_its_verdict() -> None:
    """The handler's return untracks the lease, records the finish, then sends it."""
    m = _machine()
    _started(m)
    actions = m.handler_returned(outcome_of(value={"ok": 1}))
    assert _kinds(actions) == [UntrackLease, RecordFinish, Send]
    record, send = actions[1], actions[2]
    assert isinstance(record, RecordFinish) and isinstance(send, Send)
    assert record.request is send.request and send.request.request_type == "task.finish"
    assert m.phase is Phase.FINISHING and m.handler_done


def test_launch_refused_finishes_outbox_unavailable() -> None:
    """An outbox that cannot record the launch finishes FAILED OUTBOX_UNAVAILABLE, not run."""
    m = _machine()
    _started(m)
    m.launch_refused()
    assert m.verdict is not None and m.verdict.error_code == "OUTBOX_UNAVAILABLE"


def test_finish_answered_reports_delivery() -> None:
    """An accepted finish reports the verdict as delivered and releases the attempt."""
    m = _machine()
    _finishing(m)
    assert m.request is not None
    result = _result()
    actions = m.finish_answered(m.request, result)
    assert _kinds(actions) == [Reported, Release] and m.phase is Phase.DELIVERED
    reported = actions[0]
    assert isinstance(reported, Reported) and reported.delivered and reported.result is result


def test_finish_refused_reports_not_delivered() -> None:
    """A finish refused for good is reported refused (the outbox entry is closed)."""
    m = _machine()
    _finishing(m)
    assert m.request is not None
    error = WorkerError("LEASE_LOST", "gone")
    actions = m.failed(m.request, error, gen=1)
    assert _kinds(actions) == [Reported, Release] and m.phase is Phase.REFUSED
    reported = actions[0]
    assert isinstance(reported, Reported) and reported.error is error and not reported.delivered


def test_finish_cut_is_kept_and_resent_with_its_id() -> None:
    """A finish whose connection failed is re-sent as the same request after the reconnect."""
    m = _machine()
    _finishing(m)
    request = m.request
    assert request is not None
    assert _kinds(m.failed(request, WorkerDisconnected("cut"), gen=1)) == [
        BreakConnection,
        Keep,
    ]
    assert m.resend(request) == [Send(request)]
    assert _kinds(m.finish_answered(request, _result())) == [Reported, Release]


def test_worker_stopping_leaves_the_finish_unreported() -> None:
    """A finish still waiting when the worker stops is reported unreported (not delivered)."""
    m = _machine()
    _finishing(m)
    assert m.request is not None
    actions = m.gave_up(m.request)
    assert _kinds(actions) == [Reported, Release] and m.phase is Phase.UNREPORTED
    reported = actions[0]
    assert isinstance(reported, Reported) and reported.error is None and not reported.delivered


def test_worker_stopping_before_the_start_answer_runs_nothing() -> None:
    """A start still waiting when the worker stops ends the attempt, not run."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    assert _kinds(m.gave_up(m.request)) == [NotStarted, Release]
    assert m.phase is Phase.NOT_RUN


def test_abandon_finishes_unknown_and_drops_the_late_result() -> None:
    """Shutdown abandons a running handler (UNKNOWN, its slot stuck); its later return is
    dropped and frees the slot."""
    m = _machine()
    _started(m)
    actions = m.abandon()
    assert _kinds(actions) == [UntrackLease, SlotStuck, RecordFinish, Send] and m.abandoned
    assert actions[1] == SlotStuck("shutdown")
    assert m.verdict is not None and m.verdict.outcome is Outcome.UNKNOWN
    assert m.verdict.error_code == "SHUTDOWN_TIMEOUT"
    assert m.handler_returned(outcome_of(value=1)) == [SlotFreed()] and m.handler_done
    assert m.verdict.error_code == "SHUTDOWN_TIMEOUT"


def test_abandon_is_nothing_once_the_handler_returned() -> None:
    """A handler that returned just before the abandon step keeps its own finish."""
    m = _machine()
    _finishing(m)
    assert m.abandon() == [] and not m.abandoned


def test_crash_while_running_finishes_unknown() -> None:
    """An unexpected error in a step of a started attempt finishes it UNKNOWN, never drops it."""
    m = _machine()
    _started(m)
    actions = m.crashed()
    assert _kinds(actions) == [UntrackLease, RecordFinish, Send]
    assert m.verdict is not None and m.verdict.outcome is Outcome.UNKNOWN
    assert m.verdict.error_code == "WORKER_ERROR"


def test_crash_while_starting_finishes_unknown_and_drops_the_late_answer() -> None:
    """A crash before the start's answer finishes UNKNOWN; the late start answer is ignored."""
    m = _machine()
    _begin(m)
    start = m.request
    assert start is not None
    assert _kinds(m.crashed()) == [UntrackLease, RecordFinish, Send]
    assert (
        m.start_answered(start, _result(), now=NOW, cancel_reason=None, cancel_requested=False)
        == []
    )


def test_crash_before_the_start_or_after_the_finish() -> None:
    """A crash before anything was sent ends the attempt; once its finish is decided, the
    finish is kept for a re-send with its message_id; once settled, nothing."""
    m = _machine()
    assert _kinds(m.crashed()) == [NotStarted, Release]
    m = _machine()
    _finishing(m)
    finish = m.request
    assert finish is not None
    assert m.crashed() == [Keep(finish)] and m.request is finish
    m.finish_answered(finish, _result())
    assert m.crashed() == []


@pytest.mark.parametrize(
    ("lease", "remaining", "expected"),
    [
        (_lease(), 5.0, [RefreshLease, ResumeEnded]),
        (_lease(cancel=True), 5.0, [UntrackLease, CancelContext, ResumeEnded]),
        (None, 5.0, [UntrackLease, CancelContext, LeaseLost, ResumeEnded]),
        (
            _lease(active=False, state=AttemptState.EXPIRED),
            0.0,
            [UntrackLease, CancelContext, LeaseLost, ResumeEnded],
        ),
    ],
)
def test_resume_answers(lease: Lease | None, remaining: float, expected: list[type]) -> None:
    """A resumed running attempt is refreshed, cancelled, or has lost its lease."""
    m = _machine()
    _started(m)
    m.reconnected()  # the resume goes out while it runs
    resume = m.resume
    assert resume is not None
    view = LeaseView(now=NOW, remaining=remaining, cancelled=False)
    if lease is None:
        actions = m.failed(resume, WorkerError("LEASE_LOST", "gone"), gen=1, view=view)
    else:
        actions = m.resume_answered(resume, lease, view)
    assert _kinds(actions) == expected
    if LeaseLost in expected:
        reason = "lease_expired" if remaining <= 0 else "session_replaced"
        assert actions[2] == LeaseLost(reason) and actions[1] == CancelContext(reason)


def test_resume_ignores_attempts_not_running() -> None:
    """Starting and finishing attempts re-send their own request, and a cancelled handler is
    left alone: a resume only ends."""
    view = LeaseView(now=NOW, remaining=1.0, cancelled=False)
    m = _machine()
    _begin(m)
    m.reconnected()
    assert m.resume is not None
    refusal = WorkerError("LEASE_LOST", "gone")
    assert _kinds(m.failed(m.resume, refusal, gen=1, view=view)) == [ResumeEnded]
    m = _machine()
    _started(m)
    m.reconnected()
    assert m.resume is not None
    cancelled = LeaseView(now=NOW, remaining=1.0, cancelled=True)
    assert _kinds(m.failed(m.resume, refusal, gen=1, view=cancelled)) == [ResumeEnded]


def test_shutdown_cancel_reaches_starting_and_running_attempts_only() -> None:
    """Shutdown's cancel step cancels a starting or running handler, nothing else."""
    m = _machine()
    assert m.shutdown_cancel() == []
    _begin(m)
    assert m.shutdown_cancel() == [CancelContext("shutdown")]
    m = _machine()
    _started(m)
    # A running handler told to stop is no longer renewed.
    assert m.shutdown_cancel() == [UntrackLease(), CancelContext("shutdown")]
    m = _machine()
    _finishing(m)
    assert m.shutdown_cancel() == []
