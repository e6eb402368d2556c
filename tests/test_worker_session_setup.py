"""Session setup of a reconnecting Worker, against a scripted server: the first capacity report
follows the resumes without waiting for their answers, and every resume answer still counts."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _scripted import (
    ATTEMPT_ID,
    QUEUE_ID,
    TOKEN,
    WAIT,
    Peer,
    ScriptedServer,
    assignment_body,
    command_body,
    lease_body,
    welcome_body,
)

from orbit_sync.client import Client
from orbit_sync.testing import ManualClock
from orbit_sync.worker import Backoff, Dialer, SessionEvent, TaskContext, Worker

OTHER_TASK = "66666666666666666666666666666666"
OTHER_ATTEMPT = "77777777777777777777777777777777"


class _Handlers:
    """The ``resize`` handler: the first attempt blocks until released or cancelled."""

    def __init__(self) -> None:
        self.started: queue.Queue[str] = queue.Queue()
        self.release = threading.Event()
        self.reasons: dict[str, str | None] = {}
        self.runs: dict[str, int] = {}

    def resize(self, ctx: TaskContext, payload: Any) -> Any:
        self.runs[ctx.attempt_id] = self.runs.get(ctx.attempt_id, 0) + 1
        self.started.put(ctx.attempt_id)
        if ctx.attempt_id == ATTEMPT_ID:
            while not self.release.wait(0.02) and not ctx.cancelled.is_set():
                pass  # released by the test, or cancelled by the worker
            self.reasons[ctx.attempt_id] = ctx.cancel_reason
            ctx.raise_if_cancelled()
        return {"ok": True}


@contextlib.contextmanager
def _scripted(
    clock: ManualClock | None = None,
    listeners: list[object] | None = None,
    dialer: Callable[[Client], Dialer] | None = None,
) -> Iterator[tuple[ScriptedServer, Worker, _Handlers]]:
    """A scripted server and a Worker (capacity 2, on *clock*; dialing through *dialer*, given
    the client) connected to it; stopped at once at the end."""
    handlers = _Handlers()
    with ScriptedServer() as server:
        client = Client(server.url, TOKEN)
        worker = Worker(
            client if dialer is None else dialer(client),
            queue_id=QUEUE_ID,
            capacity=2,
            reconnect_backoff=Backoff(initial=0.05, maximum=0.2),
            renew_retry_delay=0.1,
            handle_signals=False,
            drain_timeout=0,
            cancel_grace=0,
            flush_timeout=0.5,
            clock=clock,
            listeners=listeners or [],
        )
        worker.register("resize", handlers.resize)
        worker.start()
        try:
            yield server, worker, handlers
        finally:
            worker.request_stop(drain=False)
            server.close()
            worker.stop(drain=False)


@pytest.fixture
def scripted() -> Iterator[tuple[ScriptedServer, Worker, _Handlers]]:
    """A scripted server and a Worker on real time (see :func:`_scripted`)."""
    with _scripted() as setup:
        yield setup


def _first_session(server: ScriptedServer, handlers: _Handlers) -> Peer:
    """Welcome the worker, give it one attempt, start it; return once its handler runs."""
    peer = server.accept()
    peer.handshake()
    report = peer.recv()
    assert report["type"] == "worker.capacity"
    peer.ack(report, welcome_body())
    peer.push("task.assign", assignment_body())
    start = peer.recv()
    assert start["type"] == "task.start"
    peer.ack(start, command_body("start"))
    assert handlers.started.get(timeout=WAIT) == ATTEMPT_ID
    return peer


@contextlib.contextmanager
def _on_still_time(
    seconds: float = 1.0,
) -> Iterator[tuple[ScriptedServer, Worker, _Handlers, ManualClock, Callable[[], None]]]:
    """:func:`_scripted` on a worker clock only the test moves; also yields what, after a cut,
    lets the reconnect's wait pass: once the worker waits to reconnect, the clock moves
    *seconds*."""
    clock = ManualClock(0.0)
    cut = threading.Event()

    class Cut:
        def disconnected(self, event: object) -> None:
            cut.set()

    with _scripted(clock=clock, listeners=[Cut()]) as (server, worker, handlers):

        def backoff() -> None:
            assert cut.wait(WAIT)
            assert clock.wait_for_sleepers(1, "orbit-worker-connection", timeout=WAIT)
            clock.advance(seconds)

        yield server, worker, handlers, clock, backoff


@contextlib.contextmanager
def _cut_on_fake_clock(seconds: float) -> Iterator[tuple[ScriptedServer, _Handlers]]:
    """A Worker on a fake clock whose first session (one running attempt) is cut; yields once it
    waits to reconnect and the clock has moved *seconds*, the only wait let pass on it."""
    with _on_still_time(seconds) as (server, _, handlers, _clock, backoff):
        _first_session(server, handlers).close()
        backoff()
        yield server, handlers


def _reconnected(server: ScriptedServer, epoch: str) -> tuple[Peer, dict[str, Any]]:
    """The next connection, welcomed; return it and its first request (the resume)."""
    peer = server.accept()
    peer.handshake(epoch=epoch)
    resume = peer.recv()
    assert resume["type"] == "worker.resume"
    assert resume["body"]["attempt_id"] == ATTEMPT_ID
    return peer, resume


def _answer_until_finished(peer: Peer, attempts: set[str]) -> dict[str, dict[str, Any]]:
    """Answer starts and finishes until every attempt in *attempts* has sent its finish."""
    finishes: dict[str, dict[str, Any]] = {}
    while not attempts <= finishes.keys():
        request = peer.recv()
        if request["type"] == "task.start":
            peer.ack(request, command_body("start"))
        elif request["type"] == "task.finish":
            finishes[request["body"]["ref"]["attempt_id"]] = request["body"]
            state = "SUCCEEDED" if request["body"]["outcome"] == "SUCCEEDED" else "FAILED"
            done = command_body("finish", task_state=state, attempt_state=state)
            peer.ack(request, done)
    return finishes


def test_first_report_follows_resumes_unanswered_and_lease_lost_still_cancels(
    scripted: tuple[ScriptedServer, Worker, _Handlers],
) -> None:
    """On reconnect the capacity report comes right behind the resume, before its answer; an
    assignment that arrives before the resume's LEASE_LOST answer runs, and the lost one stops."""
    server, _, handlers = scripted
    _first_session(server, handlers).close()  # the connection drops while the handler runs
    peer, resume = _reconnected(server, "2")
    report = peer.recv()  # the resume is not answered yet
    assert report["type"] == "worker.capacity"
    assert report["body"]["sequence"] == "1", "the same report, repeated on the new session"
    peer.ack(report, welcome_body(epoch="2"))
    peer.push("task.assign", assignment_body(task_id=OTHER_TASK, attempt_id=OTHER_ATTEMPT))
    peer.error(resume, "LEASE_LOST")
    finishes = _answer_until_finished(peer, {ATTEMPT_ID, OTHER_ATTEMPT})
    assert handlers.reasons[ATTEMPT_ID] == "session_replaced"
    assert finishes[OTHER_ATTEMPT]["outcome"] == "SUCCEEDED"
    assert finishes[OTHER_ATTEMPT]["result"] == {"ok": True}
    assert finishes[ATTEMPT_ID]["outcome"] != "SUCCEEDED"
    assert handlers.runs == {ATTEMPT_ID: 1, OTHER_ATTEMPT: 1}


