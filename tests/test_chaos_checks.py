"""The chaos run's checks that a correct worker never trips, fed what a broken one would do: a
handler run twice for one attempt, and a completed handler whose result the server does not
hold. The task snapshots are a real mock server's, after a real Worker ran the task."""

from __future__ import annotations

from typing import Any

from _worker_helpers import make_worker, running

from orbit_sync import TaskContext
from orbit_sync.testing import MockOrbitServer
from orbit_sync.testing._chaos_check import Invocation, check

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


def _one_task_run() -> tuple[str, Any, float]:
    """A task run to SUCCEEDED by a real Worker: its id, its snapshot, the wall time before."""
    with MockOrbitServer() as server:
        worker = make_worker(server)

        @worker.handler("work")
        def work(ctx: TaskContext, payload: Any) -> Any:
            return {"n": 1}

        with running(worker):
            task_id = server.enqueue("work", {})
            snap = server.wait_for(task_id, DONE, timeout=10)
        assert snap.state.value == "SUCCEEDED"
        return task_id, snap, snap.created_at.timestamp() - 1.0


def _call(snap: Any, **kw: Any) -> Invocation:
    attempt = snap.attempts[0]
    fields: dict[str, Any] = {
        "task_id": snap.task_id,
        "attempt_id": attempt.attempt_id,
        "attempt": attempt.number,
        "started": 0.1,
        "ended": 0.2,
        "returned": True,
        "value": {"n": 1},
    }
    fields.update(kw)
    return Invocation(**fields)


def test_a_correct_runs_record_breaks_nothing() -> None:
    """The handler's one call, with the result the server stored: no violation."""
    task_id, snap, t0 = _one_task_run()
    out, dupes = check([task_id], {task_id: snap}, [_call(snap)], [], [], started_wall=t0, end=1)
    assert out == [] and dupes == []


def test_an_attempt_whose_handler_ran_twice_is_reported() -> None:
    """Two calls of one attempt's handler: "ran twice", naming the task and the attempt."""
    task_id, snap, t0 = _one_task_run()
    calls = [_call(snap), _call(snap, started=0.3, ended=0.4)]
    out, _ = check([task_id], {task_id: snap}, calls, [], [], started_wall=t0, end=1)
    [twice] = [v for v in out if v.kind == "ran twice"]
    assert twice.task_id == task_id and twice.attempt_id == snap.attempts[0].attempt_id
    assert "ran 2 times" in str(twice)


def test_a_completed_handler_whose_result_the_server_lacks_is_reported() -> None:
    """A call that returned another result than the one stored, and a raise on an attempt the
    server holds as succeeded, are "result missing"; a call still running at the end is not."""
    task_id, snap, t0 = _one_task_run()
    calls = [_call(snap, value={"n": 2})]
    out, _ = check([task_id], {task_id: snap}, calls, [], [], started_wall=t0, end=1)
    [missing] = [v for v in out if v.kind == "result missing"]
    assert missing.attempt_id == snap.attempts[0].attempt_id and "its result" in str(missing)
    running_still = [_call(snap, ended=None, returned=False, value=None)]
    out, _ = check([task_id], {task_id: snap}, running_still, [], [], started_wall=t0, end=1)
    assert [v for v in out if v.kind == "result missing"] == []
