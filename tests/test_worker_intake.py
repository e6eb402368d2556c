"""How the Worker takes assignments, against the mock server: they reach its handler threads
through the connection's bounded queue (8), never overflow it, and the thread that took one
starts, runs and finishes it."""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from typing import Any

import pytest
from _worker_helpers import Sessions, events, make_worker, running, worker_threads

from orbit_sync import TaskContext, Worker
from orbit_sync.client import Client
from orbit_sync.connection import WorkerConnection, on_reader_thread
from orbit_sync.models import TaskState
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import AttemptEvent, WorkerListener

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
CAPACITY = 32


@pytest.mark.parametrize("capacity", [CAPACITY, 256])
def test_bursts_of_capacity_assignments_never_overflow_the_queue(capacity: int) -> None:
    """No assignment rate: as many tasks as the capacity enqueued at once, three times over, all
    run once on the first session. The worker reports its whole capacity, so each burst reaches
    it in a few reads, far past the queue's 8: the reader waits for room while the handler
    threads take each one, and the session never ends in backpressure."""
    runs: Counter[str] = Counter()
    lock = threading.Lock()
    sessions = Sessions()
    with MockOrbitServer(assignment_rate=None) as server:
        worker = make_worker(server, capacity=capacity, listeners=[sessions])

        @worker.handler("burst")
        def burst(ctx: TaskContext, payload: Any) -> None:
            with lock:
                runs[ctx.task_id] += 1

        with running(worker):
            for _ in range(3):
                tasks = server.enqueue_many([{"handler": "burst", "payload": {}}] * capacity)
                for task_id in tasks:
                    assert server.wait_for(task_id, DONE, timeout=20).state is TaskState.SUCCEEDED
            stats = worker.stats()
        server.check_invariants()
    assert len(runs) == 3 * capacity and set(runs.values()) == {1}
    assert stats.reconnects == 0 and sessions.established == 1, "a burst ended the session"
    reported = {re.search(r"capacity=(\d+)", e.detail) for e in events(server, "session.capacity")}
    assert {int(m.group(1)) for m in reported if m} == {capacity}, "it offers every slot it has"


