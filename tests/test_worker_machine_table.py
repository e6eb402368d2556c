"""The attempt machine's transition table, walked completely: every (phase, trigger) pair is a
declared transition or a declared refusal, every transition is reached through the machine's
own methods and does what the table says; and its safety rules, over random event sequences:
a handler starts at most once per attempt, and a finish once decided is never dropped."""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orbit_sync.errors import CallTimeout, WorkerBusy, WorkerDisconnected, WorkerError
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
from orbit_sync.worker import Fail, Verdict
from orbit_sync.worker.core._machine import (
    ANY_PHASE,
    BUSY_DELAY,
    IMPOSSIBLE,
    REFUSED,
    SETTLED,
    TABLE,
    AttemptMachine,
    CancelContext,
    HandlerOutcome,
    LeaseLost,
    LeaseRenewed,
    LeaseView,
    MachineError,
    Phase,
    RecordFinish,
    RenewAfter,
    RenewAnswer,
    Reported,
    Request,
    RunHandler,
    Send,
    TimeLimit,
    TrackLease,
    Trigger,
    UntrackLease,
)

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
NOW = 100.0

Action = Any
Driver = Callable[[AttemptMachine], list[Action]]


def _lease(*, active: bool = True, state: AttemptState = AttemptState.RUNNING) -> Lease:
    return Lease(active, state, T0 + dt.timedelta(seconds=30), T0, None).with_deadline(NOW)


def _cancelled_lease() -> Lease:
    lease = Lease(True, AttemptState.RUNNING, T0 + dt.timedelta(seconds=30), T0, T0)
    return lease.with_deadline(NOW)


def _result(lease: Lease, *, started: bool = True) -> CommandResult:
    disposition = Disposition.APPLIED if started else Disposition.EVIDENCE_ONLY
    state = AttemptState.RUNNING if started else AttemptState.EXPIRED
    receipt = Receipt(Operation.START, TaskState.RUNNING, state, 1, lease.lease_until, disposition)
    return CommandResult(receipt, lease, False)


def _machine(limit: TimeLimit | None = None) -> AttemptMachine:
    ref = AttemptRef(new_id(), new_id(), 1, new_secret())
    ids = (f"{n:032x}" for n in itertools.count(1))
    return AttemptMachine(ref, new_id=lambda: next(ids), retry_delay=1.0, time_limit=limit)


def _foreign(m: AttemptMachine, kind: str) -> Request:
    """A request that is not the machine's (an answer that arrives for nothing it holds)."""
    return Request(kind, m.ref, "f" * 32)


def _req(m: AttemptMachine) -> Request:
    return m.request or _foreign(m, "task.start")


def _resume(m: AttemptMachine) -> Request:
    return m.resume or _foreign(m, "worker.resume")


VIEW = LeaseView(now=NOW, remaining=5.0, cancelled=False)
EXPIRED_VIEW = LeaseView(now=NOW, remaining=0.0, cancelled=False)
CANCELLED_VIEW = LeaseView(now=NOW, remaining=5.0, cancelled=True)
REFUSAL = WorkerError("LEASE_LOST", "gone")
STORED = Verdict(Outcome.SUCCEEDED, {"stored": True}).finish


def _start(lease: Lease, *, started: bool = True, reason: str | None = None) -> Driver:
    def drive(m: AttemptMachine) -> list[Action]:
        return m.start_answered(
            _req(m),
            _result(lease, started=started),
            now=NOW,
            cancel_reason=reason,
            cancel_requested=False,
        )

    return drive


