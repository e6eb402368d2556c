"""Worker listeners and middleware: every event reaches every subscriber; failures stay local."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
from _worker_helpers import make_worker, running

from orbit_sync.connection import on_reader_thread
from orbit_sync.models import Outcome, TaskState
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import (
    AttemptEvent,
    AttemptFinished,
    DisconnectEvent,
    DrainEvent,
    Fail,
    LeaseEvent,
    SessionEvent,
    ShutdownReport,
    TaskContext,
    WorkerListener,
)
from orbit_sync.worker._listeners import Hooks

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


class Recorder(WorkerListener):
    """Keeps every event, and signals the test when one of a kind arrives."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._seen: dict[str, threading.Event] = {}
        self.wrapped: list[str] = []

    def seen(self, kind: str) -> threading.Event:
        with self._lock:
            return self._seen.setdefault(kind, threading.Event())

    def of(self, kind: str) -> list[Any]:
        with self._lock:
            return [event for k, event in self.events if k == kind]

    def record(self, kind: str, event: Any) -> None:
        with self._lock:
            self.events.append((kind, event))
        self.seen(kind).set()

    def attempt_received(self, event: AttemptEvent) -> None:
        self.record("received", event)

    def attempt_started(self, event: AttemptEvent) -> None:
        self.record("started", event)

    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        self.wrapped.append(f"{ctx.handler}:before")
        try:
            return call()
        finally:
            self.wrapped.append(f"{ctx.handler}:after")

    def attempt_finished(self, event: AttemptFinished) -> None:
        self.record("finished", event)

    def lease_renewed(self, event: LeaseEvent) -> None:
        self.record("renewed", event)

    def lease_lost(self, event: LeaseEvent) -> None:
        self.record("lost", event)

    def connected(self, event: SessionEvent) -> None:
        self.record("reconnected" if event.reconnect else "connected", event)

    def disconnected(self, event: DisconnectEvent) -> None:
        self.record("disconnected", event)

    def draining(self, event: DrainEvent) -> None:
        self.record("draining", event)

    def stopped(self, report: ShutdownReport) -> None:
        self.record("stopped", report)


class Broken(WorkerListener):
    """Raises from every event and after every handler call."""

    def __init__(self) -> None:
        self.calls = 0

    def _boom(self, *args: Any) -> None:
        self.calls += 1
        raise RuntimeError("listener bug")

    attempt_received = attempt_started = attempt_finished = _boom
    lease_renewed = lease_lost = connected = disconnected = draining = stopped = _boom

    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        call()
        raise RuntimeError("middleware bug")


@pytest.fixture
def server() -> Any:
    """A mock server with 1 s leases that assigns at once."""
    with MockOrbitServer(assignment_rate=None, lease_duration=1.0) as srv:
        yield srv
        srv.check_invariants()