def test_the_thread_that_takes_an_assignment_starts_runs_and_finishes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The card's runtime: the handler thread that took an assignment sends its start and
    waits, runs the handler, sends its finish and waits, all on itself; no request of the
    worker is made on a reader thread."""
    calls: list[tuple[str, str, str, bool]] = []
    ran: dict[str, str] = {}
    for name in ("start", "finish"):
        original = getattr(WorkerConnection, name)

        def recording(
            self: WorkerConnection,
            body: Any,
            *a: Any,
            _o: Any = original,
            _n: str = name,
            **kw: Any,
        ) -> Any:
            attempt = body.attempt_id if _n == "start" else body.ref.attempt_id
            calls.append((_n, attempt, threading.current_thread().name, on_reader_thread()))
            return _o(self, body, *a, **kw)

        monkeypatch.setattr(WorkerConnection, name, recording)
    with MockOrbitServer(assignment_rate=None) as server:
        worker = make_worker(server, capacity=4)

        @worker.handler("work")
        def work(ctx: TaskContext, payload: Any) -> None:
            ran[ctx.attempt_id] = threading.current_thread().name

        with running(worker):
            tasks = server.enqueue_many([{"handler": "work", "payload": {}}] * 12)
            for task_id in tasks:
                assert server.wait_for(task_id, DONE, timeout=10).state is TaskState.SUCCEEDED
    assert len(ran) == 12 and len(calls) == 24
    assert not [c for c in calls if c[3]], "a request was made on a reader thread"
    for attempt_id, thread in ran.items():
        assert thread.startswith("orbit-handler")
        mine = [(kind, name) for kind, a, name, _ in calls if a == attempt_id]
        assert mine == [("start", thread), ("finish", thread)]


class _ReceivedPolicy(WorkerListener):
    """Records the scheduling policy each attempt_received listener call ran under."""

    def __init__(self) -> None:
        self.policies: set[int] = set()

    def attempt_received(self, event: AttemptEvent) -> None:
        self.policies.add(os.sched_getscheduler(0))


def _policies(
    batch: bool, *, late: WorkerListener | None = None
) -> tuple[set[int], dict[str, int]]:
    """The scheduling policies a handler ran under, and every thread's after a first round of
    tasks (*late*: a listener subscribed then, followed by a second round)."""
    handlers: set[int] = set()
    with MockOrbitServer() as server:
        worker = make_worker(server, capacity=4, batch_scheduling=batch)

        @worker.handler("work")
        def work(ctx: TaskContext, payload: Any) -> None:
            handlers.add(os.sched_getscheduler(0))

        with running(worker):
            for round_ in range(1 if late is None else 2):
                if round_ == 1:
                    assert late is not None
                    worker.add_listener(late)
                tasks = server.enqueue_many([{"handler": "work", "payload": {}}] * 6)
                for task_id in tasks:
                    assert server.wait_for(task_id, DONE, timeout=10).state is TaskState.SUCCEEDED
                if round_ == 0:
                    threads = {t.name: t.native_id for t in threading.enumerate()}
                    policies = {
                        name: os.sched_getscheduler(tid or 0) for name, tid in threads.items()
                    }
    return handlers, policies


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_no_thread_that_runs_user_code_changes_its_scheduling_policy_by_default() -> None:
    """By default the handler threads, which run the user's code and start its threads, keep
    the policy of the thread that started the worker, as does every other thread."""
    mine = os.sched_getscheduler(0)
    handlers, policies = _policies(batch=False)
    assert handlers == {mine}
    assert set(policies.values()) == {mine}


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_an_attempt_received_listener_runs_under_the_policy_the_worker_started_with() -> None:
    """A listener of attempt_received subscribed while the worker runs runs on a handler
    thread, under the policy the worker started with."""
    mine = os.sched_getscheduler(0)
    listener = _ReceivedPolicy()
    handlers, _ = _policies(batch=False, late=listener)
    assert listener.policies == {mine} and handlers == {mine}


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_batch_scheduling_puts_the_threads_the_reader_wakes_under_sched_batch() -> None:
    """Worker(batch_scheduling=True): the handler threads run under SCHED_BATCH (woken by the
    reader, they do not preempt it while it holds the GIL); the reader and the caller's threads
    keep theirs."""
    mine = os.sched_getscheduler(0)
    handlers, policies = _policies(batch=True)
    assert handlers == {os.SCHED_BATCH}
    assert {p for n, p in policies.items() if n.startswith("orbit-handler")} == {os.SCHED_BATCH}
    readers = {p for name, p in policies.items() if name.startswith("orbit-sync-reader")}
    assert readers == {mine} and os.sched_getscheduler(0) == mine


def test_a_session_runs_the_cards_threads_and_no_watch_thread() -> None:
    """A session's threads: the connection's reader and deadline thread, the connection thread,
    the lease watchdog, the shutdown thread and the handler threads, which take the assignments
    themselves (no intake thread); no thread only forwards the end of the connection."""
    with MockOrbitServer() as server:
        worker = make_worker(server)
        worker.handler("work")(lambda ctx, payload: None)
        with running(worker):
            task_id = server.enqueue("work", {})
            assert server.wait_for(task_id, DONE, timeout=10).state is TaskState.SUCCEEDED
            kinds = {re.sub(r"-[0-9a-f]+$", "", name) for name in worker_threads()}
    assert "orbit-sync-reader" in kinds and "orbit-worker-intake" not in kinds
    assert {k for k in kinds if k.startswith("orbit-handler")}
    assert not [k for k in kinds if "watch" in k and k != "orbit-lease-watchdog"], kinds


class _RecordingDialer:
    """Dials for real and keeps each dial's keywords."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.dials: list[dict[str, Any]] = []

    def dial_worker(self, registration: Any, timeout: float = 8.0, **kwargs: Any) -> Any:
        """Keep the keywords and dial."""
        self.dials.append(kwargs)
        return self.client.dial_worker(registration, timeout, **kwargs)


def test_the_queue_holds_the_protocol_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker dials without an on_assignment callback, so its connection keeps what it is
    assigned in its queue of 8 (PROTOCOL §10, see test_connection_pushes), where a handler
    thread takes each assignment."""
    taken: list[tuple[str, str]] = []
    take = WorkerConnection.next_assignment

    def recording(self: WorkerConnection, *a: Any, **kw: Any) -> Any:
        assignment = take(self, *a, **kw)
        taken.append((assignment.task.task_id, threading.current_thread().name))
        return assignment

    monkeypatch.setattr(WorkerConnection, "next_assignment", recording)
    with MockOrbitServer() as server:
        dialer = _RecordingDialer(Client(server.url, server.token))
        worker = Worker(dialer, queue_id=server.queue_id, handle_signals=False)
        worker.handler("work")(lambda ctx, payload: None)
        with running(worker):
            task_id = server.enqueue("work", {})
            assert server.wait_for(task_id, DONE, timeout=10).state is TaskState.SUCCEEDED
    assert [t for t, _ in taken] == [task_id]
    assert taken[0][1].startswith("orbit-handler")
    assert dialer.dials and not [kwargs for kwargs in dialer.dials if "on_assignment" in kwargs]
