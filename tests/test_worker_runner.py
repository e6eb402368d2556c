"""The Worker against the real mock server over loopback: dispatch, leases, reconnects, outcomes."""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
from typing import Any

import pytest
from _worker_helpers import (
    Probe,
    Sessions,
    events,
    has_event,
    let_reconnect,
    make_worker,
    running,
)

from orbit_sync.models import SECRET_RE, AttemptState, Outcome, TaskState
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import (
    Fail,
    LeaseEvent,
    TaskContext,
    UnknownEffect,
    WorkerListener,
)

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Any:
    """A mock server; ``@pytest.mark.orbit_server(...)`` overrides its settings."""
    kwargs: dict[str, Any] = {"assignment_rate": None}
    marker = request.node.get_closest_marker("orbit_server")
    if marker is not None:
        kwargs.update(marker.kwargs)
    with MockOrbitServer(**kwargs) as srv:
        yield srv
        srv.check_invariants()


def test_many_tasks_at_once(server: MockOrbitServer) -> None:
    """Sixty tasks over three handlers all succeed once each, with handlers running in parallel."""
    together = threading.Barrier(4, timeout=10)
    worker = make_worker(server, capacity=8)

    @worker.handler("double")
    def double(ctx: TaskContext, payload: Any) -> Any:
        if payload.get("together"):
            together.wait()  # only passes if four handlers run at the same time
        return {"value": payload["i"] * 2}

    @worker.handler("shout", version=2, payload_version=3)
    def shout(ctx: TaskContext, payload: Any) -> Any:
        return payload["text"].upper()

    @worker.handler("noop")
    def noop(ctx: TaskContext, payload: Any) -> None:
        return None

    ids: dict[str, Any] = {}
    for i in range(4):
        ids[server.enqueue("double", {"i": i, "together": True})] = {"value": i * 2}
    for i in range(4, 40):
        ids[server.enqueue("double", {"i": i})] = {"value": i * 2}
    for i in range(15):
        ids[
            server.enqueue("shout", {"text": f"t{i}"}, handler_version="2", payload_version="3")
        ] = f"T{i}"
    for _ in range(5):
        ids[server.enqueue("noop", [1])] = {}
    with running(worker):
        for task_id, expected in ids.items():
            snap = server.wait_for(task_id, DONE, timeout=20)
            assert snap.state is TaskState.SUCCEEDED, snap
            assert snap.result == expected
            assert len(snap.attempts) == 1
    # After stop() every acknowledgement has been counted.
    assert worker.stats().succeeded == 60
    assert worker.stats().running == 0


def test_long_handler_kept_alive_across_short_leases() -> None:
    """A handler running 2.5 lease windows on 1 s leases (1.5 s sessions) is renewed and finishes
    on its one lease; the time is fake (the server's ManualClock, followed by the worker's)."""
    manual = ManualClock()
    with MockOrbitServer(
        clock=manual, lease_duration=1.0, session_window=1.5, assignment_rate=None
    ) as server:
        probe = Probe()
        renewed = threading.Semaphore(0)

        class Renewals(WorkerListener):
            def lease_renewed(self, event: LeaseEvent) -> None:
                renewed.release()

        worker = make_worker(server, clock=manual, listeners=[Renewals()])

        @worker.handler("long")
        def long(ctx: TaskContext, payload: Any) -> Any:
            probe.enter(ctx)
            probe.release.wait(10)
            return {"ok": True}

        def heartbeat_seen(s: MockOrbitServer) -> bool:
            return s.sessions()[-1].expires_at - s.now() >= dt.timedelta(seconds=1.5)

        task_id = server.enqueue("long", {})
        with running(worker):
            probe.wait_started()
            # 5 x 0.5 s: before each step, the worker must have taken in its renewal's answer
            # (the next step would otherwise pass its old deadline) and its heartbeat.
            for _ in range(5):
                server.advance(0.5)
                assert renewed.acquire(timeout=10), "no renewal answered within the step"
                server.wait_until(heartbeat_seen, timeout=10)
            probe.release.set()
            snap = server.wait_for(task_id, DONE, timeout=10)
            stats = worker.stats()
        assert snap.state is TaskState.SUCCEEDED
        assert [a.state for a in snap.attempts] == [AttemptState.SUCCEEDED]
        assert snap.evidence == ()
        assert stats.renewals >= 5 and stats.lease_losses == 0 and stats.reconnects == 0
        # The idle-looking session was kept alive by capacity heartbeats (PROTOCOL §5.6).
        assert not any(s.expired for s in server.sessions())
        assert stats.renew_lag_max < 1.0
        server.check_invariants()


