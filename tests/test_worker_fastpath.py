"""The pipelined start/finish path: every failure between a request and its answer falls back
to the blocking path without losing a finish, running a handler twice or stalling shutdown."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from _worker_helpers import Probe, events, has_event, make_worker, running

from orbit_sync.models import TaskState
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import AttemptFinished, TaskContext, Worker, WorkerListener

WAIT = 10.0
DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


@pytest.fixture
def server() -> Any:
    """A mock server without an assignment rate limit, checked for invariants afterwards."""
    with MockOrbitServer(assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


def _counting_worker(server: MockOrbitServer, **kwargs: Any) -> tuple[Worker, Probe]:
    """A capacity-2 worker whose ``count`` handler records each run and echoes ``i``."""
    probe = Probe()
    worker = make_worker(server, capacity=2, **kwargs)

    @worker.handler("count")
    def count(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        return {"i": payload["i"]}

    return worker, probe


def test_start_cut_before_its_answer_runs_the_handler_once(server: MockOrbitServer) -> None:
    """A connection cut after task.start was applied but before its answer: the start is
    re-sent with its message_id on the next connection and the handler runs exactly once."""
    worker, probe = _counting_worker(server)
    with running(worker):
        cut = server.faults.close_after("task.start")
        task_id = server.enqueue("count", {"i": 1})
        snap = server.wait_for(task_id, DONE, timeout=WAIT)
    stats = worker.stats()  # stop() waited for the finish's answer
    assert cut.fired == 1
    assert snap.state is TaskState.SUCCEEDED and snap.result == {"i": 1}
    assert probe.runs[task_id] == 1 and len(snap.attempts) == 1
    # The second start was a replay of the first (same message_id), not a new request.
    replays = events(server, "request.deduplicated", task_id)
    assert [e.detail for e in replays] == ["task.start"]
    assert stats.reconnects >= 1 and stats.succeeded == 1


@pytest.mark.parametrize("request_type", ["task.start", "task.finish"])
def test_transient_error_answer_is_retried_and_lands_once(
    server: MockOrbitServer, request_type: str
) -> None:
    """A start or finish answered UNAVAILABLE is sent again on the same session: the handler
    runs once and its finish is counted once."""
    worker, probe = _counting_worker(server, renew_retry_delay=0.1)
    with running(worker):
        refused = server.faults.reply_error(request_type, "UNAVAILABLE")
        task_id = server.enqueue("count", {"i": 2})
        snap = server.wait_for(task_id, DONE, timeout=WAIT)
    stats = worker.stats()  # stop() waited for the finish's answer
    assert refused.fired == 1
    assert snap.state is TaskState.SUCCEEDED and snap.result == {"i": 2}
    assert probe.runs[task_id] == 1 and len(snap.attempts) == 1
    assert stats.succeeded == 1 and stats.finish_rejected == 0 and stats.reconnects == 0


def test_stop_while_a_finish_is_in_flight_returns_once_it_is_answered(
    server: MockOrbitServer,
) -> None:
    """stop() while a finish's answer is still on its way: on a clock that never moves, only
    the answer can end the drain, and the report counts the finish as delivered."""
    clock = ManualClock(0.0)
    worker, probe = _counting_worker(server, clock=clock, drain_timeout=60.0, flush_timeout=60.0)
    report: list[Any] = []
    with running(worker):
        held = server.faults.delay_reply("task.finish", 0.5)
        task_id = server.enqueue("count", {"i": 3})
        # Applied on the server, its answer held back: the finish is in flight.
        server.wait_for(task_id, DONE, timeout=WAIT)
        assert held.fired == 1 and worker.stats().succeeded == 0
        stopper = threading.Thread(target=lambda: report.append(worker.stop()), daemon=True)
        stopper.start()
        stopper.join(WAIT)
        assert not stopper.is_alive(), "stop() kept waiting after the finish was answered"
    (result,) = report
    assert result.drained and result.unreported == () and result.abandoned == ()
    assert worker.stats().succeeded == 1 and probe.runs[task_id] == 1


def test_finish_cut_before_its_answer_is_delivered_once(server: MockOrbitServer) -> None:
    """A connection cut after task.finish was applied but before its answer: the re-sent
    finish is a replay, and the worker counts the outcome once."""
    worker, probe = _counting_worker(server)
    with running(worker):
        cut = server.faults.close_after("task.finish")
        task_id = server.enqueue("count", {"i": 4})
        server.wait_until(has_event("request.deduplicated", task_id, "task.finish"), WAIT)
        snap = server.wait_for(task_id, DONE, timeout=WAIT)
    stats = worker.stats()  # stop() waited for the finish's answer
    assert cut.fired == 1 and probe.runs[task_id] == 1
    assert snap.state is TaskState.SUCCEEDED and len(snap.attempts) == 1
    assert stats.succeeded == 1 and stats.finish_rejected == 0


def test_more_attempts_than_request_slots_all_finish_once(server: MockOrbitServer) -> None:
    """max_in_flight=3 leaves the handlers one request slot: four attempts at once wait for
    it in turn, and every task still runs once and succeeds."""
    probe = Probe()
    together = threading.Barrier(4, timeout=WAIT)

    def handler(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        together.wait()  # all four started, so their finishes compete for the slot
        return {"i": payload["i"]}

    worker = make_worker(server, capacity=4, max_in_flight=3)
    worker.register("slot", handler)
    worker.register("alone", lambda ctx, payload: {"i": payload["i"]})
    with running(worker):
        ids = [server.enqueue("slot", {"i": i}) for i in range(4)]
        snaps = [server.wait_for(task_id, DONE, timeout=WAIT) for task_id in ids]
        # Every slot taken was given back: with the one slot lost, this start would wait for ever.
        alone = server.enqueue("alone", {"i": 4})
        snaps.append(server.wait_for(alone, DONE, timeout=WAIT))
    assert worker.stats().succeeded == 5  # stop() waited for the finishes' answers
    assert [s.state for s in snaps] == [TaskState.SUCCEEDED] * 5
    assert all(probe.runs[task_id] == 1 for task_id in ids)


def test_attempt_finished_runs_off_the_reader_thread_after_delivery(
    server: MockOrbitServer,
) -> None:
    """attempt_finished (user code) runs on a handler thread, never the connection's reader,
    and only once the server accepted the finish."""
    seen: list[tuple[str, AttemptFinished]] = []
    finished = threading.Event()

    class Recorder(WorkerListener):
        def attempt_finished(self, event: AttemptFinished) -> None:
            seen.append((threading.current_thread().name, event))
            finished.set()

    worker, probe = _counting_worker(server, listeners=[Recorder()])
    with running(worker):
        task_id = server.enqueue("count", {"i": 5})
        assert finished.wait(WAIT)
        snap = server.wait_for(task_id, DONE, timeout=WAIT)
    ((thread, event),) = seen
    assert thread.startswith("orbit-handler"), thread
    assert event.delivered and event.ran and event.task_id == task_id
    assert snap.state is TaskState.SUCCEEDED and probe.runs[task_id] == 1
