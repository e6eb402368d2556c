"""A live reconnect's resumes as transitions of the attempt machine, and what the connection
thread drives them with (the link opened before it is published, the resumes' count): no
sockets, no threads."""

from __future__ import annotations

import datetime as dt
import math

import pytest
from test_worker_attempt import NOW, _begin, _finishing, _kinds, _lease, _machine, _result, _started

from orbit_sync.errors import OrbitError, WorkerBusy, WorkerDisconnected, WorkerError
from orbit_sync.models import AttemptState, Finish, Outcome
from orbit_sync.testing import ManualClock
from orbit_sync.worker.core._errors import NotConnected
from orbit_sync.worker.core._machine import (
    BUSY_DELAY,
    AttemptMachine,
    BreakConnection,
    CancelContext,
    Keep,
    LeaseLost,
    LeaseView,
    Phase,
    RecordFinish,
    RefreshLease,
    Release,
    Reported,
    Request,
    ResumeEnded,
    RunHandler,
    Send,
    TrackLease,
    UntrackLease,
)
from orbit_sync.worker.core._outcomes import outcome_of
from orbit_sync.worker.runtime._link import Link, Resumes

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def _view(*, remaining: float = 5.0, cancelled: bool = False) -> LeaseView:
    return LeaseView(now=NOW, remaining=remaining, cancelled=cancelled)


def _resume(m: AttemptMachine) -> Request:
    """Reconnect *m*; return the resume it sends."""
    actions = m.reconnected()
    assert m.resume is not None and actions == [Send(m.resume)]
    return m.resume


def test_every_held_phase_resumes_first_on_a_new_connection() -> None:
    """A starting, running or finishing attempt sends a resume of its own lease (a new
    message_id per connection) and keeps its start or finish as it is."""
    starting, running, finishing = _machine(), _machine(), _machine()
    _begin(starting)
    _started(running)
    _finishing(finishing)
    for m in (starting, running, finishing):
        kept = m.request
        first = _resume(m)
        assert first.request_type == "worker.resume" and first.body == m.ref and first.early
        assert m.request is kept, "the start or finish stays the machine's, kept"
        second = _resume(m)
        assert second.message_id != first.message_id
    assert not Request("task.start", starting.ref, "x" * 32).early


def test_settled_and_replayed_attempts_resume_nothing() -> None:
    """A settled attempt has no lease to resume; a replayed one is resumed by the replay."""
    m = _machine()
    _begin(m)
    assert m.request is not None
    m.failed(m.request, WorkerError("LEASE_LOST", "gone"), gen=1)
    assert m.phase is Phase.NOT_RUN and m.reconnected() == [] and m.resume is None
    replayed = _machine()
    replayed.replay(None, None)
    assert replayed.reconnected() == [] and replayed.resume is None


def test_a_running_lease_that_holds_is_refreshed() -> None:
    """The resume's active lease is watched from its new deadline; the resume is then over."""
    m = _machine()
    _started(m)
    resume = _resume(m)
    lease = _lease()
    actions = m.resume_answered(resume, lease, _view())
    assert lease.deadline is not None
    assert actions == [RefreshLease(lease.deadline), ResumeEnded(resume)]
    assert m.phase is Phase.RUNNING and m.resume is None


def test_a_cancel_requested_on_resume_cancels_the_handler() -> None:
    """A resumed lease carrying a cancel request stops renewals and cancels the handler."""
    m = _machine()
    _started(m)
    resume = _resume(m)
    actions = m.resume_answered(resume, _lease(cancel=True), _view())
    assert actions == [UntrackLease(), CancelContext("cancel_requested"), ResumeEnded(resume)]


def test_a_resume_sent_while_starting_never_judges_the_lease_its_start_got() -> None:
    """The start kept for the new connection goes out right behind the resume, and its answer
    may be stepped first (on the reader; the resume's on the connection thread): the resume's
    lease, a reservation from before the start was applied, then leaves the running handler
    alone."""
    m = _machine()
    _begin(m)
    start = m.request
    assert start is not None
    resume = _resume(m)
    ran = m.start_answered(start, _result(), now=NOW, cancel_reason=None, cancel_requested=False)
    assert _kinds(ran) == [TrackLease, RunHandler] and m.phase is Phase.RUNNING
    reserved = _lease(state=AttemptState.LEASED)
    assert m.resume_answered(resume, reserved, _view()) == [ResumeEnded(resume)]
    again = _resume(m)  # the next connection's resume, sent while RUNNING, does judge it
    assert _kinds(m.resume_answered(again, reserved, _view())) == [
        UntrackLease,
        CancelContext,
        LeaseLost,
        ResumeEnded,
    ]


