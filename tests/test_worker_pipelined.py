"""The Worker's pipelined requests against the mock server: renewals and resumes never queue."""

from __future__ import annotations

from typing import Any

import pytest
from _worker_helpers import Probe, events, make_worker, running

from orbit_sync.models import TaskState
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import TaskContext

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


def _blocked(worker: Any, probe: Probe) -> None:
    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        probe.release.wait(10.0)
        return {"ok": True}


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Any:
    """A mock server with short leases and no assignment rate limit."""
    with MockOrbitServer(assignment_rate=None, lease_duration=2.0) as srv:
        yield srv
        srv.check_invariants()


def test_a_held_renewal_does_not_delay_another_attempts_renewal() -> None:
    """With one renewal's answer lost, the other attempt is renewed on the same connection
    (fake time: the server's clock, followed by the worker's, moves to the renewals)."""
    manual = ManualClock()
    with MockOrbitServer(clock=manual, assignment_rate=None, lease_duration=2.0) as server:
        probe = Probe()
        worker = make_worker(server, capacity=2, clock=manual)
        _blocked(worker, probe)
        lost = server.faults.drop_reply("task.renew")
        tasks = [server.enqueue("work", {}) for _ in range(2)]
        with running(worker):
            probe.wait_started(2)
            server.advance(server.lease_duration / 2)  # both renewals fall due
            assert lost.wait(10.0)
            server.wait_until(
                lambda s: all(events(s, "attempt.renewed", t) for t in tasks), timeout=10
            )
            # The lost answer times its connection out only later; the other renewal did not
            # wait.
            assert worker.stats().reconnects == 0
            probe.release.set()
            for task_id in tasks:
                assert server.wait_for(task_id, DONE, timeout=10).state is TaskState.SUCCEEDED
        server.check_invariants()
    assert all(probe.runs[t] == 1 for t in tasks)


def test_resumes_are_all_in_flight_before_the_capacity_report(server: MockOrbitServer) -> None:
    """After a cut, every live attempt is resumed at once, then capacity is reported."""
    probe = Probe()
    worker = make_worker(server, capacity=3, call_timeout=1.0)
    _blocked(worker, probe)
    tasks = [server.enqueue("work", {}) for _ in range(3)]
    with running(worker):
        probe.wait_started(3)
        lost = server.faults.drop_reply("worker.resume")
        assert server.disconnect() == 1
        assert lost.wait(10.0)
        # Sent one at a time, the second resume would wait for the lost answer's timeout and
        # go out on another connection; pipelined, all three reach the first new session.
        server.wait_until(lambda s: bool(events(s, "attempt.resumed")), timeout=10)
        session = events(server, "attempt.resumed")[0].session_id
        server.wait_until(
            lambda s: (
                len([e for e in events(s, "attempt.resumed") if e.session_id == session]) == 3
            ),
            timeout=10,
        )
        # The capacity report of every session comes after all of that session's resumes.
        probe.release.set()
        for task_id in tasks:
            assert server.wait_for(task_id, DONE, timeout=10).state is TaskState.SUCCEEDED
    log = server.events()
    reported = [e for e in log if e.kind == "session.capacity"]
    assert len(reported) >= 2, "the worker reported capacity again after the cut"
    for report in reported[1:]:
        before = log[: log.index(report)]
        resumed = [e for e in before if e.kind == "attempt.resumed"]
        assert len([e for e in resumed if e.session_id == report.session_id]) == 3
    assert all(probe.runs[t] == 1 for t in tasks)


def _sessions_resuming(server: MockOrbitServer) -> list[str]:
    """The sessions that resumed attempts, in order."""
    return list(dict.fromkeys(e.session_id for e in events(server, "attempt.resumed")))


def test_reconnect_resumes_within_the_gates_slots() -> None:
    """Resumes take the attempts' request slots: past them a resume waits for an answer, and
    the capacity report follows the last resume."""
    # Leases long enough to outlast a session ended by a call timeout.
    with MockOrbitServer(assignment_rate=None, lease_duration=10.0) as server:
        _resume_window(server)
        server.check_invariants()


def _resume_window(server: MockOrbitServer) -> None:
    probe = Probe()
    # max_in_flight=4 leaves the attempts two request slots.
    worker = make_worker(server, capacity=3, max_in_flight=4, call_timeout=1.0)
    _blocked(worker, probe)
    tasks = [server.enqueue("work", {}) for _ in range(3)]

    def reported_after_resumes(s: MockOrbitServer) -> bool:
        sessions = _sessions_resuming(s)
        return len(sessions) >= 2 and bool(
            [e for e in events(s, "session.capacity") if e.session_id == sessions[1]]
        )

    with running(worker):
        probe.wait_started(3)
        lost = server.faults.drop_reply("worker.resume", count=2)
        assert server.disconnect() == 1
        assert lost.wait(10.0)
        # Both slots hold a resume whose answer never comes: the third waits for a slot, so
        # that session ends on their call timeout with two resumes and no report; the next
        # session resumes all three, then reports.
        server.wait_until(reported_after_resumes, timeout=10)
        probe.release.set()
        for task_id in tasks:
            assert server.wait_for(task_id, DONE, timeout=10).state is TaskState.SUCCEEDED
    log = server.events()
    cut, again = _sessions_resuming(server)[:2]
    assert len([e for e in log if e.kind == "attempt.resumed" and e.session_id == cut]) == 2
    assert not [e for e in log if e.kind == "session.capacity" and e.session_id == cut]
    in_again = [e for e in log if e.session_id == again]
    report = next(e for e in in_again if e.kind == "session.capacity")
    before = in_again[: in_again.index(report)]
    assert len([e for e in before if e.kind == "attempt.resumed"]) == 3
    assert all(probe.runs[t] == 1 for t in tasks)


@pytest.mark.parametrize(
    ("max_in_flight", "slots"), [(None, 24), (32, 24), (12, 9), (4, 2), (3, 1)]
)
def test_handler_share_of_the_request_budget(
    server: MockOrbitServer, max_in_flight: int | None, slots: int
) -> None:
    """Starts and finishes get all but a quarter (2 to 8) of max_in_flight; default 32. (That
    the worker's requests keep within this share: test_reconnect_resumes_within_the_gates_slots,
    and test_worker_fastpath's test_more_attempts_than_request_slots_all_finish_once.)"""
    kwargs = {} if max_in_flight is None else {"max_in_flight": max_in_flight}
    assert make_worker(server, **kwargs).options.handler_slots == slots
