"""The process executor: handlers in child processes, against the real mock server over loopback."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _process_handlers as handlers
import pytest
from _worker_helpers import make_worker, running

from orbit_sync.models import Outcome, TaskState
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import TaskContext, Worker, result_converter

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


@pytest.fixture
def server() -> Any:
    """A mock server without an assignment rate limit."""
    with MockOrbitServer(assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


def _register(worker: Worker, *names: str) -> None:
    for name in names:
        worker.register(name, getattr(handlers, name), executor="process")


def _last(server: MockOrbitServer, task_id: str) -> tuple[Any, ...]:
    snap = server.wait_for(task_id, DONE, timeout=15)
    att = snap.attempts[-1]
    return snap.state, att.outcome, att.error_code


def _children() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("orbit-child-")]


def test_handler_runs_in_a_child_with_its_context_and_logs(
    server: MockOrbitServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child runs the handler, sees its deadline, not the token nor where it is kept; results
    encode; logs arrive."""
    monkeypatch.setenv("ORBIT_TOKEN", server.token)
    monkeypatch.setenv("ORBIT_TOKEN_FILE", "/run/secrets/orbit-token")
    caplog.set_level(logging.INFO)
    worker = make_worker(server, process_pool=1)
    _register(worker, "facts")
    before = set(multiprocessing.active_children())
    with running(worker):
        assert set(multiprocessing.active_children()) == before  # lazy: none before a task
        task_id = server.enqueue("facts", {"n": 5})
        snap = server.wait_for(task_id, DONE, timeout=15)
    assert snap.state is TaskState.SUCCEEDED
    result = snap.result
    assert result is not None
    assert result["pid"] != os.getpid()
    assert result["token_in_env"] is False and result["token_file_in_env"] is False
    assert 0 < result["remaining"] <= 30
    assert (result["attempt"], result["payload"]) == (1, 5)
    # The parent's result converter applies, as on a thread.
    assert result["at"] == result_converter().unstructure(handlers.AT)
    lines = {(r.name, r.getMessage()) for r in caplog.records}
    assert (
        "orbit_sync.task.facts",
        f"[task={task_id} attempt={snap.attempts[0].attempt_id}] hello from pid {result['pid']}",
    ) in lines
    assert ("user.lib", "library line from the child") in lines
    assert server.token not in caplog.text
    assert not _children(), "stop() leaves no child process behind"


def test_outcomes_map_as_on_threads(server: MockOrbitServer) -> None:
    """Fail, UnknownEffect, other exceptions and unpicklable results end as on a thread."""
    worker = make_worker(server, process_pool=2)
    _register(worker, "fail", "unsure", "broken", "unpicklable")
    with running(worker):
        ids = {
            name: server.enqueue(name, {}) for name in ("fail", "unsure", "broken", "unpicklable")
        }
        last = {name: _last(server, tid) for name, tid in ids.items()}
        snaps = {name: server.task(tid) for name, tid in ids.items()}
    assert last["fail"] == (TaskState.FAILED, Outcome.FAILED, "DENIED")
    assert snaps["fail"].result == {
        "error": "DENIED",
        "message": "no access",
        "details": {"user": 7},
    }
    assert last["unsure"] == (TaskState.NEEDS_REVIEW, Outcome.UNKNOWN, "CHARGE_UNCONFIRMED")
    assert last["broken"] == (TaskState.FAILED, Outcome.FAILED, "HANDLER_ERROR")
    # Only the type travels, named as the child raised it; never its message.
    assert snaps["broken"].result == {
        "error": "HANDLER_ERROR",
        "exception": "_process_handlers.QuotaError",
    }
    assert last["unpicklable"] == (TaskState.FAILED, Outcome.FAILED, "RESULT_NOT_JSON")


class _Started(logging.Handler):
    """Sets an event when a child's start announcement reaches the parent's logging."""

    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.event.set()


@pytest.fixture
def started() -> Iterator[threading.Event]:
    """An event set once a process handler announced its start (forwarded from its child)."""
    logger = logging.getLogger(handlers.STARTED_LOGGER)
    handler = _Started()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.event
    finally:
        logger.removeHandler(handler)


def _wait_started(started: threading.Event) -> None:
    assert started.wait(15), "the handler never started in its child"


def test_cancel_request_reaches_the_child(
    server: MockOrbitServer, tmp_path: Path, started: threading.Event
) -> None:
    """A server cancel stops a cooperative child handler: CANCELLED, and the child is reused."""
    worker = make_worker(server, process_pool=1)
    _register(worker, "cooperative", "pid")
    with running(worker):
        task_id = server.enqueue("cooperative", {"dir": str(tmp_path)})
        _wait_started(started)
        server.request_cancel(task_id)
        assert _last(server, task_id) == (TaskState.CANCELLED, Outcome.CANCELLED, "CANCELLED")
        started = tmp_path.iterdir().__next__().name.split("-")[1]
        again = server.enqueue("pid", {})
        assert server.wait_for(again, DONE, timeout=15).result == {"pid": int(started)}


