"""The lease watchdog's core, driven by a fake clock and a scripted renew function (no sockets)."""

from __future__ import annotations

import datetime as _dt
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from _worker_helpers import Probe, leased_task, make_worker, running

from orbit_sync._transport import Transport
from orbit_sync.errors import CallTimeout, WorkerBusy, WorkerDisconnected, WorkerError
from orbit_sync.models import (
    AttemptRef,
    AttemptState,
    CommandResult,
    Disposition,
    Lease,
    Operation,
    Receipt,
    Task,
    TaskState,
    new_id,
    new_secret,
)
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import LeaseEvent, TaskContext, WorkerListener, WorkerOptions
from orbit_sync.worker.core._machine import (
    AttemptMachine,
    CancelContext,
    LeaseLost,
    LeaseRenewed,
    RenewAfter,
    RenewAnswer,
    TrackLease,
    UntrackLease,
    retry_delay,
)
from orbit_sync.worker.runtime._watchdog import (
    BUSY_LINGER,
    GROUP_FRACTION,
    LEAD_FACTOR,
    LEAD_WAKES,
    MAX_EARLY_BATCH,
    LeaseWatchdog,
    RenewDone,
    SendRenews,
    Timers,
    WatchdogThread,
)

T0 = _dt.datetime(2026, 9, 17, 8, 0, 0, tzinfo=_dt.timezone.utc)


class CallClock(ManualClock):
    """A hand-moved clock from 1000 s, also callable: the watchdog core reads time through a
    function."""

    def __init__(self) -> None:
        super().__init__(1000.0)

    def __call__(self) -> float:
        return self.now()

    def set(self, now: float) -> None:
        """Move forward to *now*."""
        self.advance(now - self.now())


def _task() -> Task:
    return leased_task()


def lease(
    clock: Callable[[], float],
    window: float = 30.0,
    *,
    active: bool = True,
    state: AttemptState = AttemptState.RUNNING,
    cancel: bool = False,
) -> Lease:
    """A lease as the connection returns it: deadline anchored at the fake clock's now."""
    base = Lease(
        active=active,
        state=state,
        lease_until=T0 + _dt.timedelta(seconds=window),
        server_time=T0,
        cancel_requested_at=T0 if cancel else None,
    )
    return base.with_deadline(clock())


class Renewer:
    """A scripted send function that records each batch (attempt ids) and every renewal
    (attempt_id, message_id, time), and answers each at once, or holds it when ``hold`` is set
    (answer later with ``release``); raises ``fail_with`` when set."""

    def __init__(self, clock: CallClock) -> None:
        self.clock = clock
        self.batches: list[list[str]] = []
        self.calls: list[tuple[str, str, float]] = []
        self.script: list[Callable[[], Lease]] = []
        self.hold = False
        self.held: dict[str, RenewDone] = {}
        self.fail_with: Exception | None = None

    def __call__(self, renewals: Sequence[tuple[str, str, RenewDone]]) -> None:
        self.batches.append([attempt_id for attempt_id, _, _ in renewals])
        if self.fail_with is not None:
            raise self.fail_with
        for attempt_id, message_id, on_done in renewals:
            self.calls.append((attempt_id, message_id, self.clock()))
            if self.hold:
                self.held[attempt_id] = on_done
            else:
                answer(on_done, self.script.pop(0) if self.script else lambda: lease(self.clock))

    def release(self, attempt_id: str, reply: Callable[[], Lease]) -> None:
        """Answer the held renewal of *attempt_id*."""
        answer(self.held.pop(attempt_id), reply)


def answer(on_done: RenewDone, reply: Callable[[], Lease]) -> None:
    """Complete a renewal with what *reply* returns or raises."""
    try:
        value = reply()
    except Exception as exc:
        on_done(None, exc)
    else:
        on_done(value, None)


def sync(fn: Callable[[str, str], Lease]) -> SendRenews:
    """A send function answering each renewal at once with what *fn* returns or raises."""

    def send(renewals: Sequence[tuple[str, str, RenewDone]]) -> None:
        for attempt_id, message_id, on_done in renewals:
            answer(on_done, functools.partial(fn, attempt_id, message_id))

    return send


def _raise(exc: Exception) -> Callable[[], Lease]:
    def fn() -> Lease:
        raise exc

    return fn


