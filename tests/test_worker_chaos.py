"""Seeded chaos: a real Worker against a real mock server while faults are injected.

A seeded schedule arms faults (dropped, delayed or refused answers, connections closed before or
after a request is applied) on every request type, cuts connections, refuses reconnects and
duplicates assignments, each step triggered by the server's progress (never by sleeping). Timing
varies from run to run; what is asserted holds for every interleaving:

1. a handler runs at most once per attempt;
2. every handler invocation's outcome reaches the server (stored result, or evidence);
3. every SUCCEEDED task stores exactly what its handler returned;
4. the server's global invariants hold;
5. every attempt the server started was finished by the worker (or recovered by the server);
6. ``stop()`` returns, reports nothing lost, and leaves no worker thread behind.

The three seeds together arm 24 of the 25 (fault kind, request type) pairs. To soak more
schedules locally: ``ORBIT_CHAOS_SEEDS=0:200 pytest tests/test_worker_chaos.py -k chaos``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _worker_helpers import (
    WORKER_THREAD_PREFIXES,
    Sessions,
    events,
    has_event,
    make_worker,
    running,
)

from orbit_sync.models import AttemptState, Outcome, TaskState
from orbit_sync.testing import MockOrbitServer, RetrySafety, TaskSnapshot
from orbit_sync.worker import ShutdownReport, TaskContext, Worker

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"})
REQUEST_TYPES = ("task.start", "task.renew", "task.finish", "worker.capacity", "worker.resume")
FAULT_KINDS = ("drop_reply", "close_before", "close_after", "delay_reply", "reply_error")
TASKS = 40
CAPACITY = 8
LEASE = 2.0
#: High enough that lost leases and retries never exhaust a task's budget.
MAX_ATTEMPTS = 25
#: One seed's whole run (schedule, completion, delivery) must fit in this.
BUDGET = 25.0


def _seeds() -> tuple[int, ...]:
    """The CI seeds, or the ``start:stop`` range in ``ORBIT_CHAOS_SEEDS``."""
    chosen = os.environ.get("ORBIT_CHAOS_SEEDS")
    if not chosen:
        return (93, 99, 123)
    start, _, stop = chosen.partition(":")
    return tuple(range(int(start), int(stop or int(start) + 1)))


SEEDS = _seeds()


@dataclasses.dataclass
class Invocation:
    """One call of the handler, as the handler itself recorded it."""

    task_id: str
    attempt_id: str
    attempt: int
    returned: Any = None
    raised: str | None = None
    done: bool = False


class Ledger:
    """Every handler invocation, recorded by the handlers under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[Invocation] = []

    def enter(self, ctx: TaskContext) -> Invocation:
        """Record that a handler was called for ``ctx``'s attempt."""
        call = Invocation(ctx.task_id, ctx.attempt_id, ctx.attempt)
        with self._lock:
            self._calls.append(call)
        return call

    def leave(self, call: Invocation, *, returned: Any = None, raised: str | None = None) -> None:
        """Record how the call ended."""
        with self._lock:
            call.returned = returned
            call.raised = raised
            call.done = True

    def calls(self) -> list[Invocation]:
        """A copy of the invocations so far."""
        with self._lock:
            return [dataclasses.replace(c) for c in self._calls]


def expected_result(payload: Any, attempt: int) -> dict[str, Any]:
    """What the handler returns for *payload* on attempt number *attempt*."""
    i = payload["i"]
    return {"i": i, "square": i * i, "attempt": attempt}


def register_job(worker: Worker, ledger: Ledger) -> None:
    """Register the ``job`` handler: quick, cooperative (honours cancel) or stubborn (ignores)."""

    @worker.handler("job")
    def job(ctx: TaskContext, payload: Any) -> Any:
        call = ledger.enter(ctx)
        try:
            seconds = payload["seconds"]
            if payload["mode"] == "cooperative":
                ctx.sleep(seconds)
            elif payload["mode"] == "stubborn":
                # Simulated blocking work that never looks at ctx (not a wait for a condition).
                threading.Event().wait(seconds)
            result = expected_result(payload, ctx.attempt)
        except BaseException as exc:
            ledger.leave(call, raised=type(exc).__name__)
            raise
        ledger.leave(call, returned=result)
        return result