def test_lease_loss_cancels_handler_and_late_result_is_evidence() -> None:
    """The server losing the lease cancels the handler (lease_lost); its late result is evidence.
    Fake time: the server's clock jumps past the lease, the worker's only to its renewal."""
    probe = Probe()
    clock = ManualClock(0.0)
    with MockOrbitServer(clock=ManualClock(), lease_duration=2.0, assignment_rate=None) as server:
        worker = make_worker(server, clock=clock)

        @worker.handler("work")
        def work(ctx: TaskContext, payload: Any) -> Any:
            probe.enter(ctx)
            ctx.cancelled.wait(10)
            probe.reasons[ctx.task_id] = ctx.cancel_reason
            return {"late": True}  # ignores the cancel: a truthful, late SUCCEEDED

        task_id = server.enqueue("work", {})
        with running(worker):
            probe.wait_started()
            server.advance(5.0)  # the server's lease expires; recovery marks the attempt UNKNOWN
            clock.advance(1.0)  # the worker's renewal is due (its own deadline is not yet)
            server.wait_until(lambda s: bool(s.task(task_id).evidence), timeout=10)
        server.check_invariants()
    snap = server.task(task_id)
    assert probe.reasons[task_id] == "lease_lost"
    assert snap.state is TaskState.NEEDS_REVIEW
    [evidence] = snap.evidence
    assert (evidence.outcome, evidence.result, evidence.reason) == (
        Outcome.SUCCEEDED,
        {"late": True},
        "late",
    )
    stats = worker.stats()
    assert stats.lease_losses == 1 and stats.evidence_only == 1
    assert probe.runs[task_id] == 1