@pytest.fixture
def clock() -> CallClock:
    """A fresh fake clock."""
    return CallClock()


@pytest.fixture
def renewer(clock: CallClock) -> Renewer:
    """A renew function over the fake clock."""
    return Renewer(clock)


def _running(clock: CallClock, retry: float) -> AttemptMachine:
    """An attempt's machine whose start was answered: its handler runs, its lease is renewed."""
    ref = AttemptRef(new_id(), new_id(), 1, new_secret())
    machine = AttemptMachine(ref, new_id=new_id, retry_delay=retry)
    [start] = machine.assigned(again=False, runnable=True, stopping=False)
    granted = lease(clock)
    receipt = Receipt(
        Operation.START,
        TaskState.RUNNING,
        AttemptState.RUNNING,
        1,
        granted.lease_until,
        Disposition.APPLIED,
    )
    result = CommandResult(receipt, granted, False)
    machine.start_answered(
        start.request, result, now=clock(), cancel_reason=None, cancel_requested=False
    )
    assert machine.renewing
    return machine


class Leases:
    """The watchdog's reports as the worker's shell takes them: each goes to the attempt's
    machine (its handler running), whose lease actions are performed on the watchdog. Records
    the deadline each renewal granted (and how late it went out), why each handler was told to
    stop, and the leases reported lost."""

    def __init__(self, clock: CallClock) -> None:
        self.clock = clock
        self.deadlines: dict[str, float] = {}
        self.lags: dict[str, float] = {}
        self.ended: dict[str, str] = {}
        self.losses: list[tuple[str, str]] = []
        self.machines: dict[str, AttemptMachine] = {}
        self.retry = 1.0
        self.wd: LeaseWatchdog | None = None

    def answered(self, attempt_id: str, answer: RenewAnswer) -> None:
        assert self.wd is not None
        machine = self.machines.get(attempt_id) or _running(self.clock, self.retry)
        self.machines[attempt_id] = machine
        for action in machine.renew_answered(answer):
            if isinstance(action, TrackLease):
                self.wd.track(attempt_id, action.deadline)
                self.deadlines[attempt_id] = action.deadline
            elif isinstance(action, LeaseRenewed):
                self.lags[attempt_id] = action.lag
            elif isinstance(action, RenewAfter):
                self.wd.retry(attempt_id, action.delay, action.error)
            elif isinstance(action, UntrackLease):
                self.wd.untrack(attempt_id)
            elif isinstance(action, CancelContext):
                assert attempt_id not in self.ended, "a lease ends once"
                self.ended[attempt_id] = action.reason
            else:
                assert isinstance(action, LeaseLost)
                self.losses.append((attempt_id, action.reason))

    def remaining(self, attempt_id: str) -> float:
        return self.deadlines[attempt_id] - self.clock()

    def watchdog(self, send: SendRenews, *, retry: float = 1.0, **kwargs: Any) -> LeaseWatchdog:
        """A watchdog on the fake clock reporting here (*retry*: the machines' retry delay)."""
        self.retry = retry
        self.wd = LeaseWatchdog(send, clock=self.clock, **kwargs)
        self.wd.report_to(self.answered)
        return self.wd


@pytest.fixture
def leases(clock: CallClock) -> Leases:
    """The watchdog's reports, on the fake clock."""
    return Leases(clock)