def payloads(rng: random.Random) -> list[dict[str, Any]]:
    """The task mix: a few handlers span several lease renewals, most are quick."""
    out = []
    for i in range(TASKS):
        if i % 10 == 0:
            mode, seconds = "cooperative", rng.uniform(1.4, 2.0)
        elif i % 10 == 5:
            mode, seconds = "stubborn", rng.uniform(1.4, 2.0)
        elif i % 10 in (3, 7):
            mode, seconds = "cooperative", rng.uniform(0.2, 0.6)
        else:
            mode, seconds = "quick", 0.0
        out.append({"i": i, "mode": mode, "seconds": round(seconds, 3)})
    return out


@dataclasses.dataclass(frozen=True)
class Step:
    """One chaos action, taken once the server has started *after_starts* attempts."""

    after_starts: int
    action: str
    target: str | None = None
    count: int = 1
    seconds: float = 0.0
    code: str = ""


def chaos_schedule(rng: random.Random) -> list[Step]:
    """A seeded, bounded schedule: every request type gets a fault, plus extras and cuts."""
    picks: list[tuple[str, str | None]] = [(rng.choice(FAULT_KINDS), t) for t in REQUEST_TYPES]
    picks += [(rng.choice(FAULT_KINDS), rng.choice(REQUEST_TYPES)) for _ in range(4)]
    picks += [("cut", None), ("cut", None), ("duplicate_push", "task.assign"), ("refuse", None)]
    rng.shuffle(picks)
    thresholds = sorted(rng.sample(range(1, TASKS * 3 // 4), len(picks)))
    return [
        Step(
            after_starts=after,
            action=action,
            target=target,
            count=rng.randint(1, 2),
            seconds=rng.choice((0.2, 0.4, 0.9)),  # 0.9 s outlasts the 0.6 s call timeout
            code=rng.choice(("UNAVAILABLE", "RATE_LIMITED")),
        )
        for after, (action, target) in zip(thresholds, picks, strict=True)
    ]


def arm(server: MockOrbitServer, step: Step) -> None:
    """Take one chaos action now."""
    faults = server.faults
    if step.action == "cut":
        server.disconnect()
    elif step.action == "refuse":
        faults.refuse_connections(step.count)
    elif step.action == "duplicate_push":
        faults.duplicate_push("task.assign", step.count)
    elif step.action == "delay_reply":
        assert step.target is not None
        faults.delay_reply(step.target, step.seconds, step.count)
    elif step.action == "reply_error":
        assert step.target is not None
        faults.reply_error(step.target, step.code, step.count)
    else:
        assert step.target is not None
        getattr(faults, step.action)(step.target, step.count)


class Progress:
    """Attempts started and tasks finished, read incrementally from the server's event log
    (``wait_until`` re-checks its predicate after every server change, under the server's lock).
    """

    def __init__(self) -> None:
        self._seen = 0
        self.starts = 0
        self.done: set[str] = set()

    def update(self, server: MockOrbitServer) -> Progress:
        """Account for the events recorded since the last call."""
        log = server.events()
        for e in log[self._seen :]:
            if e.kind == "attempt.state" and e.new == "RUNNING":
                self.starts += 1
            elif e.kind == "task.state" and e.new in TERMINAL and e.task_id is not None:
                self.done.add(e.task_id)
        self._seen = len(log)
        return self

    def reached(self, starts: int) -> Callable[[MockOrbitServer], bool]:
        """A ``wait_until`` predicate: *starts* attempts were started, or every task is done."""

        def check(server: MockOrbitServer) -> bool:
            self.update(server)
            return self.starts >= starts or len(self.done) == TASKS

        return check


def stored(call: Invocation, snap: TaskSnapshot) -> bool:
    """True when *call*'s outcome is at the server: its attempt's result, or evidence."""
    [att] = [a for a in snap.attempts if a.attempt_id == call.attempt_id]
    evidence = [e for e in snap.evidence if e.attempt_id == call.attempt_id]
    finishes = [(e.outcome, e.result) for e in evidence]
    if att.outcome is not None:
        finishes.append((att.outcome, att.result))
    if call.raised is None:  # it returned: that exact result, as SUCCEEDED
        return (Outcome.SUCCEEDED, call.returned) in finishes
    # It raised (it stopped on a cancelled context): some other outcome was reported.
    return any(outcome is not Outcome.SUCCEEDED for outcome, _ in finishes)


def undelivered(server: MockOrbitServer, ledger: Ledger) -> list[Invocation]:
    """Invocations still running, or whose outcome the server does not hold."""
    snaps = {s.task_id: s for s in server.tasks()}
    return [c for c in ledger.calls() if not c.done or not stored(c, snaps[c.task_id])]


def join_worker_threads(before: set[threading.Thread], timeout: float) -> list[str]:
    """Join threads a worker started since *before*; return the names still alive."""
    left = [
        t
        for t in threading.enumerate()
        if t not in before and t.name.startswith((*WORKER_THREAD_PREFIXES, "orbit-sync-"))
    ]
    deadline = time.monotonic() + timeout
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in left if t.is_alive()]


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_chaos_no_double_run_no_lost_result(seed: int) -> None:
    """Under a seeded fault schedule every attempt runs at most once and no outcome is lost."""
    rng = random.Random(seed)
    before = set(threading.enumerate())
    ledger = Ledger()
    steps = chaos_schedule(rng)
    jobs = payloads(rng)
    with MockOrbitServer(lease_duration=LEASE, session_window=6.0, assignment_rate=None) as server:
        worker = make_worker(
            server,
            capacity=CAPACITY,
            call_timeout=0.6,
            renew_retry_delay=0.2,
            drain_timeout=10.0,
            cancel_grace=1.0,
            flush_timeout=5.0,
        )
        register_job(worker, ledger)
        ids = [
            server.enqueue(
                "job",
                payload,
                max_attempts=MAX_ATTEMPTS,
                backoff_initial=0.05,
                backoff_max=0.2,
                retry_safety=RetrySafety.IDEMPOTENT,
            )
            for payload in jobs
        ]
        end = time.monotonic() + BUDGET
        worker.start()
        report: ShutdownReport | None = None
        try:
            assert worker.wait_ready(10.0), "the worker never connected"
            # The chaos: each step waits for the server's progress, never for time.
            progress = Progress()
            for step in steps:
                server.wait_until(
                    progress.reached(step.after_starts), max(0.1, end - time.monotonic())
                )
                arm(server, step)
            for task_id in ids:
                server.wait_for(task_id, TERMINAL, timeout=max(0.1, end - time.monotonic()))
            server.faults.clear()
            # Handlers of lost leases may still be running: wait for their late results.
            try:
                server.wait_until(
                    lambda s: not undelivered(s, ledger),
                    timeout=max(0.1, end - time.monotonic()),
                )
            except TimeoutError:
                missing = undelivered(server, ledger)
                raise AssertionError(
                    f"seed {seed}: outcomes never reached the server: {missing}"
                ) from None
            report = worker.stop(drain=True, timeout=5.0)
        finally:
            worker.stop(drain=False)
        stats = worker.stats()
        snaps = {s.task_id: s for s in server.tasks()}
        server.check_invariants()  # (4)
        all_events = server.events()

    calls = ledger.calls()
    context = f"seed {seed}, schedule {steps}"
    # (1) A handler ran at most once per attempt, and only for attempts the server started.
    runs = collections.Counter((c.task_id, c.attempt_id) for c in calls)
    assert [k for k, n in runs.items() if n > 1] == [], context
    for c in calls:
        [att] = [a for a in snaps[c.task_id].attempts if a.attempt_id == c.attempt_id]
        assert att.started_at is not None, f"{context}: handler ran for an unstarted attempt {c}"
        assert att.number == c.attempt
    # (2) Every invocation's outcome reached the server.
    assert all(c.done for c in calls)
    assert [c for c in calls if not stored(c, snaps[c.task_id])] == [], context
    # (3) Every task succeeded (budget is ample), storing what its handler returned.
    by_attempt = {c.attempt_id: c for c in calls}
    for payload, task_id in zip(jobs, ids, strict=True):
        snap = snaps[task_id]
        assert snap.state is TaskState.SUCCEEDED, f"{context}: {snap}"
        [winner] = [a for a in snap.attempts if a.outcome is Outcome.SUCCEEDED]
        assert snap.result == by_attempt[winner.attempt_id].returned, context
        assert snap.result == expected_result(payload, winner.number)
    # (5) Every attempt is settled (finished, or recovered by the server), and every started
    # one got the worker's finish: its stored outcome, or evidence when the lease ran out first.
    for snap in snaps.values():
        evidence = {e.attempt_id for e in snap.evidence}
        for att in snap.attempts:
            assert att.state not in (AttemptState.LEASED, AttemptState.RUNNING), context
            if att.started_at is not None:
                finished = att.outcome is not None or att.attempt_id in evidence
                assert finished, f"{context}: started, never finished by the worker: {att}"
    # (6) stop() returned with nothing lost, and the worker's threads are gone.
    assert report == ShutdownReport(drained=True) and report.error is None, report
    assert stats.finish_rejected == 0 and stats.running == 0
    assert join_worker_threads(before, timeout=5.0) == []
    # One finish per attempt, re-sent only under its own message_id: the server never saw a
    # second report (same content under a new id, or conflicting content), nor a finish for an
    # attempt that was never started; no invalid frame, and its outbox never overflowed.
    kinds = collections.Counter(e.kind for e in all_events)
    assert kinds["finish.repeated"] == 0, context
    assert {e.reason for s in snaps.values() for e in s.evidence} <= {"late"}, context
    assert kinds["frame.invalid"] == kinds["connection.slow_consumer"] == 0, context
    # The schedule really did disturb the run.
    assert kinds["fault.fired"] > 0 and stats.reconnects >= 1, context
    # The run's figures, shown with ``-rP`` (docs/reliability.md quotes a run of seeds 100:110).
    attempts = sum(len(s.attempts) for s in snaps.values())
    evidence = sum(len(s.evidence) for s in snaps.values())
    print(
        f"chaos seed {seed}: tasks={len(ids)} attempts={attempts} handler_runs={len(calls)} "
        f"faults_fired={kinds['fault.fired']} reconnects={stats.reconnects} "
        f"lease_losses={stats.lease_losses} evidence_only={evidence} "
        f"double_runs=0 lost_outcomes=0"
    )


def test_finish_cut_then_refused_reconnects_delivered_once() -> None:
    """close_after(task.finish) then two refused reconnects: the finish lands once, deduplicated."""
    ledger = Ledger()
    release = threading.Event()
    entered = threading.Event()
    with MockOrbitServer(lease_duration=LEASE, assignment_rate=None) as server:
        sessions = Sessions()
        worker = make_worker(server, capacity=2, listeners=[sessions])

        @worker.handler("held")
        def held(ctx: TaskContext, payload: Any) -> Any:
            call = ledger.enter(ctx)
            entered.set()
            release.wait(10)
            result = expected_result(payload, ctx.attempt)
            ledger.leave(call, returned=result)
            return result

        task_id = server.enqueue("held", {"i": 9})
        with running(worker):
            assert entered.wait(10), "the handler never started"
            # Armed once connected, so the first connect is not refused.
            cut = server.faults.close_after("task.finish")
            refused = server.faults.refuse_connections(2)
            release.set()
            server.wait_until(has_event("request.deduplicated", task_id, "task.finish"), 10)
            snap = server.wait_for(task_id, TERMINAL, timeout=10)
            # The kept finish goes out behind the resume, before the session counts as
            # established: wait for that before reading the count.
            assert sessions.wait(lambda s: s.established >= 2), "never reconnected"
        stats = worker.stats()
        server.check_invariants()
        assert (cut.fired, refused.fired) == (1, 2)
        assert snap.state is TaskState.SUCCEEDED
        assert snap.result == {"i": 9, "square": 81, "attempt": 1}
        assert len(snap.attempts) == 1 and snap.evidence == ()
        # Applied once before the cut; the re-send (same message_id) was only a replay.
        assert len(events(server, "request.deduplicated", task_id)) == 1
        assert not events(server, "finish.repeated", task_id)
        finishes = [e for e in events(server, "attempt.state", task_id) if e.new == "SUCCEEDED"]
        assert len(finishes) == 1
    assert [c.attempt_id for c in ledger.calls()] == [snap.attempts[0].attempt_id]
    assert stats.succeeded == 1 and stats.reconnects >= 1 and stats.finish_rejected == 0