@pytest.mark.parametrize(
    ("remaining", "reason"), [(5.0, "session_replaced"), (0.0, "lease_expired")]
)
def test_a_refused_resume_loses_a_running_lease(remaining: float, reason: str) -> None:
    """LEASE_LOST: the handler is cancelled and the loss reported, why per the local deadline;
    the refusal travels with the resume's end, to be logged."""
    m = _machine()
    _started(m)
    resume = _resume(m)
    refusal = WorkerError("LEASE_LOST", "gone")
    actions = m.failed(resume, refusal, gen=2, view=_view(remaining=remaining))
    assert actions == [
        UntrackLease(),
        CancelContext(reason),
        LeaseLost(reason),
        ResumeEnded(resume, refusal),
    ]
    assert m.phase is Phase.RUNNING, "the handler's return still finishes it"
    assert _kinds(m.handler_returned(outcome_of(value={"ok": 1}))) == [
        UntrackLease,
        RecordFinish,
        Send,
    ]


def test_an_inactive_lease_on_resume_is_lost_too() -> None:
    """An answered resume whose lease no longer lets the handler run loses it."""
    m = _machine()
    _started(m)
    resume = _resume(m)
    expired = _lease(active=False, state=AttemptState.EXPIRED)
    actions = m.resume_answered(resume, expired, _view(remaining=0.0))
    assert _kinds(actions) == [UntrackLease, CancelContext, LeaseLost, ResumeEnded]


def test_an_already_cancelled_handler_is_left_alone() -> None:
    """A context cancelled before the answer (e.g. by shutdown) gets no second cancel."""
    m = _machine()
    _started(m)
    resume = _resume(m)
    refusal = WorkerError("LEASE_LOST", "gone")
    actions = m.failed(resume, refusal, gen=1, view=_view(cancelled=True))
    assert actions == [ResumeEnded(resume, refusal)]


@pytest.mark.parametrize("refused", [False, True])
def test_a_kept_finish_goes_out_with_its_message_id_after_the_resume(refused: bool) -> None:
    """A finish kept across the cut is left as it is by its resume (answered or refused): the
    connection, once published, re-sends it with the same message_id, and its answer
    delivers it."""
    m = _machine()
    _finishing(m)
    finish = m.request
    assert finish is not None and isinstance(finish.body, Finish)
    m.failed(finish, WorkerDisconnected("cut"), gen=1)
    resume = _resume(m)
    if refused:
        refusal = WorkerError("LEASE_LOST", "gone")
        ended = m.failed(resume, refusal, gen=2, view=_view())
        assert ended == [ResumeEnded(resume, refusal)]
    else:
        assert m.resume_answered(resume, _lease(), _view()) == [ResumeEnded(resume)]
    assert m.phase is Phase.FINISHING and m.request is finish
    assert m.resend(finish) == [Send(finish)]
    actions = m.finish_answered(finish, _result())
    assert _kinds(actions) == [Reported, Release] and m.phase is Phase.DELIVERED
    assert finish.body.outcome is Outcome.SUCCEEDED


def test_a_kept_start_goes_out_after_the_resume_and_its_answer_decides() -> None:
    """A start kept across the cut is re-sent, same message_id, after the resume; the resume
    itself starts nothing."""
    m = _machine()
    _begin(m)
    start = m.request
    assert start is not None
    m.failed(start, NotConnected("none"), gen=0)
    resume = _resume(m)
    assert m.resume_answered(resume, _lease(), _view()) == [ResumeEnded(resume)]
    assert m.phase is Phase.STARTING and m.resend(start) == [Send(start)]


def test_a_resume_whose_connection_fails_ends_and_breaks_that_connection() -> None:
    """A link failure ends the resume unanswered (the next connection sends a new one) and
    breaks its connection; with no connection at all there is nothing to break; a late answer
    is ignored."""
    m = _machine()
    _started(m)
    resume = _resume(m)
    assert m.failed(resume, WorkerDisconnected("cut"), gen=3, view=_view()) == [
        BreakConnection(3),
        ResumeEnded(resume, cut=True),
    ]
    assert m.resume is None and m.phase is Phase.RUNNING
    assert m.resume_answered(resume, _lease(), _view()) == []
    again = _resume(m)
    assert m.failed(again, NotConnected("none"), gen=0, view=_view()) == [
        BreakConnection(0),  # connection 0: none to break
        ResumeEnded(again, cut=True),
    ]


@pytest.mark.parametrize(
    ("error", "delay"),
    [(WorkerError("RATE_LIMITED", "slow"), 1.0), (WorkerBusy("busy"), BUSY_DELAY)],
)
def test_a_transient_answer_re_sends_the_same_resume(error: OrbitError, delay: float) -> None:
    """RATE_LIMITED (or our own busy gate) keeps the resume for its delay; the re-send is the
    same request, and only its answer ends it."""
    m = _machine()
    _started(m)
    resume = _resume(m)
    assert m.failed(resume, error, gen=2, view=_view()) == [Keep(resume, delay=delay, error=error)]
    assert m.resume is resume and m.resend(resume) == [Send(resume)]
    assert _kinds(m.resume_answered(resume, _lease(), _view())) == [RefreshLease, ResumeEnded]