def test_renews_at_half_the_remaining_window(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """A 30 s lease is renewed after 15 s, then every 15 s, never earlier."""
    wd = leases.watchdog(renewer)
    wd.track("a" * 32, clock() + 30.0)
    assert wd.run_due() == pytest.approx(clock() + 15.0)
    assert renewer.calls == []
    clock.advance(14.9)
    wd.run_due()
    assert renewer.calls == []
    clock.advance(0.1)
    nxt = wd.run_due()
    assert len(renewer.calls) == 1
    # The fresh lease's deadline is now + 30 - 0.25; the next renewal is half of that away.
    assert nxt == pytest.approx(clock() + (30.0 - 0.25) / 2)
    assert leases.remaining("a" * 32) == pytest.approx(30.0 - 0.25)
    assert wd.stats().renewals == 1
    assert not leases.ended


def test_one_heap_for_many_attempts(clock: CallClock, renewer: Renewer, leases: Leases) -> None:
    """Attempts with different deadlines are renewed in deadline order by one core."""
    wd = leases.watchdog(renewer)
    ids = ["1" * 32, "2" * 32, "3" * 32]
    for attempt_id, window in zip(ids, (30.0, 10.0, 20.0), strict=True):
        wd.track(attempt_id, clock() + window)
    order = []
    for _ in range(3):
        nxt = wd.run_due()
        assert nxt is not None
        clock.set(nxt)
        wd.run_due()
        order.append(renewer.calls[-1][0])
    # Due at +5 (10 s lease), +10 (20 s), +15 (30 s): the earliest deadline first.
    assert order == ["2" * 32, "3" * 32, "1" * 32]
    assert leases.losses == []


def test_deadline_passing_reports_lease_expired(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """When renewals keep failing until the local deadline, the lease is reported expired."""
    renewer.script = [_raise(WorkerDisconnected("down"))] * 100
    wd = leases.watchdog(renewer, retry=1.0)
    wd.track("a" * 32, clock() + 4.0)
    while not leases.ended:
        nxt = wd.run_due()
        assert nxt is not None or leases.ended
        if nxt is not None:
            clock.set(max(clock(), nxt))
    assert leases.ended == {"a" * 32: "lease_expired"}
    assert clock() == pytest.approx(1004.0)
    assert leases.losses == [("a" * 32, "lease_expired")]
    assert wd.stats().tracked == 0


def test_transient_failure_retried_after_bounded_delay_with_same_message_id(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """A timeout retries after retry_delay, busy (our own slots full) after the short busy
    delay, as every request does; each re-sends the unanswered message_id."""
    renewer.script = [
        _raise(CallTimeout("slow", message_id="f" * 32)),
        _raise(WorkerBusy("busy")),
    ]
    wd = leases.watchdog(renewer, retry=0.5)
    wd.track("a" * 32, clock() + 30.0)
    clock.advance(15.0)
    assert wd.run_due() == pytest.approx(clock() + 0.5)
    clock.advance(0.5)
    busy = retry_delay(WorkerBusy("busy"), 0.5)  # the one retry rule of every request
    assert busy < 0.5
    assert wd.run_due() == pytest.approx(clock() + busy)
    clock.advance(busy)
    wd.run_due()
    ids = [c[1] for c in renewer.calls]
    assert len(ids) == 3 and len(set(ids)) == 1, "an unanswered renew is re-sent as is"
    assert wd.stats().renew_failures == 2
    # Answered: the next renewal is a new operation with a new id.
    clock.advance(20.0)
    wd.run_due()
    assert renewer.calls[-1][1] != ids[0]


def test_retry_never_scheduled_past_the_deadline(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """A retry that would land after the deadline is replaced by the deadline itself."""
    renewer.script = [_raise(WorkerDisconnected("down"))]
    wd = leases.watchdog(renewer, retry=5.0)
    wd.track("a" * 32, clock() + 2.0)
    clock.advance(1.0)
    assert wd.run_due() == pytest.approx(1002.0)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (lambda c: lease(c, cancel=True), "cancel_requested"),
        (lambda c: lease(c, active=False, state=AttemptState.UNKNOWN), "lease_lost"),
        (lambda c: lease(c, state=AttemptState.LEASED), "lease_lost"),
    ],
    ids=["cancel_requested_at", "inactive", "not-running"],
)
def test_lease_answer_is_reported(
    clock: CallClock,
    renewer: Renewer,
    leases: Leases,
    answer: Callable[[CallClock], Lease],
    reason: str,
) -> None:
    """A renewal answer with a cancel request or without a running lease is reported (the
    attempt's machine cancels the handler) and no longer renewed."""
    renewer.script = [lambda: answer(clock)]
    wd = leases.watchdog(renewer)
    wd.track("a" * 32, clock() + 30.0)
    clock.advance(15.0)
    assert wd.run_due() is None
    assert leases.ended == {"a" * 32: reason}
    assert wd.stats().tracked == 0


def test_lease_lost_error_is_reported_once(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """The server answering LEASE_LOST is reported as lease_lost, once."""
    renewer.script = [_raise(WorkerError("LEASE_LOST", "gone", message_id="e" * 32))]
    wd = leases.watchdog(renewer)
    wd.track("a" * 32, clock() + 30.0)
    clock.advance(15.0)
    wd.run_due()
    clock.advance(30.0)
    wd.run_due()
    assert leases.losses == [("a" * 32, "lease_lost")]


def test_rate_limited_is_retried_not_lost(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """RATE_LIMITED/UNAVAILABLE are transient: the attempt keeps its lease and is retried."""
    renewer.script = [_raise(WorkerError("RATE_LIMITED", "slow down", message_id="e" * 32))]
    wd = leases.watchdog(renewer, retry=1.0)
    wd.track("a" * 32, clock() + 30.0)
    clock.advance(15.0)
    assert wd.run_due() == pytest.approx(clock() + 1.0)
    assert not leases.ended


def test_never_renews_untracked(clock: CallClock, renewer: Renewer, leases: Leases) -> None:
    """An untracked attempt (finished, or told to stop) is never renewed nor reported."""
    wd = leases.watchdog(renewer)
    wd.track("c" * 32, clock() + 10.0)
    wd.track("f" * 32, clock() + 10.0)
    wd.untrack("c" * 32)
    wd.untrack("f" * 32)
    clock.advance(30.0)
    assert wd.run_due() is None
    assert renewer.calls == [] and not leases.ended


def test_short_attempts_of_a_busy_worker_do_not_wake_the_watchdog_each(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """Once nothing is left to renew, the watchdog still wakes by itself BUSY_LINGER after the
    last track, so the next attempts (tracked and untracked before a renewal is due) need not
    wake it; after a quiet BUSY_LINGER it sleeps until woken, and the next track wakes it."""
    wakes: list[float] = []
    wd = leases.watchdog(renewer, on_change=lambda: wakes.append(clock()))
    wd.track("a" * 32, clock() + 30.0)
    assert len(wakes) == 1  # it slept until woken
    assert wd.run_due() == pytest.approx(clock() + 15.0)
    wd.untrack("a" * 32)
    clock.advance(0.2)
    # Woken for something else (a listener's job, an answer) with nothing left to renew.
    assert wd.run_due() == pytest.approx(clock() - 0.2 + BUSY_LINGER)
    for n in range(20):
        wd.track(f"{n:032x}", clock() + 30.0)
        wd.untrack(f"{n:032x}")
    assert len(wakes) == 1
    clock.advance(BUSY_LINGER)
    assert wd.run_due() is None  # quiet for BUSY_LINGER: sleep until woken
    wd.track("b" * 32, clock() + 30.0)
    assert len(wakes) == 2
    assert renewer.calls == []


def test_finished_during_renew_is_not_rescheduled(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """An attempt untracked while its renew was in flight is dropped, not renewed again."""
    wd = leases.watchdog(renewer)

    def finish_meanwhile() -> Lease:
        wd.untrack("a" * 32)
        return lease(clock)

    renewer.script = [finish_meanwhile]
    wd.track("a" * 32, clock() + 10.0)
    clock.advance(5.0)
    assert wd.run_due() is None
    assert wd.stats().renewals == 0


def _woke_late(
    clock: CallClock, renewer: Renewer, leases: Leases, late: float
) -> tuple[LeaseWatchdog, float | None]:
    """A watchdog whose first renewal (a 30 s lease's, due after 15 s) went out *late* seconds
    after it was due; what its ``run_due`` then returned."""
    wd = leases.watchdog(renewer)
    wd.track("a" * 32, clock() + 30.0)
    clock.advance(15.0 + late)
    return wd, wd.run_due()


def test_lag_is_measured(clock: CallClock, renewer: Renewer, leases: Leases) -> None:
    """Waking after the scheduled time shows up as lag in the stats."""
    wd, _ = _woke_late(clock, renewer, leases, 0.75)
    assert wd.stats().lag_last == pytest.approx(0.75)
    assert wd.stats().lag_max == pytest.approx(0.75)


def test_a_late_wake_up_brings_the_next_renewals_forward(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """A wake-up 0.75 s late schedules the next renewal twice that before half the window."""
    _, nxt = _woke_late(clock, renewer, leases, 0.75)
    assert len(renewer.calls) == 1
    assert nxt == pytest.approx(clock() + (30.0 - 0.25) / 2 - LEAD_FACTOR * 0.75)


def test_the_lead_is_at_most_a_quarter_of_the_wait(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """A wake-up later than a quarter of the wait brings the next renewal that quarter forward."""
    _, nxt = _woke_late(clock, renewer, leases, 10.0)
    wait = (30.0 - 0.25) / 2
    assert nxt == pytest.approx(clock() + wait * (1 - GROUP_FRACTION))


def test_the_lead_fades_after_punctual_wake_ups(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """Once the recent wake-ups came on time, renewals are due at half the window again."""
    wd, nxt = _woke_late(clock, renewer, leases, 0.75)
    for _ in range(LEAD_WAKES):
        assert nxt is not None and nxt < clock() + (30.0 - 0.25) / 2 - 1e-9
        clock.set(nxt)
        nxt = wd.run_due()
    assert nxt == pytest.approx(clock() + (30.0 - 0.25) / 2)
    assert len(renewer.calls) == LEAD_WAKES + 1


def test_a_cautious_start_leads_by_a_quarter_until_a_wake_up_is_measured(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """The Worker's watchdog renews a quarter of the wait early until it has measured a lag."""
    wd = leases.watchdog(renewer, cautious_start=True)
    wd.track("a" * 32, clock() + 30.0)
    nxt = wd.run_due()
    assert nxt == pytest.approx(clock() + 15.0 * (1 - GROUP_FRACTION))
    assert nxt is not None
    clock.set(nxt)
    nxt = wd.run_due()  # on time: a lag of 0 measured
    assert len(renewer.calls) == 1
    assert nxt == pytest.approx(clock() + (30.0 - 0.25) / 2)


def test_a_resume_moves_the_deadline_later_never_sooner(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """A resumed lease that ends later (a renewal applied whose answer a cut took) moves the
    deadline; one that ends sooner (a resume answered before the renewal behind it) does not:
    each is a safe bound, and the later stands."""
    wd = leases.watchdog(renewer)
    wd.track("a" * 32, clock() + 10.0)
    assert wd.refresh("a" * 32, clock() + 30.0), "the later deadline stands"
    assert wd.next_due() == pytest.approx(clock() + 5.0), "a resume grants no renewal time"
    assert not wd.refresh("a" * 32, clock() + 8.0), "the sooner one does not"
    clock.advance(9.0)
    assert wd.run_due() is not None and not leases.ended
    assert len(renewer.calls) == 1


def test_reconnects_never_put_off_a_renewal(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """Resumes that leave the lease as it was keep its renewal at half of the granted window,
    however many reconnects come before it; a resumed lease that ends sooner brings it forward."""
    wd = leases.watchdog(renewer)
    deadline = clock() + 2.75  # a 3 s lease
    wd.track("a" * 32, deadline)
    assert wd.next_due() == pytest.approx(1001.375)
    for _ in range(4):  # a reconnect every 0.3 s, each resume answering the same lease
        clock.advance(0.3)
        wd.refresh("a" * 32, deadline)
        assert wd.next_due() == pytest.approx(1001.375), "a resume grants no time"
    clock.advance(0.2)  # 1001.4: the renewal went out then, not in the lease's last moments
    wd.run_due()
    assert [c[2] for c in renewer.calls] == [pytest.approx(1001.4)]


def test_a_new_connection_renews_the_leases_past_a_quarter_of_their_window(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """Once a quarter of the window its last grant gave has passed, a lease is renewed on the
    next connection published, not left for its half-way point (the link may be down by
    then); a lease granted more recently waits, and reconnects in a row renew it once."""
    wd = leases.watchdog(renewer)
    a, b = "a" * 32, "b" * 32
    wd.track(a, clock() + 2.75)  # a quarter: 0.6875 s
    wd.track(b, clock() + 30.0)  # a quarter: 7.5 s
    clock.advance(0.5)
    wd.connected()
    assert wd.next_due() == pytest.approx(1001.375), "a quarter has not passed: no renewal yet"
    clock.advance(0.3)
    wd.connected()
    assert wd.next_due() == pytest.approx(clock()), "past a quarter: renew on this connection"
    wd.run_due()
    assert [c[0] for c in renewer.calls] == [a]
    wd.connected()
    wd.connected()
    wd.run_due()
    assert [c[0] for c in renewer.calls] == [a], "just renewed: reconnects add no renewal"


def test_retry_delay_is_bounded() -> None:
    """renew_retry_delay outside [0.1, 5] s is refused."""
    for bad in (0.0, 0.05, 6.0):
        with pytest.raises(ValueError, match="renew_retry_delay must be"):
            WorkerOptions(queue_id="a" * 32, renew_retry_delay=bad)


def test_thread_shell_renews_and_stops() -> None:
    """The thread shell renews on the real clock and stops promptly."""
    renewed = threading.Event()

    def renew(attempt_id: str, message_id: str) -> Lease:
        renewed.set()
        return lease(time.monotonic)

    wake = threading.Event()
    core = LeaseWatchdog(sync(renew), on_change=wake.set)
    shell = WatchdogThread(core, wake=wake, timers=Timers(core.clock, wake.set))
    before = set(threading.enumerate())
    shell.start()
    (thread,) = [
        t for t in threading.enumerate() if t not in before and t.name == "orbit-lease-watchdog"
    ]
    try:
        core.track("a" * 32, time.monotonic() + 0.2)
        assert renewed.wait(5.0)
    finally:
        shell.stop()
    assert not thread.is_alive()


def test_a_held_renewal_does_not_delay_another_attempts(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """Renewals are pipelined: B is sent on time while A's answer is held."""
    renewer.hold = True
    wd = leases.watchdog(renewer)
    a, b = "a" * 32, "b" * 32
    wd.track(a, clock() + 20.0)  # due at +10
    wd.track(b, clock() + 30.0)  # due at +15: too far to join A's batch
    clock.advance(10.0)
    assert wd.run_due() == pytest.approx(clock() + 5.0), "B is next, A is in flight"
    clock.advance(5.0)
    wd.run_due()
    assert [c[0] for c in renewer.calls] == [a, b], "B sent without waiting for A's answer"
    renewer.release(b, lambda: lease(clock))
    renewer.release(a, lambda: lease(clock))
    assert wd.stats().renewals == 2 and len(renewer.calls) == 2


def test_an_unanswered_renewal_still_expires_the_lease(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """While a renewal is in flight the deadline is watched; a late answer is then ignored."""
    renewer.hold = True
    wd = leases.watchdog(renewer)
    wd.track("a" * 32, clock() + 4.0)
    clock.advance(2.0)
    assert wd.run_due() == pytest.approx(1004.0), "in flight: next wake-up is the deadline"
    clock.advance(2.0)
    assert wd.run_due() is None
    assert leases.ended == {"a" * 32: "lease_expired"}
    renewer.release("a" * 32, lambda: lease(clock))
    assert wd.stats().renewals == 0 and wd.stats().tracked == 0


def test_refresh_during_a_renewal_survives_its_failure(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """A reconnect's refresh (new deadline) made while a renewal is in flight is kept when that
    renewal then fails: every entry field is written under the watchdog's lock."""
    renewer.hold = True
    wd = leases.watchdog(renewer, retry=5.0)
    wd.track("a" * 32, clock() + 30.0)
    clock.advance(15.0)
    wd.run_due()
    assert wd.refresh("a" * 32, clock() + 25.0)  # the connection thread, after resume
    renewer.release("a" * 32, _raise(WorkerDisconnected("old connection gone")))
    assert wd.next_due() == pytest.approx(clock() + 5.0), "the retry delay, sooner than half-way"
    assert wd.pending_renewals() == ["a" * 32]
    clock.set(1020.0)
    wd.run_due()  # the retry, held in flight: watched by its deadline
    clock.set(1031.0)  # past the deadline before the refresh, not the refreshed one
    wd.run_due()
    assert not leases.ended


def test_a_new_connection_resends_a_renew_left_unanswered(
    clock: CallClock, renewer: Renewer, leases: Leases
) -> None:
    """A renew the lost connection left unanswered (sent past a quarter of its window, like
    every renewal) goes out again as soon as the next connection is published, same
    message_id, not at the retry delay; once answered, reconnects add no renewal."""
    renewer.hold = True
    wd = leases.watchdog(renewer, retry=5.0)
    wd.track("a" * 32, clock() + 30.0)
    clock.advance(15.0)
    wd.run_due()
    [(_, first_id, _)] = renewer.calls
    renewer.release("a" * 32, _raise(WorkerDisconnected("old connection gone")))
    clock.advance(0.2)
    assert wd.next_due() == pytest.approx(clock() + 4.8), "left for the retry delay"
    wd.connected()
    assert wd.next_due() == pytest.approx(clock()), "at once"
    renewer.hold = False
    wd.run_due()
    assert [c[1] for c in renewer.calls] == [first_id, first_id], "same message_id re-sent"
    assert wd.pending_renewals() == []
    clock.advance(0.2)
    wd.connected()
    wd.run_due()
    assert len(renewer.calls) == 2, "answered: the next reconnect adds no renewal"


@pytest.mark.parametrize("pending", [False, True])
def test_a_loss_answering_the_reconnect_renewal_is_session_replaced(
    clock: CallClock, renewer: Renewer, leases: Leases, pending: bool
) -> None:
    """The renewal sent behind a new connection's resumes, answered LEASE_LOST, is reported as
    the resume's answer would be (session_replaced); a later renewal's loss is lease_lost."""
    wd = leases.watchdog(renewer)
    wd.track("a" * 32, clock() + 30.0)
    wd.track("b" * 32, clock() + 30.0)
    if pending:  # a renew left unanswered rather than a lease past a quarter of its window
        renewer.script = [_raise(WorkerDisconnected("gone"))] * 2
        clock.advance(15.0)
        wd.run_due()
    else:
        clock.advance(8.0)
    renewer.script = [_raise(WorkerError("LEASE_LOST", "gone", message_id="e" * 32))] * 2
    wd.connected()
    wd.run_due()
    assert leases.ended == {"a" * 32: "session_replaced", "b" * 32: "session_replaced"}
    wd.track("c" * 32, clock() + 30.0)
    renewer.script = [_raise(WorkerError("LEASE_LOST", "gone", message_id="f" * 32))]
    wd.connected()  # granted just now: no renewal behind this connection's resumes
    clock.advance(15.0)
    wd.run_due()
    assert leases.ended["c" * 32] == "lease_lost"


@pytest.fixture
def batcher(clock: CallClock) -> Renewer:
    """A send function over the fake clock, for the tests of batches."""
    return Renewer(clock)


def test_renewals_due_together_go_out_in_one_batch(
    clock: CallClock, batcher: Renewer, leases: Leases
) -> None:
    """Attempts due at the same moment are handed to send_many once, all of them."""
    wd = leases.watchdog(batcher)
    ids = ["1" * 32, "2" * 32, "3" * 32]
    for attempt_id in ids:
        wd.track(attempt_id, clock() + 30.0)
    clock.advance(15.0)
    wd.run_due()
    assert batcher.batches == [ids]
    assert wd.stats().renewals == 3


def test_nearly_due_renewals_join_a_batch(
    clock: CallClock, batcher: Renewer, leases: Leases
) -> None:
    """A renewal within a quarter of its wait joins the batch sent now (lag 0: it is early); one
    further away waits for its own time."""
    wd = leases.watchdog(batcher)
    a, near, far = "a" * 32, "b" * 32, "c" * 32
    wd.track(a, clock() + 20.0)  # due at +10
    wd.track(near, clock() + 22.0)  # due at +11: 1 s of an 11 s wait left at +10
    wd.track(far, clock() + 30.0)  # due at +15: 5 s of 15 s left
    clock.advance(10.25)
    assert wd.run_due() == pytest.approx(1015.0)
    assert batcher.batches == [[a, near]]
    assert leases.lags == {a: pytest.approx(0.25), near: 0.0}
    assert wd.stats().lag_last == pytest.approx(0.25)
    clock.set(1015.0)
    wd.run_due()
    assert batcher.batches == [[a, near], [far]]


def test_a_batch_never_takes_a_renewal_sooner_than_the_minimum_interval(
    clock: CallClock, batcher: Renewer, leases: Leases
) -> None:
    """A lease granted less than MIN_RENEW_INTERVAL ago is not renewed early with a batch."""
    wd = leases.watchdog(batcher)
    a, fresh = "a" * 32, "f" * 32
    wd.track(a, clock() + 19.998)  # due at +9.999
    clock.advance(9.96)
    # Granted 39 ms before A's batch, 40 ms left: due at its deadline (+10.0), 1 ms after the
    # batch and well within a quarter of its wait; only the minimum interval keeps it out.
    wd.track(fresh, clock() + 0.04)
    clock.set(1009.999)
    wd.run_due()
    assert batcher.batches == [[a]]


def test_a_batch_send_that_raises_fails_and_retries_every_renewal(
    clock: CallClock, batcher: Renewer, leases: Leases
) -> None:
    """send_many raising (a bug) is a failure of each renewal in it: all retried, none lost."""
    batcher.fail_with = RuntimeError("send bug")
    wd = leases.watchdog(batcher, retry=0.5)
    ids = ["1" * 32, "2" * 32]
    for attempt_id in ids:
        wd.track(attempt_id, clock() + 30.0)
    clock.advance(15.0)
    assert wd.run_due() == pytest.approx(clock() + 0.5)
    assert wd.stats().renew_failures == 2 and wd.pending_renewals() == ids
    batcher.fail_with = None
    clock.advance(0.5)
    wd.run_due()
    assert batcher.batches == [ids, ids]
    assert wd.stats().renewals == 2 and leases.losses == []


def test_the_worker_renews_attempts_due_together_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three handlers started at the same (fake) moment fall due together: the Worker hands their
    three renew frames to the transport in one send_texts call, i.e. one socket write."""
    writes: list[list[str]] = []
    lock = threading.Lock()
    original = Transport.send_texts

    def recording(transport: Transport, texts: Sequence[str]) -> None:
        renews = [text for text in texts if '"task.renew"' in text]
        if renews:
            with lock:
                writes.append(renews)
        original(transport, texts)

    monkeypatch.setattr(Transport, "send_texts", recording)
    manual = ManualClock()
    with MockOrbitServer(clock=manual, lease_duration=2.0, assignment_rate=None) as server:
        probe = Probe()
        renewed = threading.Semaphore(0)

        class Renewals(WorkerListener):
            def lease_renewed(self, event: LeaseEvent) -> None:
                renewed.release()

        worker = make_worker(server, capacity=3, clock=manual, listeners=[Renewals()])

        @worker.handler("hold")
        def hold(ctx: TaskContext, payload: Any) -> None:
            probe.enter(ctx)
            probe.release.wait(10)

        for _ in range(3):
            server.enqueue("hold", {})
        with running(worker):
            probe.wait_started(3)
            server.advance(1.0)  # past half of every (2 s - margin) local lease
            for _ in range(3):
                assert renewed.acquire(timeout=10), "a renewal was not answered"
            probe.release.set()
        assert len(writes) == 1 and len(writes[0]) == 3
        assert len({json.loads(text)["body"]["attempt_id"] for text in writes[0]}) == 3
        assert worker.stats().lease_losses == 0


def test_early_additions_stop_at_a_bounded_batch(
    clock: CallClock, batcher: Renewer, leases: Leases
) -> None:
    """Nearly due renewals fill a batch only up to MAX_EARLY_BATCH; renewals that are due all go."""
    wd = leases.watchdog(batcher)
    due_now = [f"{i:032x}" for i in range(MAX_EARLY_BATCH - 2)]
    nearly = [f"{i:032x}" for i in range(100, 105)]
    for attempt_id in due_now:
        wd.track(attempt_id, clock() + 20.0)  # due at +10
    for attempt_id in nearly:
        wd.track(attempt_id, clock() + 21.0)  # due at +10.5: joins if room
    clock.advance(10.0)
    wd.run_due()
    [first] = batcher.batches
    assert first[: len(due_now)] == due_now and len(first) == MAX_EARLY_BATCH
    assert set(first[len(due_now) :]) < set(nearly)
    many = [f"{i:032x}" for i in range(200, 200 + MAX_EARLY_BATCH + 4)]
    for attempt_id in many:
        wd.track(attempt_id, clock() + 2.0)  # all due at once, 1 s from now
    clock.advance(1.0)
    wd.run_due()
    assert set(many) <= set(batcher.batches[-1]), "every due renewal goes, however many"
