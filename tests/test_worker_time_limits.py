"""Handler time limits: the attempt machine's transitions, the outcome rules, and a Worker
against the mock server on a hand-moved clock (threads) or in real time (child processes)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
from _worker_helpers import Probe, make_worker

from orbit_sync.contrib.health import HealthProbe
from orbit_sync.models import AttemptRef, Outcome, TaskState, new_id, new_secret
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import (
    StuckEvent,
    TaskCancelled,
    TaskContext,
    TimeLimitExceeded,
    Worker,
    WorkerListener,
)
from orbit_sync.worker.core._machine import (
    AttemptMachine,
    CancelContext,
    InterruptHandler,
    Phase,
    RecordFinish,
    Send,
    SlotFreed,
    SlotStuck,
    UntrackLease,
)
from orbit_sync.worker.core._outcomes import outcome_of
from orbit_sync.worker.core._time_limits import Interruptible, TimeLimit

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
LIMIT = 5.0
GRACE = 2.0

# ------------------------------------------------------------------------------ the machine


def _running(limit: TimeLimit | None) -> AttemptMachine:
    ref = AttemptRef(new_id(), new_id(), 1, new_secret())
    ids = (f"{n:032x}" for n in itertools.count(1))
    machine = AttemptMachine(ref, new_id=lambda: next(ids), retry_delay=1.0, time_limit=limit)
    machine.phase = Phase.RUNNING  # the start's transitions are test_worker_attempt.py's
    return machine


def test_time_limit_cancels_and_interrupts_a_thread_once() -> None:
    """At the limit a thread handler's context is cancelled and the handler interrupted, with
    the grace to stop; a second timer firing changes nothing."""
    m = _running(TimeLimit(LIMIT, GRACE))
    assert m.time_limit_passed() == [
        UntrackLease(),  # a handler told to stop is no longer renewed
        CancelContext("time_limit"),
        InterruptHandler(GRACE),
    ]
    assert m.time_limit_passed() == []
    assert m.phase is Phase.RUNNING


def test_time_limit_in_a_process_leaves_the_kill_to_the_executor() -> None:
    """A handler in a child process is only cancelled here (the executor interrupts it in the
    child and kills the child past the grace); its grace never abandons it."""
    m = _running(TimeLimit(LIMIT, GRACE, in_process=True))
    assert m.time_limit_passed() == [UntrackLease(), CancelContext("time_limit")]
    stopped = outcome_of(error=TimeLimitExceeded(), cancel_reason="time_limit")
    assert [type(a) for a in m.handler_returned(stopped)] == [UntrackLease, RecordFinish, Send]
    assert m.verdict is not None and m.verdict.error_code == "HANDLER_TIMEOUT"


def test_grace_passed_with_the_thread_still_running_finishes_unknown_and_sticks() -> None:
    """Past the grace a thread still running is finished UNKNOWN HANDLER_TIMEOUT, its slot
    stuck; when it returns at last its result is dropped and the slot freed."""
    m = _running(TimeLimit(LIMIT, GRACE))
    assert m.time_limit_grace_passed() == [], "no grace runs before the limit"
    m.time_limit_passed()
    actions = m.time_limit_grace_passed()
    assert [type(a) for a in actions] == [UntrackLease, SlotStuck, RecordFinish, Send]
    assert actions[1] == SlotStuck("time_limit")
    assert m.verdict is not None
    assert (m.verdict.outcome, m.verdict.error_code) == (Outcome.UNKNOWN, "HANDLER_TIMEOUT")
    assert m.handler_returned(outcome_of(value=1)) == [SlotFreed()]
    assert m.verdict.outcome is Outcome.UNKNOWN


def test_a_second_abandon_keeps_the_stuck_slot_freed_by_the_late_return() -> None:
    """A handler abandoned past its grace and then again by shutdown is finished once; when it
    returns at last its result is still dropped and its stuck slot freed (the second abandon,
    which changes nothing, must not forget the first)."""
    m = _running(TimeLimit(LIMIT, GRACE))
    m.time_limit_passed()
    assert SlotStuck("time_limit") in m.time_limit_grace_passed()
    assert m.abandon() == [] and m.time_limit_grace_passed() == []
    assert m.abandoned
    assert m.handler_returned(outcome_of(value=1)) == [SlotFreed()]
    assert m.verdict is not None and m.verdict.error_code == "HANDLER_TIMEOUT"


def test_grace_passed_after_the_handler_stopped_changes_nothing() -> None:
    """A handler that stopped within the grace keeps its own finish (FAILED HANDLER_TIMEOUT)."""
    m = _running(TimeLimit(LIMIT, GRACE))
    m.time_limit_passed()
    m.handler_returned(outcome_of(error=TimeLimitExceeded(), cancel_reason="time_limit"))
    assert m.time_limit_grace_passed() == [] and not m.abandoned
    assert m.verdict is not None
    assert (m.verdict.outcome, m.verdict.error_code) == (Outcome.FAILED, "HANDLER_TIMEOUT")


def test_no_time_limit_no_transition() -> None:
    """Without a limit, or once the handler returned, the limit's timer does nothing."""
    assert _running(None).time_limit_passed() == []
    m = _running(TimeLimit(LIMIT, GRACE))
    m.handler_returned(outcome_of(value=1))
    assert m.time_limit_passed() == []