@pytest.mark.orbit_server(lease_duration=2.0, assignment_rate=None, clock=ManualClock())
def test_connection_cut_mid_handler(
    server: MockOrbitServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A cut connection: reconnect with the same instance, resume, keep renewing, one finish
    (fake time: the server's clock, followed by the worker's, moves past the reconnect delay
    and to the next renewal)."""
    caplog.set_level(logging.DEBUG)
    probe = Probe()
    sessions = Sessions()
    assert isinstance(server.clock, ManualClock)
    clock = server.clock
    worker = make_worker(server, clock=clock, listeners=[sessions])

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        while not probe.release.wait(0.05):
            ctx.raise_if_cancelled()
        return {"ok": True}

    task_id = server.enqueue("work", {})
    with running(worker):
        probe.wait_started()
        assert server.disconnect() == 1
        let_reconnect(server, clock, sessions)
        server.wait_until(has_event("attempt.resumed", task_id), timeout=10)
        # Renewals go on over the new session before the handler is released.
        resumed_at = events(server, "attempt.resumed", task_id)[-1].at
        server.advance(server.lease_duration / 2)
        server.wait_until(
            lambda s: any(e.at > resumed_at for e in events(s, "attempt.renewed", task_id)),
            timeout=10,
        )
        probe.release.set()
        snap = server.wait_for(task_id, DONE, timeout=10)
    assert snap.state is TaskState.SUCCEEDED
    assert probe.runs[task_id] == 1 and len(snap.attempts) == 1
    assert snap.evidence == () and not events(server, "finish.repeated", task_id)
    stats = worker.stats()
    assert stats.reconnects >= 1 and stats.lease_losses == 0
    sessions = server.sessions()
    assert len(sessions) >= 2
    assert len({s.instance_id for s in sessions}) == 1, "same registration on reconnect"
    assert sessions[-1].epoch > sessions[0].epoch
    # Every log line of the whole scenario (DEBUG included) is free of secrets.
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert task_id in text and "reconnecting" in text
    assert server.token not in text
    assert worker.registration.instance_secret not in text
    words = re.split(r"[^A-Za-z0-9_-]+", text)
    assert not [w for w in words if SECRET_RE.fullmatch(w)], "no lease_secret-shaped word"


@pytest.mark.parametrize("fault", ["close_after", "close_before"])
def test_start_answer_lost_runs_handler_once(server: MockOrbitServer, fault: str) -> None:
    """A start whose answer was lost is re-sent with its message_id; the handler runs once."""
    probe = Probe()
    worker = make_worker(server)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        return {"ok": True}

    armed = getattr(server.faults, fault)("task.start")
    task_id = server.enqueue("work", {})
    with running(worker):
        snap = server.wait_for(task_id, DONE, timeout=10)
    assert armed.fired == 1
    assert snap.state is TaskState.SUCCEEDED and len(snap.attempts) == 1
    assert probe.runs[task_id] == 1
    replayed = has_event("request.deduplicated", task_id, "task.start")(server)
    # Applied before the cut: the re-sent start is answered from its original receipt.
    assert replayed is (fault == "close_after")


def test_finish_answer_lost_is_resent_and_deduplicated(server: MockOrbitServer) -> None:
    """A finish whose answer never came is re-sent with the same message_id: deduplicated."""
    sessions = Sessions()
    worker = make_worker(server, call_timeout=1.0, listeners=[sessions])

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        return {"ok": True}

    dropped = server.faults.drop_reply("task.finish")
    task_id = server.enqueue("work", {})
    with running(worker):
        server.wait_until(has_event("request.deduplicated", task_id, "task.finish"), timeout=10)
        # The re-send goes out right behind the resume, before the session counts as
        # established (its resumes over): wait for that before reading the count.
        assert sessions.wait(lambda s: s.established >= 2), "the worker never reconnected"
    snap = server.task(task_id)
    assert dropped.fired == 1
    assert snap.state is TaskState.SUCCEEDED and snap.result == {"ok": True}
    # Same message_id: a replay, not a second finish under a new id ("finish.repeated").
    assert not events(server, "finish.repeated", task_id) and snap.evidence == ()
    stats = worker.stats()
    assert stats.succeeded == 1 and stats.reconnects >= 1


@pytest.mark.orbit_server(lease_duration=1.0, assignment_rate=None, clock=ManualClock())
def test_renew_answer_lost_is_resent(server: MockOrbitServer) -> None:
    """A renew cut off before its answer is re-sent with the same message_id after reconnect
    (fake time: the server's clock, followed by the worker's, moves to the renewal and past the
    reconnect delay)."""
    probe = Probe()
    sessions = Sessions()
    assert isinstance(server.clock, ManualClock)
    clock = server.clock
    worker = make_worker(server, clock=clock, listeners=[sessions])

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        while not probe.release.wait(0.05):
            ctx.raise_if_cancelled()
        return {"ok": True}

    cut = server.faults.close_after("task.renew")
    task_id = server.enqueue("work", {})
    with running(worker):
        probe.wait_started()
        server.advance(server.lease_duration / 2)
        let_reconnect(server, clock, sessions)
        server.wait_until(has_event("request.deduplicated", task_id, "task.renew"), timeout=10)
        probe.release.set()
        snap = server.wait_for(task_id, DONE, timeout=10)
    assert cut.fired == 1
    assert snap.state is TaskState.SUCCEEDED and snap.evidence == ()
    assert worker.stats().lease_losses == 0


@pytest.mark.orbit_server(lease_duration=5.0, assignment_rate=None)
def test_lease_not_surviving_reconnect_cancels_handler(server: MockOrbitServer) -> None:
    """A lease that expired while disconnected: resume says so, the handler is cancelled."""
    probe = Probe()
    worker = make_worker(server)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        ctx.cancelled.wait(10)
        probe.reasons[ctx.task_id] = ctx.cancel_reason
        ctx.raise_if_cancelled()
        return {"ok": True}

    task_id = server.enqueue("work", {})
    with running(worker):
        probe.wait_started()
        refused = server.faults.refuse_connections(count=1_000_000)
        server.disconnect()
        server.advance(10.0)  # while the worker cannot get back in, its lease runs out
        refused.cancel()
        server.wait_until(lambda s: bool(s.task(task_id).evidence), timeout=10)
    assert probe.reasons[task_id] == "session_replaced"
    [evidence] = server.task(task_id).evidence
    assert (evidence.outcome, evidence.error_code) == (Outcome.FAILED, "SESSION_REPLACED")
    stats = worker.stats()
    assert stats.lease_losses == 1


def _cancel_running_task(
    server: MockOrbitServer, notifications: bool, **kwargs: Any
) -> tuple[Probe, Any]:
    """Run one handler, request its task's cancel, return the probe and the worker's stats; on
    a ManualClock server, then move time by half a lease (a renewal falls due)."""
    probe = Probe()
    worker = make_worker(server, cancellation_notifications=notifications, **kwargs)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        try:
            ctx.sleep(30)
        finally:
            probe.reasons[ctx.task_id] = ctx.cancel_reason
        return {"ok": True}

    task_id = server.enqueue("work", {})
    with running(worker):
        probe.wait_started()
        server.request_cancel(task_id)
        if isinstance(server.clock, ManualClock):
            server.advance(server.lease_duration / 2)
        snap = server.wait_for(task_id, DONE, timeout=10)
    assert probe.reasons[task_id] == "cancel_requested"
    assert snap.state is TaskState.CANCELLED
    assert (snap.attempts[-1].outcome, snap.attempts[-1].error_code) == (
        Outcome.CANCELLED,
        "CANCELLED",
    )
    assert bool(events(server, "task.cancel_pushed", task_id)) is notifications
    return probe, worker.stats()


def test_cancel_push_stops_handler(server: MockOrbitServer) -> None:
    """A task.cancel push cancels the context at once (no renewal needed on a 30 s lease)."""
    _, stats = _cancel_running_task(server, notifications=True)
    assert stats.cancelled == 1 and stats.renewals == 0 and stats.lease_losses == 0


def test_cancel_seen_on_renewal_stops_handler() -> None:
    """Without notifications, the renewal's cancel_requested_at cancels the context (fake time:
    the server's clock, followed by the worker's, moves to the renewal)."""
    manual = ManualClock()
    with MockOrbitServer(clock=manual, lease_duration=1.0, assignment_rate=None) as server:
        _, stats = _cancel_running_task(server, notifications=False, clock=manual)
        server.check_invariants()
    assert stats.cancelled == 1 and stats.renewals >= 1 and stats.lease_losses == 0


def test_cancel_before_start_finishes_cancelled_without_running(server: MockOrbitServer) -> None:
    """A cancel while LEASED: the start takes effect, the handler never runs, finish CANCELLED."""
    probe = Probe()
    worker = make_worker(server, cancellation_notifications=True, renew_retry_delay=0.2)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        return {"ok": True}

    # Every start is refused until the cancel is stored, so the order is fixed, not raced.
    refused = server.faults.reply_error("task.start", "UNAVAILABLE", count=1_000_000)
    with running(worker):
        task_id = server.enqueue("work", {})
        server.wait_until(lambda _: refused.fired >= 1, timeout=10)
        server.request_cancel(task_id)
        refused.cancel()
        snap = server.wait_for(task_id, DONE, timeout=10)
    assert refused.fired >= 1
    assert snap.state is TaskState.CANCELLED and len(snap.attempts) == 1
    assert (snap.attempts[0].outcome, snap.attempts[0].error_code) == (
        Outcome.CANCELLED,
        "CANCELLED",
    )
    assert snap.result is not None and snap.result["ran"] is False
    assert probe.runs[task_id] == 0
    server.check_invariants()


def test_exceptions_mapped_to_outcomes() -> None:
    """Return, Fail, UnknownEffect, other errors and unsendable results map to their outcomes
    (the retry's backoff passes in fake time)."""
    manual = ManualClock()
    with MockOrbitServer(clock=manual, assignment_rate=None) as server:
        snaps = _run_outcome_handlers(server, manual)
        server.check_invariants()
    _check_outcomes(snaps)


def _run_outcome_handlers(server: MockOrbitServer, clock: ManualClock) -> dict[str, Any]:
    """Run one task per ending through a worker on *clock*; return their final snapshots."""
    worker = make_worker(server, clock=clock)

    @worker.handler("flaky")
    def flaky(ctx: TaskContext, payload: Any) -> Any:
        if ctx.attempt == 1:
            raise Fail("UPSTREAM_BUSY", "try again", retryable=True)
        return {"attempt": ctx.attempt}

    @worker.handler("denied")
    def denied(ctx: TaskContext, payload: Any) -> Any:
        raise Fail("DENIED", "no access", details={"user": 7})

    @worker.handler("unsure")
    def unsure(ctx: TaskContext, payload: Any) -> Any:
        raise UnknownEffect("CHARGE_UNCONFIRMED")

    @worker.handler("broken")
    def broken(ctx: TaskContext, payload: Any) -> Any:
        raise RuntimeError("db password=hunter2 rejected")

    @worker.handler("huge")
    def huge(ctx: TaskContext, payload: Any) -> Any:
        return "x" * (300 * 1024)

    @worker.handler("weird")
    def weird(ctx: TaskContext, payload: Any) -> Any:
        return {"when": object()}

    ids = {
        name: server.enqueue(name, {}, backoff_initial=0.05, backoff_max=0.05)
        for name in ("flaky", "denied", "unsure", "broken", "huge", "weird")
    }
    with running(worker):
        fid = ids.pop("flaky")
        snaps = {name: server.wait_for(tid, DONE, timeout=10) for name, tid in ids.items()}

        def retry_waits(s: MockOrbitServer) -> bool:
            snap = s.task(fid)
            return snap.state is TaskState.WAITING and len(snap.attempts) == 1

        server.wait_until(retry_waits, timeout=10)
        server.advance(2.0)  # the retry's backoff and the server's next scan
        snaps["flaky"] = server.wait_for(fid, DONE, timeout=10)
    return snaps


def _check_outcomes(snaps: dict[str, Any]) -> None:
    """Each ending's task state, outcome, error code and recorded result."""
    flaky_snap = snaps["flaky"]
    assert flaky_snap.state is TaskState.SUCCEEDED and flaky_snap.result == {"attempt": 2}
    first = flaky_snap.attempts[0]
    assert (first.outcome, first.error_code, first.retryable) == (
        Outcome.FAILED,
        "UPSTREAM_BUSY",
        True,
    )

    def last(name: str) -> tuple[Any, ...]:
        att = snaps[name].attempts[-1]
        return snaps[name].state, att.outcome, att.error_code

    assert last("denied") == (TaskState.FAILED, Outcome.FAILED, "DENIED")
    assert snaps["denied"].result == {
        "error": "DENIED",
        "message": "no access",
        "details": {"user": 7},
    }
    assert last("unsure") == (TaskState.NEEDS_REVIEW, Outcome.UNKNOWN, "CHARGE_UNCONFIRMED")
    assert last("broken") == (TaskState.FAILED, Outcome.FAILED, "HANDLER_ERROR")
    assert snaps["broken"].result == {"error": "HANDLER_ERROR", "exception": "RuntimeError"}
    assert last("huge") == (TaskState.FAILED, Outcome.FAILED, "RESULT_TOO_LARGE")
    assert last("weird") == (TaskState.FAILED, Outcome.FAILED, "RESULT_NOT_JSON")
    for name in ("denied", "broken", "huge", "weird"):
        assert len(snaps[name].attempts) == 1, f"{name} is not retryable"


@pytest.mark.orbit_server(lease_duration=5.0, assignment_rate=None)
def test_finish_waits_for_the_connection(server: MockOrbitServer) -> None:
    """A handler that returns while disconnected: its finish waits and is sent after reconnect."""
    probe = Probe()
    worker = make_worker(server)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        probe.release.wait(10)
        return {"ok": True}

    task_id = server.enqueue("work", {})
    with running(worker):
        probe.wait_started()
        refused = server.faults.refuse_connections(count=3)
        server.disconnect()
        probe.release.set()  # returns while the worker cannot get back in
        assert refused.wait(10), "the worker kept trying to reconnect"
        snap = server.wait_for(task_id, DONE, timeout=10)
    assert snap.state is TaskState.SUCCEEDED and snap.result == {"ok": True}
    assert snap.evidence == () and len(snap.attempts) == 1


def test_undeliverable_finish_is_reported_at_shutdown(server: MockOrbitServer) -> None:
    """When no connection comes back, stop() is still bounded and lists the unreported finish."""
    probe = Probe()
    worker = make_worker(server, flush_timeout=0.3)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        probe.release.wait(10)
        return {"ok": True}

    task_id = server.enqueue("work", {})
    worker.start()
    try:
        probe.wait_started()
        server.faults.refuse_connections(count=1_000_000)
        server.disconnect()
        probe.release.set()
        report = worker.stop(timeout=0.2)
    finally:
        worker.stop(drain=False)
    assert [a.task_id for a in report.unreported] == [task_id]
    assert server.task(task_id).state is TaskState.RUNNING


def test_duplicate_assignment_runs_once(
    server: MockOrbitServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The same assignment pushed twice is recognised; the handler runs once, one start sent."""
    probe = Probe()
    worker = make_worker(server)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        return {"ok": True}

    twice = server.faults.duplicate_push("task.assign")
    task_id = server.enqueue("work", {})
    with running(worker):
        snap = server.wait_for(task_id, DONE, timeout=10)
    assert twice.fired == 1
    assert snap.state is TaskState.SUCCEEDED and probe.runs[task_id] == 1
    assert any("assigned twice" in r.getMessage() for r in caplog.records)
    assert not any("start refused" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("capacity", [16, 24])
def test_burst_of_assignments_beyond_eight_keeps_the_connection(
    server: MockOrbitServer, capacity: int
) -> None:
    """With capacity above the 8-slot queue and no rate limit, 64 quick tasks need no reconnect."""
    worker = make_worker(server, capacity=capacity)

    @worker.handler("quick")
    def quick(ctx: TaskContext, payload: Any) -> Any:
        return payload["i"]

    ids = [server.enqueue("quick", {"i": i}) for i in range(64)]
    with running(worker):
        for task_id in ids:
            assert server.wait_for(task_id, DONE, timeout=20).state is TaskState.SUCCEEDED
        assert worker.stats().reconnects == 0
    assert worker.stats().succeeded == 64
