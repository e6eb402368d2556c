"""Guarantees stated in docs/reliability.md that no other test file covers: what a ``kill -9``
mid-handler leaves behind and how the server recovers it, and final counters after ``stop()``."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from _cli_process import Proc

from orbit_sync.models import AttemptState, TaskState
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import Worker

HELPER = Path(__file__).with_name("_worker_helpers.py")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.orbit_server(manual_clock=True, assignment_rate=None)
def test_sigkill_mid_handler_is_recovered_under_both_retry_policies(
    orbit_server: MockOrbitServer, orbit_worker: Any, tmp_path: Path
) -> None:
    """A worker process killed with SIGKILL while two handlers run reports nothing; once the
    leases expire the server marks both attempts UNKNOWN: the IDEMPOTENT task is retried and
    completed by a second worker, the RECONCILE_ONLY task waits in NEEDS_REVIEW."""
    retried = orbit_server.enqueue("slow", {}, retry_safety="IDEMPOTENT", backoff_initial=1.0)
    review = orbit_server.enqueue("slow", {}, retry_safety="RECONCILE_ONLY", backoff_initial=1.0)
    argv = [
        sys.executable,
        str(HELPER),
        orbit_server.url,
        orbit_server.token,
        orbit_server.queue_id,
        str(tmp_path / "never"),
        "announce",
    ]
    proc = Proc(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # Both handlers are running in the child (capacity 2) when it is killed.
        running = {proc.line().split()[1], proc.line().split()[1]}
        assert running == {retried, review}
        assert proc.stop(signal.SIGKILL) == -signal.SIGKILL
    finally:
        proc.kill()
    assert orbit_server.token not in proc.stdout + proc.stderr
    # The server must see the dead socket before time moves: a session it still thinks
    # connected would be handed the retry at once (LEASED, not WAITING).
    orbit_server.wait_until(
        lambda s: any(e.kind == "session.disconnected" for e in s.events()), timeout=10
    )
    # Nothing was reported: the server still believes both attempts run.
    for task_id in (retried, review):
        assert orbit_server.task(task_id).state is TaskState.RUNNING
    # Server time passes the leases, the next recovery scan and the 1 s backoff.
    orbit_server.advance(orbit_server.lease_duration + 2.0 + 1.0)
    lost = orbit_server.task(retried)
    assert lost.state is TaskState.WAITING and lost.effect_uncertain
    assert [a.state for a in lost.attempts] == [AttemptState.UNKNOWN]
    held = orbit_server.task(review)
    assert held.state is TaskState.NEEDS_REVIEW
    assert [a.state for a in held.attempts] == [AttemptState.UNKNOWN]

    second: Worker = orbit_worker(capacity=2)
    second.register("slow", lambda ctx, payload: {"pid": os.getpid()})
    second.start()
    done = orbit_server.wait_for(retried, {"SUCCEEDED", "FAILED", "NEEDS_REVIEW"}, timeout=10)
    assert done.state is TaskState.SUCCEEDED and done.result == {"pid": os.getpid()}
    assert [a.state for a in done.attempts] == [AttemptState.UNKNOWN, AttemptState.SUCCEEDED]
    assert done.effect_uncertain  # the history still says attempt 1 may have had an effect
    # The RECONCILE_ONLY task is never retried: it waits for a person.
    assert len(orbit_server.task(review).attempts) == 1
    assert orbit_server.task(review).state is TaskState.NEEDS_REVIEW
    orbit_server.check_invariants()


@pytest.mark.orbit_server(assignment_rate=None)
def test_counters_are_final_once_stop_returns(
    orbit_server: MockOrbitServer, orbit_worker: Any
) -> None:
    """After wait_for sees the stored outcomes, stop() returns only once every finish has been
    answered, so stats() counts all of them (the documented way to assert on counters)."""
    worker: Worker = orbit_worker(capacity=4)
    worker.register("ok", lambda ctx, payload: {"n": payload["n"]})
    worker.start()
    tasks = [orbit_server.enqueue("ok", {"n": n}) for n in range(6)]
    for task_id in tasks:
        assert orbit_server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).result is not None
    report = worker.stop()
    assert not report.unreported
    stats = worker.stats()
    assert (stats.succeeded, stats.failed, stats.running) == (6, 0, 0)