#: Every kind of event the machine takes, with the data that makes each of its triggers.
DRIVERS: dict[str, Driver] = {
    "admitted": lambda m: m.assigned(again=False, runnable=True, stopping=False),
    "admitted stopping": lambda m: m.assigned(again=False, runnable=True, stopping=True),
    "assigned again": lambda m: m.assigned(again=True, runnable=True, stopping=False),
    "no handler": lambda m: m.assigned(again=False, runnable=False, stopping=False),
    "start runs": _start(_lease()),
    "start, context cancelled": _start(_lease(), reason="shutdown"),
    "start, cancel requested": _start(_cancelled_lease()),
    "start, not started": _start(_lease(active=False), started=False),
    "start, not started, cancel requested": _start(_cancelled_lease(), started=False),
    "finish answered": lambda m: m.finish_answered(_req(m), _result(_lease())),
    "request cut": lambda m: m.failed(_req(m), WorkerDisconnected("cut"), gen=2),
    "request busy": lambda m: m.failed(_req(m), WorkerBusy("busy"), gen=2),
    "request refused": lambda m: m.failed(_req(m), REFUSAL, gen=2),
    "request resent": lambda m: m.resend(_req(m)),
    "request given up": lambda m: m.gave_up(_req(m)),
    "replay, finish stored": lambda m: m.replay(STORED(m.ref), "e" * 32),
    "replay": lambda m: m.replay(None, None),
    "replay resume: active": lambda m: m.resume_answered(_req(m), _lease()),
    "replay resume: gone": lambda m: m.resume_answered(_req(m), _lease(active=False)),
    "handler returned": lambda m: m.handler_returned(Verdict(Outcome.SUCCEEDED, 1)),
    "handler ended": lambda m: m.handler_ended(value={"n": 1}, duration=0.1),
    "handler raised": lambda m: m.handler_ended(error=RuntimeError("boom"), duration=0.1),
    "launch refused": lambda m: m.launch_refused(),
    "crashed": lambda m: m.crashed(),
    "reconnected": lambda m: m.reconnected(),
    "resume: holds": lambda m: m.resume_answered(_resume(m), _lease(), VIEW),
    "resume: cancel requested": lambda m: m.resume_answered(_resume(m), _cancelled_lease(), VIEW),
    "resume: refused": lambda m: m.failed(_resume(m), REFUSAL, gen=2, view=VIEW),
    "resume: expired": lambda m: m.resume_answered(_resume(m), _lease(), EXPIRED_VIEW),
    "resume: context cancelled": lambda m: m.resume_answered(_resume(m), _lease(), CANCELLED_VIEW),
    "resume cut": lambda m: m.failed(_resume(m), WorkerDisconnected("cut"), gen=2, view=VIEW),
    "resume busy": lambda m: m.failed(_resume(m), WorkerBusy("busy"), gen=2, view=VIEW),
    "resume resent": lambda m: m.resend(_resume(m)),
    "resume given up": lambda m: m.gave_up(_resume(m)),
    "renewal granted": lambda m: m.renew_answered(RenewAnswer(_lease(), lag=0.1)),
    "renewal busy": lambda m: m.renew_answered(RenewAnswer(error=WorkerBusy("busy"))),
    "renewal cut": lambda m: m.renew_answered(RenewAnswer(error=WorkerDisconnected("cut"))),
    "renewal refused": lambda m: m.renew_answered(RenewAnswer(error=REFUSAL)),
    "renewal: lease inactive": lambda m: m.renew_answered(RenewAnswer(_lease(active=False))),
    "renewal: cancel requested": lambda m: m.renew_answered(RenewAnswer(_cancelled_lease())),
    "lease expired": lambda m: m.renew_answered(RenewAnswer()),
    "cancel pushed": lambda m: m.cancel_pushed(),
    "shutdown cancel": lambda m: m.shutdown_cancel(),
    "abandon": lambda m: m.abandon(),
    "time limit": lambda m: m.time_limit_passed(),
    "time limit grace": lambda m: m.time_limit_grace_passed(),
}


def _path(*steps: str) -> Callable[[AttemptMachine], None]:
    def build(m: AttemptMachine) -> None:
        for step in steps:
            DRIVERS[step](m)

    return build


