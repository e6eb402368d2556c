"""OrbitState at scale: bulk enqueue, dispatch order, exact timers, bounded state."""

from __future__ import annotations

import pytest
from _serverkit import Kit

from orbit_sync.models import TaskState


def test_enqueue_many_creates_in_order_and_dispatches_once() -> None:
    """enqueue_many stores every task in order and assigns the oldest first."""
    kit = Kit()
    proc = kit.worker(capacity=2).open()
    ids, actions = kit.state.enqueue_many(
        [{"handler": "resize", "payload": {"n": i}} for i in range(5)]
    )
    kit.route(actions)
    assert len(ids) == 5 and len(set(ids)) == 5
    assert [t.task_id for t in kit.state.task_snapshots()] == ids
    assert [b["task"]["task_id"] for b in proc.assignments()] == ids[:2]


def test_enqueue_many_is_all_or_nothing() -> None:
    """A bad spec raises naming its index and creates none of the tasks."""
    kit = Kit()
    good = {"handler": "resize", "payload": {"n": 1}}
    with pytest.raises(ValueError, match="spec 1"):
        kit.state.enqueue_many([good, {"handler": "resize", "payload": None}])
    with pytest.raises(TypeError, match="spec 1 has unknown keys: colour"):
        kit.state.enqueue_many([good, {**good, "colour": "red"}])
    with pytest.raises(ValueError, match="spec 0 lacks 'payload'"):
        kit.state.enqueue_many([{"handler": "resize"}])
    with pytest.raises(TypeError):
        kit.state.enqueue_many(good)  # type: ignore[arg-type]
    assert kit.state.task_snapshots() == ()
    ids, _ = kit.state.enqueue_many([{**good, "max_attempts": 2, "backoff_initial": 0.5}])
    snap = kit.state.task_snapshot(ids[0])
    assert snap.state is TaskState.WAITING and snap.policy.max_attempts == 2
