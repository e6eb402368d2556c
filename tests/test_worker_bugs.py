"""A bug of the worker's own fails loudly: it is logged with its traceback, an attempt it hits is
finished UNKNOWN (never dropped), and a session loop that keeps hitting it stops the worker."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from _worker_helpers import make_worker, running

from orbit_sync.client import Client
from orbit_sync.connection import WorkerConnection
from orbit_sync.models import Outcome, TaskState
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import Backoff, Worker


@pytest.fixture
def server() -> Any:
    """A mock server that assigns at once."""
    with MockOrbitServer(assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


def test_a_bug_while_running_an_attempt_finishes_it_unknown(
    server: MockOrbitServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected error in the worker around a handler finishes the attempt UNKNOWN at once
    (WORKER_ERROR), logged with its traceback, instead of leaving it to its lease's expiry."""
    worker = make_worker(server)
    worker.register("noop", lambda ctx, payload: None)

    def broken(att: Any) -> Any:
        raise RuntimeError("worker bug")

    monkeypatch.setattr(worker._shell, "execute", broken)
    with caplog.at_level(logging.ERROR, logger="orbit_sync"), running(worker):
        task_id = server.enqueue("noop", {})
        task = server.wait_for(task_id, {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}, 10)
    assert task.state is TaskState.NEEDS_REVIEW
    attempt = server.task(task_id).attempts[-1]
    assert (attempt.outcome, attempt.error_code) == (Outcome.UNKNOWN, "WORKER_ERROR")
    logged = [r for r in caplog.records if "finishing UNKNOWN" in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert str(logged[0].exc_info[1]) == "worker bug"


class _CountingDialer:
    """Dials for real and counts the dials."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.dials = 0

    def dial_worker(self, registration: Any, timeout: float = 8.0, **kwargs: Any) -> Any:
        """Count the dial and dial."""
        self.dials += 1
        return self.client.dial_worker(registration, timeout, **kwargs)


def test_a_session_bug_that_repeats_stops_the_worker(
    server: MockOrbitServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in the session loop is logged with its traceback and retried once; when it happens
    again the worker stops and run() raises it (the CLI exits 1) instead of looping."""
    send_many = WorkerConnection.send_many

    def buggy(self: WorkerConnection, calls: Any, **kw: Any) -> Any:
        # Every capacity report of every session hits a bug of ours (a plain RuntimeError).
        if any(c.request_type == "worker.capacity" for c in calls):
            raise RuntimeError("session bug")
        return send_many(self, calls, **kw)

    monkeypatch.setattr(WorkerConnection, "send_many", buggy)
    dialer = _CountingDialer(Client(server.url, server.token))
    worker = Worker(
        dialer,
        queue_id=server.queue_id,
        handle_signals=False,
        reconnect_backoff=Backoff(initial=0.01, maximum=0.02),
    )
    worker.register("noop", lambda ctx, payload: None)
    with (
        caplog.at_level(logging.ERROR, logger="orbit_sync.worker"),
        pytest.raises(RuntimeError, match="session bug"),
    ):
        worker.run()
    assert dialer.dials == 2
    logged = [r for r in caplog.records if "session loop" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info is not None for r in logged)
    assert "stopping" in logged[-1].getMessage()