def test_transient_resume_answer_is_retried_and_a_cut_midway_resumes_again() -> None:
    """A resume answered RATE_LIMITED after the report went out is re-sent on the same
    connection; cut before its answer, it is sent again on the next one, and then holds."""
    sessions: queue.Queue[bool] = queue.Queue()

    class Sessions:
        def connected(self, event: SessionEvent) -> None:
            sessions.put(event.reconnect)

    with _scripted(listeners=[Sessions()]) as (server, worker, handlers):
        _resume_retried_then_cut(server, handlers, sessions)
        # The session cut during its resumes was never established: one reconnect, not two.
        assert worker.stats().reconnects == 1
    assert sessions.empty(), "no other session was established"


def _resume_retried_then_cut(
    server: ScriptedServer, handlers: _Handlers, sessions: queue.Queue[bool]
) -> None:
    """The script of the test above, up to the resumed attempt's finish; *sessions* gets each
    established session's ``reconnect``."""
    _first_session(server, handlers).close()
    assert sessions.get(timeout=WAIT) is False
    peer, resume = _reconnected(server, "2")
    report = peer.recv()
    assert report["type"] == "worker.capacity"
    peer.error(resume, "RATE_LIMITED")
    peer.ack(report, welcome_body(epoch="2"))
    again = peer.recv()
    assert again["type"] == "worker.resume" and again["body"] == resume["body"]
    peer.close()  # cut before the retried resume is answered
    peer, resume = _reconnected(server, "3")
    report = peer.recv()
    assert report["type"] == "worker.capacity"
    peer.ack(resume, lease_body())
    peer.ack(report, welcome_body(epoch="3"))
    # Established once the worker says so: its connection thread steps the resume's answer, and
    # the finish below does not wait for that (it may be answered, and the worker stopped, first).
    assert sessions.get(timeout=WAIT) is True
    handlers.release.set()
    finishes = _answer_until_finished(peer, {ATTEMPT_ID})
    assert finishes[ATTEMPT_ID]["outcome"] == "SUCCEEDED"
    assert handlers.reasons[ATTEMPT_ID] is None, "the lease held: never cancelled"
    assert handlers.runs == {ATTEMPT_ID: 1}


