"""WorkerConnection against the mock Orbit server: the happy path and a lost-finish reconnect."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orbit_sync.client import Client
from orbit_sync.errors import CallTimeout, WorkerError
from orbit_sync.models import (
    AttemptState,
    Capability,
    CapacityReport,
    Disposition,
    Finish,
    Outcome,
    Registration,
    TaskState,
    new_message_id,
)
from orbit_sync.testing import MockOrbitServer

WAIT = 10.0


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server that assigns without rate limiting."""
    with MockOrbitServer(lease_duration=30.0, assignment_rate=None) as srv:
        yield srv


def _registration(server: MockOrbitServer, **extra: object) -> Registration:
    return Registration(
        queue_id=server.queue_id,
        capabilities=[Capability("resize", "1", "1")],
        capacity=2,
        **extra,  # type: ignore[arg-type]
    )


def test_happy_path(server: MockOrbitServer) -> None:
    """capacity → assignment → start (may run) → renew → finish: the task SUCCEEDS."""
    task_id = server.enqueue("resize", {"w": 10}, handler_version="1", payload_version="1")
    client = Client(server.url, server.token)
    with client.dial_worker(_registration(server)) as conn:
        welcome = conn.capacity(CapacityReport(sequence=1, capacity=2))
        assert welcome.session_id == conn.session_id
        assignment = conn.next_assignment(timeout=WAIT)
        assert assignment.task.task_id == task_id
        assert assignment.task.payload == {"w": 10}
        started = conn.start(assignment.attempt)
        assert started.lease.may_run()
        assert 0 < started.lease.remaining() <= 30 - 0.25
        renewed = conn.renew(assignment.attempt)
        assert renewed.lease.may_run()
        finished = conn.finish(Finish(assignment.attempt, Outcome.SUCCEEDED, {"resized": True}))
        assert finished.receipt.disposition is Disposition.APPLIED
        assert finished.receipt.task_state is TaskState.SUCCEEDED
        assert not finished.lease.may_run()
    snap = server.wait_for(task_id, {"SUCCEEDED"}, timeout=WAIT)
    assert snap.result == {"resized": True}


def test_lost_finish_is_reconciled_on_a_new_connection(server: MockOrbitServer) -> None:
    """A finish whose answer is lost times out; after a reconnect and resume, the same finish with
    the same message_id is answered as deduplicated and the task is finished exactly once."""
    task_id = server.enqueue("resize", {"w": 1})
    client = Client(server.url, server.token)
    registration = _registration(server)
    finish_id = new_message_id()

    first = client.dial_worker(registration)
    try:
        first.capacity(CapacityReport(sequence=1, capacity=2))
        assignment = first.next_assignment(timeout=WAIT)
        assert first.start(assignment.attempt).lease.may_run()
        finish = Finish(assignment.attempt, Outcome.SUCCEEDED, {"done": 1})
        fault = server.faults.drop_reply("task.finish")
        with pytest.raises(CallTimeout) as caught:
            first.finish(finish, message_id=finish_id, timeout=0.5)
        assert caught.value.message_id == finish_id
        assert fault.wait(WAIT)
        assert first.done.wait(WAIT)
    finally:
        first.close()

    with client.dial_worker(registration) as second:
        assert second.welcome.epoch > first.welcome.epoch
        lease = second.resume(assignment.attempt)
        assert lease.state is AttemptState.SUCCEEDED and not lease.may_run()
        again = second.finish(finish, message_id=caught.value.message_id)
        assert again.deduplicated is True
        assert again.receipt.operation.value == "finish"
        assert again.receipt.task_state is TaskState.SUCCEEDED
        second.capacity(CapacityReport(sequence=1, capacity=2))
    snap = server.task(task_id)
    assert snap.state is TaskState.SUCCEEDED
    assert len(snap.attempts) == 1
    assert snap.result == {"done": 1}
    assert snap.evidence == ()  # the re-sent finish was deduplicated, not stored again


def test_stale_session_is_fatal_on_the_old_connection(server: MockOrbitServer) -> None:
    """A reconnect makes the older session stale: its next request gets STALE_SESSION, fatally."""
    client = Client(server.url, server.token)
    registration = _registration(server)
    old = client.dial_worker(registration)
    try:
        new = client.dial_worker(registration)
        try:
            with pytest.raises(WorkerError) as caught:
                old.capacity(CapacityReport(sequence=1, capacity=1))
            assert caught.value.code == "STALE_SESSION"
            assert old.done.wait(WAIT)
            assert isinstance(old.err, WorkerError) and old.err.fatal
            assert new.err is None
        finally:
            new.close()
    finally:
        old.close()


def test_cancel_push_from_the_mock_server(server: MockOrbitServer) -> None:
    """A cancel request on a running attempt reaches next_cancel; renew then shows it."""
    task_id = server.enqueue("resize", {"w": 2})
    client = Client(server.url, server.token)
    with client.dial_worker(_registration(server, cancellation_notifications=True)) as conn:
        conn.capacity(CapacityReport(sequence=1, capacity=1))
        assignment = conn.next_assignment(timeout=WAIT)
        assert conn.start(assignment.attempt).lease.may_run()
        server.request_cancel(task_id)
        notice = conn.next_cancel(timeout=WAIT)
        assert notice.attempt_id == assignment.attempt_id
        renewed = conn.renew(assignment.attempt)
        assert renewed.lease.cancel_requested and not renewed.lease.may_run()
        done = conn.finish(
            Finish(assignment.attempt, Outcome.CANCELLED, {"stopped": True}, error_code="CANCELLED")
        )
        assert done.receipt.task_state is TaskState.CANCELLED