def test_a_resume_of_an_older_connection_is_stale() -> None:
    """Once a newer connection sent its own resume, the older one's answer, failure and
    re-send change nothing."""
    m = _machine()
    _started(m)
    old = _resume(m)
    new = _resume(m)
    assert m.resume_answered(old, _lease(cancel=True), _view()) == []
    assert m.failed(old, WorkerError("LEASE_LOST", "x"), gen=1, view=_view()) == []
    assert m.resend(old) == [] and m.gave_up(old) == []
    assert m.resume is new


def test_a_resume_given_up_or_outlived_ends_without_touching_the_attempt() -> None:
    """Shutdown giving up a resume ends it alone; a resume kept for a re-send whose attempt
    settled meanwhile ends instead of going out."""
    m = _machine()
    _started(m)
    resume = _resume(m)
    assert m.gave_up(resume) == [ResumeEnded(resume)] and m.phase is Phase.RUNNING
    m = _machine()
    _begin(m)
    resume = _resume(m)
    assert m.request is not None
    m.failed(m.request, WorkerError("LEASE_LOST", "x"), gen=1)  # the start refused: settled
    assert m.resend(resume) == [ResumeEnded(resume)] and m.resume is None


def test_a_worker_error_mid_resume_ends_the_resume_and_finishes_unknown() -> None:
    """A bug while a resume is on its way ends that resume (nobody waits for it any more) and
    finishes the running attempt UNKNOWN, as any worker error does."""
    m = _machine()
    _started(m)
    resume = _resume(m)
    actions = m.crashed()
    assert actions[0] == ResumeEnded(resume) and m.resume is None
    assert _kinds(actions[1:]) == [UntrackLease, RecordFinish, Send]
    assert m.phase is Phase.FINISHING


def test_a_resume_refusal_of_a_starting_attempt_only_ends_it() -> None:
    """A refused resume of an attempt still starting leaves the start's answer to decide."""
    m = _machine()
    _begin(m)
    resume = _resume(m)
    refusal = WorkerError("LEASE_LOST", "x")
    assert m.failed(resume, refusal, gen=1, view=_view()) == [ResumeEnded(resume, refusal)]
    assert m.phase is Phase.STARTING and m.request is not None


# ------------------------------------------------------------------ the link and the count


class _Conn:
    def close(self) -> None:
        pass


def test_an_opened_connection_carries_resumes_only_until_published() -> None:
    """Opened, a connection is current for early requests (resumes) and their kept re-sends
    only; published, for every request, with the generation it was opened with."""
    clock = ManualClock(0.0)
    link = Link(clock)
    conn = _Conn()
    gen = link.open(conn)  # type: ignore[arg-type]
    assert link.current() is None
    assert link.current(early=True) == (conn, gen)
    ran: list[str] = []
    link.keep(lambda: ran.append("finish"), newer_than=0)
    link.keep(lambda: ran.append("resume"), delay=1.0, early=True)
    assert link.take_due() == ([], clock.now() + 1.0)
    clock.advance(1.0)
    jobs, next_at = link.take_due()
    for job in jobs:
        job()
    assert ran == ["resume"] and next_at == math.inf, "the finish waits for the publishing"
    assert link.publish(conn) == gen  # type: ignore[arg-type]
    assert link.current() == (conn, gen)
    jobs, _ = link.take_due()
    for job in jobs:
        job()
    assert ran == ["resume", "finish"]
    link.retract(gen)
    assert link.current(early=True) is None


def test_resumes_count_what_went_out_and_what_is_over() -> None:
    """The publishing and the report wait for every resume to go out (the last one out wakes
    the connection thread), the session for every one to be over; an answer counts as gone out;
    a new connection forgets the older one's."""
    wakes: list[None] = []
    resumes: Resumes = Resumes(lambda: wakes.append(None))
    m, other = _machine(), _machine()
    _started(m)
    _started(other)
    a, b = _resume(m), _resume(other)
    resumes.begin()
    resumes.add(a)
    resumes.add(b)
    assert not resumes.all_sent() and not resumes.all_over()
    resumes.sent(a)
    assert not resumes.all_sent() and not wakes
    resumes.ended(b)  # answered before its sender said it went out
    assert resumes.all_sent() and not resumes.all_over()
    resumes.sent(b)
    resumes.ended(a)
    assert resumes.all_over()
    resumes.add(a)
    resumes.begin()
    assert resumes.all_sent() and resumes.all_over()
    assert wakes, "the last one out woke the connection thread"


def test_a_resume_cut_before_its_answer_marks_its_connection_until_the_next() -> None:
    """A resume ended by its connection's failure marks the connection cut (not established);
    an older connection's resume ending so does not, and a new connection starts unmarked."""
    resumes: Resumes = Resumes(lambda: None)
    machines = [_machine() for _ in range(3)]
    for m in machines:
        _started(m)  # held: a reconnect resumes it
    old, a, b = (_resume(m) for m in machines)
    resumes.begin()
    resumes.add(a)
    resumes.add(b)
    resumes.ended(a)
    resumes.ended(old, cut=True)  # not one of this connection's
    assert not resumes.cut()
    resumes.ended(b, cut=True)
    assert resumes.all_over() and resumes.cut()
    resumes.begin()
    assert not resumes.cut()