class _Dialed:
    """A Dialer through *client* that keeps the connections it dialed (to see one end)."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self.connections: list[Any] = []

    def dial_worker(self, registration: Any, timeout: float = 8.0, **kw: Any) -> Any:
        """Dial through the client; keep the connection."""
        conn = self._client.dial_worker(registration, timeout, **kw)
        self.connections.append(conn)
        return conn


def test_a_connection_that_ends_after_its_resumes_were_answered_was_established() -> None:
    """A connection whose resume and report were answered, and which then ended before the
    connection thread stepped the resume's outcome, was still established: the worker says so
    (one reconnect), however late that thread looked."""
    sessions: queue.Queue[bool] = queue.Queue()
    stepping = threading.Event()
    resume_on = threading.Event()

    class Listener:
        def connected(self, event: SessionEvent) -> None:
            sessions.put(event.reconnect)

        def lease_lost(self, event: object) -> None:
            # Called on the connection thread as it steps the resume's refusal: held there.
            stepping.set()
            resume_on.wait(WAIT)

    dialed: list[_Dialed] = []

    def dialer(client: Client) -> _Dialed:
        dialed.append(_Dialed(client))
        return dialed[-1]

    with _scripted(listeners=[Listener()], dialer=dialer) as (server, worker, handlers):
        _first_session(server, handlers).close()
        assert sessions.get(timeout=WAIT) is False
        peer, resume = _reconnected(server, "2")
        report = peer.recv()
        assert report["type"] == "worker.capacity"
        peer.error(resume, "LEASE_LOST")  # an answer: the lease is gone, the session is not
        assert stepping.wait(WAIT)
        peer.ack(report, welcome_body(epoch="2"))
        peer.close()
        conn = dialed[0].connections[-1]
        assert conn.done.wait(WAIT), "the worker never saw the connection end"
        resume_on.set()
        assert sessions.get(timeout=WAIT) is True  # Empty: the session was never established
        assert worker.stats().reconnects == 1


def test_an_assignment_read_before_the_connection_is_published_starts_once_it_is() -> None:
    """An assignment read while the resumes are unanswered (the connection not yet published)
    sends its start once they are: it waits for the connection, not for a retry delay on the
    worker's clock, which never moves here."""
    with _cut_on_fake_clock(1.0) as (server, handlers):
        peer, resume = _reconnected(server, "2")
        report = peer.recv()
        assert report["type"] == "worker.capacity"
        peer.ack(report, welcome_body(epoch="2"))
        # Read before the resume's answer (frames are read in order): its start finds no
        # connection published yet.
        peer.push("task.assign", assignment_body(task_id=OTHER_TASK, attempt_id=OTHER_ATTEMPT))
        peer.ack(resume, lease_body())
        start = peer.recv()
        assert start["type"] == "task.start"
        assert start["body"]["attempt_id"] == OTHER_ATTEMPT
        peer.ack(start, command_body("start"))
        assert handlers.started.get(timeout=WAIT) == OTHER_ATTEMPT
        handlers.release.set()
        finishes = _answer_until_finished(peer, {ATTEMPT_ID, OTHER_ATTEMPT})
        assert finishes[OTHER_ATTEMPT]["outcome"] == "SUCCEEDED"
        assert handlers.runs == {ATTEMPT_ID: 1, OTHER_ATTEMPT: 1}


def test_a_lease_that_ran_a_quarter_of_its_window_is_renewed_once_reconnected() -> None:
    """A lease past a quarter of its window when the worker comes back is renewed on the new
    connection as soon as it is published, right behind the resume and before its answer,
    not at its half-way point, which the worker's clock (moved only by the test) never
    reaches."""
    # A 30 s lease, renewal due after ~15 s; the reconnect took 10 s: past a quarter of it.
    with _cut_on_fake_clock(10.0) as (server, handlers):
        peer, resume = _reconnected(server, "2")
        renew, report = sorted([peer.recv(), peer.recv()], key=lambda f: str(f["type"]))
        assert report["type"] == "worker.capacity"
        assert renew["type"] == "task.renew", "renewed on this connection, at once"
        peer.ack(resume, lease_body(window=20.0))  # the lease as it stands, 20 s left
        peer.ack(report, welcome_body(epoch="2"))
        assert renew["body"]["attempt_id"] == ATTEMPT_ID
        peer.ack(renew, command_body("renew"))
        handlers.release.set()
        finishes = _answer_until_finished(peer, {ATTEMPT_ID})
        assert finishes[ATTEMPT_ID]["outcome"] == "SUCCEEDED"
        assert handlers.reasons[ATTEMPT_ID] is None and handlers.runs == {ATTEMPT_ID: 1}