def test_events_reach_every_listener_and_a_broken_one_breaks_nothing(
    server: MockOrbitServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Attempt, lease, session, drain and stop events arrive; a raising listener is logged only."""
    first, broken, second = Recorder(), Broken(), Recorder()
    worker = make_worker(server, listeners=[first, broken])
    worker.add_listener(second)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        ctx.logger.info("working")
        # Held until a renewal was acknowledged, so the lease events are part of the run.
        assert first.seen("renewed").wait(10)
        return {"ok": True}

    @worker.handler("bad")
    def bad(ctx: TaskContext, payload: Any) -> Any:
        raise Fail("NOPE")

    @worker.handler("hold")
    def hold(ctx: TaskContext, payload: Any) -> Any:
        ctx.cancelled.wait(10)
        return {"late": True}

    with caplog.at_level(logging.INFO, logger="orbit_sync"):
        with running(worker):
            ok, nope = server.enqueue("work", {}), server.enqueue("bad", {})
            assert server.wait_for(ok, DONE).state is TaskState.SUCCEEDED
            assert server.wait_for(nope, DONE).state is TaskState.FAILED
            assert server.disconnect() >= 1
            assert first.seen("reconnected").wait(10)
            held = server.enqueue("hold", {})
            assert first.seen("started").wait(10)
            server.wait_until(lambda s: s.task(held).state.value == "RUNNING", timeout=10)
            server.advance(5.0)  # the server's lease expires: the next renewal is refused
            assert first.seen("lost").wait(10)
            server.wait_for(held, DONE)
        report = worker.stop()

    for rec in (first, second):
        # Two handler threads take "work" and "bad" in turn from the queue, and each tells its
        # listeners on its own: their two events may come in either order. "hold" came later.
        received = [e.handler for e in rec.of("received")]
        assert sorted(received[:2]) == ["bad", "work"] and received[2:] == ["hold"], received
        finished = {e.handler: e for e in rec.of("finished")}
        assert (finished["work"].outcome, finished["work"].delivered) == (Outcome.SUCCEEDED, True)
        assert (finished["bad"].outcome, finished["bad"].error_code) == (Outcome.FAILED, "NOPE")
        assert finished["work"].duration is not None and finished["work"].duration > 0
        assert finished["work"].task_id == ok and finished["work"].ran
        assert all(e.lag >= 0 and e.handler == "work" for e in rec.of("renewed"))
        [lost] = rec.of("lost")
        assert lost.task_id == held and lost.reason in {"lease_lost", "session_replaced"}
        assert [e.reconnect for e in rec.of("connected")] == [False]
        assert rec.of("reconnected") and rec.of("disconnected")
        [drain] = rec.of("draining")
        assert drain.drain is False and drain.timeout == 0.0
        assert rec.of("stopped") == [report]
        # Middleware wrapped each handler call on its own thread, in order.
        assert {"work:before", "work:after", "bad:before", "bad:after"} <= set(rec.wrapped)
    assert broken.calls >= 10
    failures = [r for r in caplog.records if "worker listener Broken failed" in r.getMessage()]
    assert failures and all(r.exc_info for r in failures)
    assert any("middleware Broken failed after" in r.getMessage() for r in caplog.records)
    # ctx.logger lines go to orbit_sync.task.<handler>; the finish line names handler + time.
    assert any(
        r.name == "orbit_sync.task.work" and "working" in r.getMessage() for r in caplog.records
    )
    assert any(
        r.name == "orbit_sync.worker" and "handler work finished SUCCEEDED in " in r.getMessage()
        for r in caplog.records
    )


def _run(hooks: Hooks, handler: Callable[[TaskContext, Any], Any]) -> Any:
    from orbit_sync.testing import HandlerEnvironment

    env = HandlerEnvironment()
    box: list[Any] = []
    env.run(lambda ctx, payload: box.append(hooks.call_handler(handler, ctx)), {})
    return box[0] if box else None


class _Before(WorkerListener):
    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        raise RuntimeError("before")


class _Skips(WorkerListener):
    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        return "not the handler's"


class _Swallows(WorkerListener):
    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception:
            return "swallowed"


class _Replaces(WorkerListener):
    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            raise KeyError("other") from exc


@pytest.mark.parametrize("middleware", [_Before, _Skips, Broken])
def test_failing_middleware_still_runs_the_handler_once(middleware: type[WorkerListener]) -> None:
    """Middleware that raises or skips the call: the handler runs exactly once, its value kept."""
    runs: list[int] = []

    def handler(ctx: TaskContext, payload: Any) -> Any:
        runs.append(1)
        return {"value": 1}

    assert _run(Hooks([middleware()]), handler) == {"value": 1}
    assert runs == [1]


@pytest.mark.parametrize("middleware", [_Swallows, _Replaces])
def test_middleware_cannot_change_the_handlers_exception(middleware: type[WorkerListener]) -> None:
    """The handler's own exception is what the worker sees, even if middleware hides or swaps it."""

    def handler(ctx: TaskContext, payload: Any) -> Any:
        raise ValueError("mine")

    with pytest.raises(ValueError, match="mine"):
        Hooks([middleware()]).call_handler(handler, _ctx())


def _ctx() -> TaskContext:
    from orbit_sync.testing import HandlerEnvironment

    env = HandlerEnvironment()
    env.run(lambda ctx, payload: None, {})
    assert env.context is not None
    return env.context


def test_no_listener_costs_a_truth_test_and_bad_listeners_are_refused() -> None:
    """An empty Hooks is falsy; a class, None, or an object with no listener method is refused."""
    hooks = Hooks()
    assert not hooks
    assert hooks.call_handler(lambda ctx, payload: 7, _ctx()) == 7
    for bad in (Recorder, None, object()):
        with pytest.raises(TypeError):
            hooks.add(bad)
    hooks.add(Recorder())
    assert hooks


def test_with_options_keeps_every_listener(server: MockOrbitServer) -> None:
    """A Worker rebuilt by with_options (as the CLI does) keeps listeners added either way."""
    given, added = Recorder(), Recorder()
    worker = make_worker(server, listeners=[given])
    worker.add_listener(added)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        return {}

    rebuilt = worker.with_options(capacity=2)
    task_id = server.enqueue("work", {})
    with running(rebuilt):
        server.wait_for(task_id, DONE)
        assert given.seen("finished").wait(10) and added.seen("finished").wait(10)
    assert [e.task_id for e in added.of("finished")] == [task_id]
    assert [e.task_id for e in given.of("finished")] == [task_id]


class _Where(Recorder):
    """Records, beside each event, the thread it ran on and whether that was a reader."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[tuple[str, str, bool]] = []

    def record(self, kind: str, event: Any) -> None:
        where = (kind, threading.current_thread().name, on_reader_thread())
        with self._lock:
            self.threads.append(where)
        Recorder.record(self, kind, event)


def test_no_listener_runs_on_a_connections_reader(server: MockOrbitServer) -> None:
    """The reader runs no user code: a renewal's answer sets its slot there, and its
    lease_renewed runs on the lease watchdog's thread; every other event runs off the reader too."""
    where = _Where()
    worker = make_worker(server, listeners=[where])

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        assert where.seen("renewed").wait(10)  # held until a renewal was acknowledged
        return {"ok": True}

    with running(worker):
        task_id = server.enqueue("work", {})
        assert server.wait_for(task_id, DONE).state is TaskState.SUCCEEDED
        assert where.seen("finished").wait(10)
    worker.stop()
    kinds = {kind for kind, _, _ in where.threads}
    assert {"received", "started", "renewed", "finished", "connected", "stopped"} <= kinds
    assert not [entry for entry in where.threads if entry[2]], "a listener ran on a reader"
    assert {name for kind, name, _ in where.threads if kind == "renewed"} == {
        "orbit-lease-watchdog"
    }