def test_child_ignoring_cancel_is_terminated_and_replaced(
    server: MockOrbitServer, tmp_path: Path, started: threading.Event
) -> None:
    """Past cancel_grace a stubborn child is killed (UNKNOWN HANDLER_TERMINATED) and replaced."""
    worker = make_worker(server, process_pool=1, cancel_grace=0.3)
    _register(worker, "stubborn", "pid")
    with running(worker):
        task_id = server.enqueue("stubborn", {"dir": str(tmp_path)})
        _wait_started(started)
        server.request_cancel(task_id)
        state, outcome, code = _last(server, task_id)
        assert (outcome, code) == (Outcome.UNKNOWN, "HANDLER_TERMINATED")
        assert state in {TaskState.CANCELLED, TaskState.NEEDS_REVIEW}
        first = int(tmp_path.iterdir().__next__().name.split("-")[1])
        again = server.enqueue("pid", {})
        result = server.wait_for(again, DONE, timeout=15).result
    assert result is not None and result["pid"] != first


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_dead_child_is_finished_unknown_at_once(
    server: MockOrbitServer, tmp_path: Path, how: str
) -> None:
    """A child that dies mid-handler ends UNKNOWN HANDLER_PROCESS_DIED long before lease expiry."""
    worker = make_worker(server, process_pool=1)
    _register(worker, "dies", "pid")
    with running(worker):
        # The 30 s lease is never waited out: wait_for gives up after 15 s.
        task_id = server.enqueue("dies", {"dir": str(tmp_path), "signal": how == "sigkill"})
        assert _last(server, task_id) == (
            TaskState.NEEDS_REVIEW,
            Outcome.UNKNOWN,
            "HANDLER_PROCESS_DIED",
        )
        again = server.enqueue("pid", {})
        assert server.wait_for(again, DONE, timeout=15).state is TaskState.SUCCEEDED


def _pid_started(directory: Path) -> int:
    return int(next(directory.iterdir()).name.split("-")[1])


def test_time_limit_kills_a_child_blocked_in_c_and_fails_handler_timeout(
    server: MockOrbitServer, tmp_path: Path, started: threading.Event
) -> None:
    """A handler in time.sleep(3600) cannot be interrupted: past its limit and the cancel grace
    its child is killed, the attempt finishes FAILED HANDLER_TIMEOUT (nothing runs on), and the
    next attempt gets a new child. The limit and the grace run on the worker's clock, moved only
    once the handler runs (a child starting on a slow host could use a real 0.5 s up first)."""
    clock = ManualClock()
    worker = make_worker(server, process_pool=1, cancel_grace=0.5, clock=clock)
    worker.register("sleeper", handlers.sleeper, executor="process", time_limit=0.5)
    _register(worker, "pid")
    with running(worker):
        task_id = server.enqueue("sleeper", {"dir": str(tmp_path)}, max_attempts=1)
        _wait_started(started)
        clock.advance(1.0)  # the limit, then the grace the blocked handler cannot use
        assert _last(server, task_id) == (TaskState.FAILED, Outcome.FAILED, "HANDLER_TIMEOUT")
        again = server.enqueue("pid", {})
        result = server.wait_for(again, DONE, timeout=15).result
        assert worker.stats().stuck == 0
    assert result is not None and result["pid"] != _pid_started(tmp_path)


def test_time_limit_interrupts_a_child_looping_in_python_and_keeps_it(
    server: MockOrbitServer, tmp_path: Path, started: threading.Event
) -> None:
    """A handler looping in Python in its child is interrupted there at its limit, well within
    a grace it never needs: FAILED HANDLER_TIMEOUT (retryable as asked), and the same child runs
    the next attempt (it was not killed). The limit runs on the worker's clock, moved only once
    the handler runs: a child slow to start cannot use the limit up before the loop begins."""
    clock = ManualClock()
    worker = make_worker(server, process_pool=1, cancel_grace=30.0, clock=clock)
    worker.register(
        "spinner",
        handlers.spinner,
        executor="process",
        time_limit=0.5,
        time_limit_retryable=True,
    )
    _register(worker, "pid")
    with running(worker):
        task_id = server.enqueue("spinner", {"dir": str(tmp_path)}, max_attempts=1)
        _wait_started(started)
        clock.advance(0.5)  # the limit, never the 30 s grace
        snap = server.wait_for(task_id, DONE, timeout=15)
        att = snap.attempts[-1]
        assert (att.outcome, att.error_code, att.retryable) == (
            Outcome.FAILED,
            "HANDLER_TIMEOUT",
            True,
        )
        again = server.enqueue("pid", {})
        assert server.wait_for(again, DONE, timeout=15).result == {"pid": _pid_started(tmp_path)}


def test_time_limit_passed_while_the_child_starts_is_not_lost(server: MockOrbitServer) -> None:
    """A limit that passes while the child still loads the handler's (slow) module: the
    cancellation that reaches the child before the handler runs is kept for it, so the attempt
    ends FAILED HANDLER_TIMEOUT at once instead of running unbounded until the grace (30 s)
    kills the child."""
    import _slow_import_handlers

    worker = make_worker(server, process_pool=1, cancel_grace=30.0)
    worker.register("spin", _slow_import_handlers.spin, executor="process", time_limit=0.1)
    with running(worker):
        task_id = server.enqueue("spin", {}, max_attempts=1)
        assert _last(server, task_id) == (TaskState.FAILED, Outcome.FAILED, "HANDLER_TIMEOUT")


def test_registration_mistakes_raise_at_once(server: MockOrbitServer) -> None:
    """Handlers a child cannot import, unknown executors and bad pool sizes raise at once."""
    worker = make_worker(server)

    def nested(ctx: TaskContext, payload: Any) -> Any:
        return {}

    with pytest.raises(TypeError, match="module-level function"):
        worker.register("nested", nested, executor="process")
    with pytest.raises(TypeError, match="module-level function"):
        worker.register("lam", lambda ctx, payload: {}, executor="process")
    with pytest.raises(ValueError, match="executor"):
        worker.register("pid", handlers.pid, executor="fork")
    with pytest.raises(ValueError, match="process_pool"):
        make_worker(server, process_pool=0)
    assert worker._registered.processes is None