_START = ("admitted", "start runs")
_FINISH = (*_START, "handler returned")
#: Ways to reach every phase, with or without a live resume on its way, an abandoned handler, a
#: time limit passed: the states the triggers need.
STATES: dict[str, tuple[TimeLimit | None, Callable[[AttemptMachine], None]]] = {
    "assigned": (None, _path()),
    "starting": (None, _path("admitted")),
    "starting, resumed": (None, _path("admitted", "reconnected")),
    "running": (None, _path(*_START)),
    "running, resumed": (None, _path(*_START, "reconnected")),
    "running, resumed while starting": (None, _path("admitted", "reconnected", "start runs")),
    "running, timed out": (TimeLimit(5.0, 2.0), _path(*_START, "time limit")),
    "running, timed out in a process": (
        TimeLimit(5.0, 2.0, in_process=True),
        _path(*_START, "time limit"),
    ),
    "running with a time limit": (TimeLimit(5.0, 2.0), _path(*_START)),
    "running with a time limit in a process": (
        TimeLimit(5.0, 2.0, in_process=True),
        _path(*_START),
    ),
    "finishing": (None, _path(*_FINISH)),
    "finishing, resumed": (None, _path(*_FINISH, "reconnected")),
    "finishing, abandoned": (None, _path(*_START, "abandon")),
    "delivered": (None, _path(*_FINISH, "finish answered")),
    "delivered, resumed": (None, _path(*_FINISH, "reconnected", "finish answered")),
    "delivered, abandoned": (None, _path(*_START, "abandon", "finish answered")),
    "refused": (None, _path(*_FINISH, "request refused")),
    "refused, resumed": (None, _path(*_FINISH, "reconnected", "request refused")),
    "refused, abandoned": (None, _path(*_START, "abandon", "request refused")),
    "unreported": (None, _path(*_FINISH, "request given up")),
    "unreported, resumed": (None, _path(*_FINISH, "reconnected", "request given up")),
    "unreported, abandoned": (None, _path(*_START, "abandon", "request given up")),
    "not run": (None, _path("no handler")),
    "not run, resumed": (None, _path("admitted", "reconnected", "start, not started")),
    "not run, abandoned": (None, _path(*_START, "abandon", "crashed")),
    "resuming": (None, _path("replay")),
    "resuming, finish stored": (None, _path("replay, finish stored")),
    "ended": (None, _path("replay", "replay resume: gone")),
}


def _build(state: str) -> AttemptMachine:
    limit, build = STATES[state]
    m = _machine(limit)
    build(m)
    return m


#: (phase before, trigger, taken: True, refused: False, impossible: None, phase after)
Fired = tuple[Phase, Trigger, bool | None, Phase]


@pytest.fixture
def fired(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Fired]]:
    """Every trigger the machine fires: (phase before, trigger, taken, phase after)."""
    log: list[Fired] = []
    real = AttemptMachine.fire

    def spy(m: AttemptMachine, trigger: Trigger) -> bool:
        before = m.phase
        try:
            taken = real(m, trigger)
        except MachineError:
            log.append((before, trigger, None, m.phase))
            raise
        log.append((before, trigger, taken, m.phase))
        return taken

    monkeypatch.setattr(AttemptMachine, "fire", spy)
    yield log


def test_every_pair_is_declared_once() -> None:
    """For every trigger, each phase takes it (a transition), refuses it (a trigger that may
    race into any phase), or can never see it (a bug, raised): exactly one of the three."""
    assert set(TABLE) == set(Trigger) == set(REFUSED) == set(IMPOSSIBLE)
    for trigger, moves in TABLE.items():
        assert moves.keys() | REFUSED[trigger] | IMPOSSIBLE[trigger] == set(Phase)
        assert not moves.keys() & REFUSED[trigger]
        assert not (moves.keys() | REFUSED[trigger]) & IMPOSSIBLE[trigger]
        assert bool(REFUSED[trigger]) <= (trigger in ANY_PHASE)
    for trigger in Trigger:
        for phase in SETTLED:
            move = TABLE[trigger].get(phase)
            assert move is None or move.to is phase, "a settled phase is never left"