@pytest.mark.parametrize("retryable", [False, True])
def test_a_handler_stopped_at_its_limit_fails_handler_timeout(retryable: bool) -> None:
    """Interrupted, or stopping at raise_if_cancelled() after the limit: FAILED HANDLER_TIMEOUT,
    retryable as the handler was registered; a cancel request still wins (CANCELLED)."""
    for error in (TimeLimitExceeded(), TaskCancelled("time_limit")):
        verdict = outcome_of(error=error, cancel_reason="time_limit", timeout_retryable=retryable)
        assert (verdict.outcome, verdict.error_code) == (Outcome.FAILED, "HANDLER_TIMEOUT")
        assert verdict.retryable is retryable
    # Interrupted after another reason cancelled the context first: still the time limit.
    verdict = outcome_of(error=TimeLimitExceeded(), cancel_reason="lease_lost")
    assert verdict.error_code == "HANDLER_TIMEOUT"
    verdict = outcome_of(
        error=TimeLimitExceeded(), cancel_reason="cancel_requested", cancel_requested=True
    )
    assert verdict.outcome is Outcome.CANCELLED


def test_an_interrupt_before_the_call_raises_as_it_starts_and_after_it_does_nothing() -> None:
    """The limit may pass before the handler's call starts (a slow start): the call is then
    not made; once the call is over, a late interrupt marks nothing."""
    early = Interruptible(threading.Lock())
    assert early.interrupt(TimeLimitExceeded)
    calls: list[int] = []
    with pytest.raises(TimeLimitExceeded):
        early.run(lambda: calls.append(1))
    assert calls == []
    late = Interruptible(threading.Lock())
    assert late.run(lambda: 7) == 7
    assert not late.interrupt(TimeLimitExceeded)


# ------------------------------------------------------------------------------ a worker


class _Stuck(WorkerListener):
    """Records the stuck-slot events."""

    def __init__(self) -> None:
        self.events: list[tuple[str, StuckEvent]] = []
        self.cond = threading.Condition()

    def handler_stuck(self, event: StuckEvent) -> None:
        with self.cond:
            self.events.append(("stuck", event))
            self.cond.notify_all()

    def handler_unstuck(self, event: StuckEvent) -> None:
        with self.cond:
            self.events.append(("unstuck", event))
            self.cond.notify_all()

    def wait(self, count: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.events) >= count, 10)


@pytest.fixture
def manual() -> ManualClock:
    """The mock server's hand-moved clock (the worker's ManualClock follows it)."""
    return ManualClock()


@pytest.fixture
def server(manual: ManualClock) -> Any:
    """A mock server on *manual* time, 30 s leases, no assignment rate limit."""
    with MockOrbitServer(clock=manual, assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


def _worker(server: MockOrbitServer, manual: ManualClock, **kwargs: Any) -> Worker:
    kwargs.setdefault("cancel_grace", GRACE)
    return make_worker(server, clock=manual, **kwargs)


def _attempt(server: MockOrbitServer, task_id: str) -> tuple[Any, ...]:
    snap = server.wait_for(task_id, DONE, timeout=10)
    att = snap.attempts[-1]
    return snap.state, att.outcome, att.error_code, att.retryable


def _spin(probe: Probe, ctx: TaskContext) -> None:
    """Loop in Python, ignoring the context, until the test releases it."""
    probe.enter(ctx)
    while not probe.release.is_set():
        pass


@pytest.mark.parametrize("retryable", [False, True])
def test_a_thread_looping_in_python_is_interrupted_at_its_limit(
    server: MockOrbitServer, manual: ManualClock, retryable: bool
) -> None:
    """A handler spinning in Python is interrupted once its limit passes on the worker's clock,
    and ends within the grace (never moved): FAILED HANDLER_TIMEOUT, retryable as asked."""
    probe = Probe()
    worker = _worker(server, manual)

    @worker.handler("spin", time_limit=LIMIT, time_limit_retryable=retryable)
    def spin(ctx: TaskContext, payload: Any) -> Any:
        _spin(probe, ctx)
        return {"late": True}

    task_id = server.enqueue("spin", {}, max_attempts=1)
    worker.start()
    try:
        probe.wait_started()
        server.advance(LIMIT - 0.5)
        assert server.task(task_id).state is TaskState.RUNNING
        server.advance(0.5)
        state, outcome, code, retried = _attempt(server, task_id)
        assert (state, outcome, code) == (TaskState.FAILED, Outcome.FAILED, "HANDLER_TIMEOUT")
        assert retried is retryable
        assert worker.stats().stuck == 0
    finally:
        probe.release.set()
        worker.stop(drain=False)


def test_the_worker_default_applies_and_a_handler_may_opt_out(
    server: MockOrbitServer, manual: ManualClock
) -> None:
    """Worker(time_limit=...) bounds handlers registered without one; time_limit=None on a
    handler means no limit; with_options carries both."""
    probe = Probe()
    worker = _worker(server, manual, time_limit=LIMIT).with_options()

    @worker.handler("bounded")
    def bounded(ctx: TaskContext, payload: Any) -> Any:
        _spin(probe, ctx)
        return {}

    @worker.handler("free", time_limit=None)
    def free(ctx: TaskContext, payload: Any) -> Any:
        _spin(probe, ctx)
        return {"finished": True}

    worker = worker.with_options()
    bounded_id = server.enqueue("bounded", {}, max_attempts=1)
    free_id = server.enqueue("free", {}, max_attempts=1)
    worker.start()
    try:
        probe.wait_started(2)
        server.advance(LIMIT)
        assert _attempt(server, bounded_id)[2] == "HANDLER_TIMEOUT"
        assert server.task(free_id).state is TaskState.RUNNING
        probe.release.set()
        assert server.wait_for(free_id, DONE, timeout=10).result == {"finished": True}
    finally:
        probe.release.set()
        worker.stop(drain=False)


def _stick(server: MockOrbitServer, worker: Worker, probe: Probe) -> str:
    """Start *worker* with a handler blocked in C (until *probe* is released) and time limit
    LIMIT, run one task of it past LIMIT + GRACE: finished UNKNOWN HANDLER_TIMEOUT, its slot
    stuck. Its task id."""

    @worker.handler("blocked", time_limit=LIMIT)
    def blocked(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        probe.release.wait()  # a lock acquire in C: the interrupt waits for it to return
        return {"late": True}

    task_id = server.enqueue("blocked", {}, max_attempts=1)
    worker.start()
    probe.wait_started()
    server.advance(LIMIT)
    server.advance(GRACE)
    assert _attempt(server, task_id)[1:3] == (Outcome.UNKNOWN, "HANDLER_TIMEOUT")
    return task_id


def test_a_thread_that_cannot_be_interrupted_finishes_unknown_and_its_slot_sticks(
    server: MockOrbitServer, manual: ManualClock
) -> None:
    """A handler blocked in C ignores the interrupt: past the grace it is finished UNKNOWN
    HANDLER_TIMEOUT and its slot counts stuck until it returns; its late result is dropped."""
    probe = Probe()
    stuck = _Stuck()
    worker = _worker(server, manual, listeners=[stuck])

    try:
        task_id = _stick(server, worker, probe)
        assert server.task(task_id).state is TaskState.NEEDS_REVIEW
        assert stuck.wait(1) and worker.stats().stuck == 1
        kind, event = stuck.events[0]
        assert (kind, event.task_id, event.reason, event.stuck) == (
            "stuck",
            task_id,
            "time_limit",
            1,
        )
        probe.release.set()
        assert stuck.wait(2), "the slot was never freed"
        assert stuck.events[1][0] == "unstuck" and stuck.events[1][1].stuck == 0
        assert worker.stats().stuck == 0
        assert server.task(task_id).evidence == (), "the late result is never sent"
    finally:
        probe.release.set()
        worker.stop(drain=False)


def test_bad_time_limits_raise_at_registration(
    server: MockOrbitServer, manual: ManualClock
) -> None:
    """A time limit that is not a positive number of seconds, or a retryable flag that is not
    a bool, raises before anything runs."""
    with pytest.raises(ValueError, match="time_limit"):
        _worker(server, manual, time_limit=0)
    worker = _worker(server, manual)
    with pytest.raises(ValueError, match="time_limit"):
        worker.register("a", lambda ctx, p: None, time_limit=-1)
    with pytest.raises(TypeError, match="time_limit"):
        worker.register("b", lambda ctx, p: None, time_limit="5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="time_limit_retryable"):
        worker.register("c", lambda ctx, p: None, time_limit=1, time_limit_retryable=1)  # type: ignore[arg-type]


def test_a_stuck_slot_is_not_offered_to_the_server(
    server: MockOrbitServer, manual: ManualClock
) -> None:
    """While a handler that cannot be stopped holds the only slot, the worker reports capacity
    0 (the next task waits on the server, not behind the stuck thread), /healthz says not live;
    once it returns, the slot is offered again and the next task runs."""
    probe = Probe()
    health = HealthProbe()
    worker = _worker(server, manual, capacity=1, listeners=[health])

    @worker.handler("quick")
    def quick(ctx: TaskContext, payload: Any) -> Any:
        return {"ran": True}

    def offered(capacity: int) -> Callable[[MockOrbitServer], bool]:
        return lambda s: [x.capacity for x in s.sessions() if x.connected] == [capacity]

    try:
        _stick(server, worker, probe)
        server.wait_until(offered(0), timeout=10)
        later = server.enqueue("quick", {})
        assert server.task(later).state is TaskState.WAITING
        state = health.state()
        assert state["stuck_slots"] == 1 and not state["live"]
        probe.release.set()
        assert server.wait_for(later, DONE, timeout=10).result == {"ran": True}
        assert offered(1)(server)
        assert health.state()["live"] and health.state()["stuck_slots"] == 0
    finally:
        probe.release.set()
        worker.stop(drain=False)