def test_the_walk_reaches_every_transition_and_each_does_what_the_table_says(
    fired: list[Fired],
) -> None:
    """Every event in every state: each trigger fired moves as the table says (to its phase,
    with its actions in order), is refused as declared, leaving the phase and returning
    nothing, or, where the table says it can never arrive, raises MachineError leaving the
    phase; and every transition of the table is reached through the machine's methods."""
    reached: set[tuple[Phase, Trigger]] = set()
    for state in STATES:
        for name, drive in DRIVERS.items():
            m = _build(state)
            phase = m.phase
            fired.clear()
            try:
                actions = drive(m)
            except MachineError:
                before, trigger, taken, after = fired[-1]
                assert taken is None and before in IMPOSSIBLE[trigger] and after is before
                continue
            expected: list[type] = []
            for before, trigger, taken, after in fired:
                where = f"{name!r} in {state!r}: {trigger} in {before}"
                assert taken is not None
                if taken:
                    move = TABLE[trigger][before]
                    assert after is move.to, where
                    expected.extend(move.actions)
                    reached.add((before, trigger))
                else:
                    assert before in REFUSED[trigger] and after is before, where
            assert [type(a) for a in actions] == expected, f"{name!r} in {state!r}"
            if not any(taken for _, _, taken, _ in fired):
                assert actions == [] and m.phase is phase, f"{name!r} in {state!r}"
    declared = {(phase, trigger) for trigger, moves in TABLE.items() for phase in moves}
    assert declared - reached == set(), "transitions no event reaches"


BUG = RuntimeError("a send bug")
SLOW = CallTimeout("slow", message_id="e" * 32)
BUSY = WorkerBusy("busy")
LIMITED = WorkerError("RATE_LIMITED", "slow down")


def _lost(reason: str, detail: str = "") -> list[Action]:
    lost = LeaseLost(reason, resume=False, detail=detail)
    return [UntrackLease(), CancelContext(reason), lost]


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (RenewAnswer(_lease(), lag=0.5), [TrackLease(_lease().deadline), LeaseRenewed(0.5)]),
        (RenewAnswer(error=BUSY), [RenewAfter(BUSY_DELAY, BUSY)]),
        (RenewAnswer(error=SLOW), [RenewAfter(1.0, SLOW)]),
        (RenewAnswer(error=LIMITED), [RenewAfter(1.0, LIMITED)]),
        (RenewAnswer(error=BUG), [RenewAfter(1.0, BUG)]),
        (RenewAnswer(error=REFUSAL), _lost("lease_lost", "LEASE_LOST")),
        (RenewAnswer(error=REFUSAL, behind_resume=True), _lost("session_replaced", "LEASE_LOST")),
        (RenewAnswer(_lease(active=False)), _lost("lease_lost")),
        (RenewAnswer(_lease(state=AttemptState.LEASED)), _lost("lease_lost")),
        (RenewAnswer(_lease(active=False), behind_resume=True), _lost("session_replaced")),
        (RenewAnswer(_cancelled_lease()), [UntrackLease(), CancelContext("cancel_requested")]),
        (RenewAnswer(), _lost("lease_expired")),
    ],
    ids=[
        "granted",
        "busy",
        "timeout",
        "rate limited",
        "send bug",
        "LEASE_LOST",
        "LEASE_LOST behind a resume",
        "inactive",
        "not running",
        "inactive behind a resume",
        "cancel requested",
        "deadline passed",
    ],
)
def test_what_a_renewal_means_is_the_machines(answer: RenewAnswer, expected: list[Action]) -> None:
    """A renewal's answer, as the watchdog reports it, means what the machine says: tracked to
    its new deadline; retried after the one retry delay (busy: the short one) when transient
    or when nothing was sent; the handler told to stop on a cancel request; the lease lost
    (``session_replaced`` behind a reconnect's resumes, as the resume says) or expired."""
    m = _build("running")
    assert m.renew_answered(answer) == expected
    assert m.phase is Phase.RUNNING


def test_a_handler_told_to_stop_is_renewed_no_more() -> None:
    """Once its handler is told to stop (here a cancel push), a renewal answered late changes
    nothing: the lease is not tracked again, nor reported lost."""
    m = _build("running")
    DRIVERS["cancel pushed"](m)
    assert m.renew_answered(RenewAnswer(_lease())) == []
    assert m.renew_answered(RenewAnswer(error=REFUSAL)) == []


# ---------------------------------------------------------------------- the safety rules

#: Events as they may come in any order (answers late, repeated, for requests given up).
EVENTS = sorted(DRIVERS)


def _run(m: AttemptMachine, names: list[str]) -> list[tuple[Phase, list[Action]]]:
    """Drive *m* as the shell does: an event its phase can never take (a bug: MachineError)
    makes the shell step the machine's crash instead."""
    steps: list[tuple[Phase, list[Action]]] = []
    for name in names:
        before = m.phase
        try:
            actions = DRIVERS[name](m)
        except MachineError:
            actions = m.crashed()
        steps.append((before, actions))
    return steps


@settings(max_examples=400, deadline=None)
@given(
    names=st.lists(st.sampled_from(EVENTS), max_size=25),
    limit=st.sampled_from([None, TimeLimit(5.0, 2.0), TimeLimit(5.0, 2.0, in_process=True)]),
)
def test_a_handler_starts_at_most_once_and_a_finish_is_never_dropped(
    names: list[str], limit: TimeLimit | None
) -> None:
    """Whatever events arrive, in whatever order: one start operation (one message_id) and at
    most one handler run per attempt; at most one finish decided, and once decided it is held
    (kept or on its way) until its fate is reported, exactly once; a settled phase is final."""
    m = _machine(limit)
    steps = _run(m, names)
    actions = [a for _, step in steps for a in step]
    starts = {
        a.request.message_id
        for a in actions
        if isinstance(a, Send) and a.request.request_type == "task.start"
    }
    assert len(starts) <= 1
    assert sum(isinstance(a, RunHandler) for a in actions) <= 1
    finishes = {a.request.message_id for a in actions if isinstance(a, RecordFinish)}
    assert len(finishes) <= 1
    reported = [a for a in actions if isinstance(a, Reported)]
    assert len(reported) <= 1
    if finishes:
        # Decided: still finishing with the finish held, or its fate reported.
        held = m.phase is Phase.FINISHING and m.request is not None
        assert held or reported, names
        assert m.phase in (Phase.FINISHING, Phase.DELIVERED, Phase.REFUSED, Phase.UNREPORTED)
    phases = [before for before, _ in steps] + [m.phase]
    for earlier, later in itertools.pairwise(phases):
        assert earlier not in SETTLED or later is earlier, names
    if m.phase is Phase.DELIVERED:
        assert reported and reported[0].delivered and reported[0].verdict.outcome in Outcome


@settings(max_examples=200, deadline=None)
@given(names=st.lists(st.sampled_from(EVENTS), max_size=25))
def test_a_replayed_finish_is_never_dropped(names: list[str]) -> None:
    """A dead process's stored finish, replayed: whatever follows, it is sent with its original
    message_id and never replaced, until its fate is reported or the replay stops."""
    m = _machine()
    steps = _run(m, ["replay, finish stored", *names])
    actions = [a for _, step in steps for a in step]
    finishes = {
        a.request.message_id
        for a in actions
        if isinstance(a, Send) and a.request.request_type == "task.finish"
    }
    assert finishes <= {"e" * 32}
    assert not any(isinstance(a, RecordFinish) for a in actions), "never a new finish"
    assert m.phase in (
        Phase.RESUMING,
        Phase.FINISHING,
        Phase.DELIVERED,
        Phase.REFUSED,
        Phase.UNREPORTED,
    )


def test_the_outcome_rules_are_the_machines_how_a_handler_ended_decides_its_finish() -> None:
    """The handler's ending is an event: the machine applies the outcome rules (a return is
    SUCCEEDED with the encoded result, a raise FAILED HANDLER_ERROR with the exception kept for
    the log, a Fail its own code) and finishes with that verdict."""
    cases = [
        ({"value": {"n": 1}}, Outcome.SUCCEEDED, None),
        ({"error": RuntimeError("boom")}, Outcome.FAILED, "HANDLER_ERROR"),
        ({"error": Fail("QUOTA", "later", retryable=True)}, Outcome.FAILED, "QUOTA"),
    ]
    for ending, outcome, code in cases:
        m = _build("running")
        actions = m.handler_ended(duration=0.5, **ending)
        told = actions[0]
        assert isinstance(told, HandlerOutcome) and told.error is ending.get("error")
        assert (told.verdict.outcome, told.verdict.error_code) == (outcome, code)
        assert m.verdict is told.verdict and m.phase is Phase.FINISHING
        assert [type(a) for a in actions] == list(
            TABLE[Trigger.HANDLER_ENDED][Phase.RUNNING].actions
        )
    m = _build("running")
    m.handler_ended(value=1)
    assert m.handler_ended(value=2) == [], "a handler ends once"
