"""Server pushes: task.assign (bounded queue, backpressure) and task.cancel (callback or queue)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import pytest
from _scripted import (
    WAIT,
    ScriptedServer,
    assignment_body,
    cancel_body,
    open_pair,
    registration,
    welcome_body,
)

from orbit_sync.connection import ASSIGNMENT_BUFFER
from orbit_sync.errors import (
    OrbitError,
    WorkerBackpressure,
    WorkerClosed,
    WorkerProtocolError,
)
from orbit_sync.models import Assignment, CancelNotice, CapacityReport, Welcome


def _roundtrip(conn: Any, peer: Any) -> None:
    """A capacity call answered by the peer: every frame pushed before it has been read."""
    out: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: out.update(result=conn.capacity(CapacityReport(1, 1))), daemon=True
    )
    thread.start()
    peer.ack(peer.recv(), welcome_body())
    thread.join(WAIT)
    assert isinstance(out.get("result"), Welcome)


def test_assignments_arrive_in_order() -> None:
    """Pushed assignments come out of next_assignment in order, as validated models."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            ids = [f"{i:032x}" for i in range(1, 4)]
            for attempt_id in ids:
                peer.push("task.assign", assignment_body(attempt_id=attempt_id))
            got = [conn.next_assignment(timeout=WAIT) for _ in ids]
            assert [a.attempt_id for a in got] == ids
            assert all(isinstance(a, Assignment) for a in got)
            assert got[0].attempt.attempt_id == ids[0]
        finally:
            conn.close()


def test_next_assignment_times_out_with_builtin_timeout_and_stays_open() -> None:
    """No assignment in time raises the built-in TimeoutError; the connection stays usable."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            with pytest.raises(TimeoutError) as caught:
                conn.next_assignment(timeout=0.05)
            assert not isinstance(caught.value, OrbitError)
            with pytest.raises(TimeoutError):
                conn.next_assignment(timeout=0)
            assert conn.err is None
            peer.push("task.assign", assignment_body())
            assert conn.next_assignment(timeout=WAIT).attempt_id == "2" * 32
        finally:
            conn.close()


class _Waiting(logging.Handler):
    """Set once the reader says it waits for room on a full push queue."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "waiting up to" in record.getMessage():
            self.event.set()


@pytest.fixture
def waiting() -> Any:
    """A handler on the connection's logger that sees the reader start waiting for room."""
    handler = _Waiting()
    logger = logging.getLogger("orbit_sync.connection")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_ninth_assignment_waits_for_room_and_reads_on_once_one_is_taken(
    waiting: _Waiting,
) -> None:
    """Eight unread assignments fill the queue; the reader holds the ninth, reading nothing
    behind it (a call's answer waits), until a consumer takes one: then it is queued, the answer
    read, and all nine come out in order on an open connection."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            ids = [f"{i + 1:032x}" for i in range(ASSIGNMENT_BUFFER + 1)]
            for attempt_id in ids[:-1]:
                peer.push("task.assign", assignment_body(attempt_id=attempt_id))
            _roundtrip(conn, peer)
            out: dict[str, Any] = {}
            call = threading.Thread(
                target=lambda: out.update(result=conn.capacity(CapacityReport(1, 1))),
                daemon=True,
            )
            call.start()
            request = peer.recv()
            peer.push("task.assign", assignment_body(attempt_id=ids[-1]))
            peer.ack(request, welcome_body())
            assert waiting.event.wait(WAIT), "the reader waits for room for the ninth"
            taken = [conn.next_assignment(timeout=WAIT)]
            call.join(WAIT)
            assert isinstance(out.get("result"), Welcome), "the answer behind it was read"
            taken += [conn.next_assignment(timeout=WAIT) for _ in ids[1:]]
            assert [a.attempt_id for a in taken] == ids
            assert conn.err is None
        finally:
            conn.close()


def test_an_assignment_waiting_for_room_is_kept_ahead_of_the_end_when_closed(
    waiting: _Waiting,
) -> None:
    """close() while the reader holds a ninth assignment: the reader wakes at once; plain
    next_assignment raises WorkerClosed, and with after_end=True it still returns all nine in
    order, then raises WorkerClosed."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        ids = [f"{i + 1:032x}" for i in range(ASSIGNMENT_BUFFER + 1)]
        for attempt_id in ids:
            peer.push("task.assign", assignment_body(attempt_id=attempt_id))
        assert waiting.event.wait(WAIT)
        conn.close()
        assert conn.done.wait(WAIT) and isinstance(conn.err, WorkerClosed)
        with pytest.raises(WorkerClosed):
            conn.next_assignment(timeout=0)  # without after_end: a dead session grants nothing
        left = [conn.next_assignment(timeout=WAIT, after_end=True) for _ in ids]
        assert [a.attempt_id for a in left] == ids
        for _ in range(2):  # the end stays for every later taker
            with pytest.raises(WorkerClosed):
                conn.next_assignment(timeout=WAIT, after_end=True)


def test_after_end_returns_what_was_left_unread_then_the_error() -> None:
    """Assignments left unread when the server drops the connection come out of
    next_assignment(after_end=True) in order, then it raises the connection's error."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            ids = [f"{i:032x}" for i in range(1, 4)]
            for attempt_id in ids:
                peer.push("task.assign", assignment_body(attempt_id=attempt_id))
            _roundtrip(conn, peer)
            first = conn.next_assignment(timeout=WAIT, after_end=True)  # the connection lives
            peer.close()
            assert conn.done.wait(WAIT) and conn.err is not None
            rest = [conn.next_assignment(timeout=WAIT, after_end=True) for _ in ids[1:]]
            assert [a.attempt_id for a in [first, *rest]] == ids
            with pytest.raises(type(conn.err)):
                conn.next_assignment(timeout=WAIT, after_end=True)
        finally:
            conn.close()


def test_assignments_received_counts_every_assign_push() -> None:
    """assignments_received counts each task.assign the connection read, taken or not, and
    keeps its count after the end."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        assert conn.assignments_received == 0
        for i in range(3):
            peer.push("task.assign", assignment_body(attempt_id=f"{i + 1:032x}"))
        _roundtrip(conn, peer)  # every push before the answer has been read
        assert conn.assignments_received == 3
        conn.next_assignment(timeout=WAIT)
        assert conn.assignments_received == 3  # taking one does not change the count
        peer.push("task.assign", assignment_body(attempt_id="f" * 32))
        _roundtrip(conn, peer)
        assert conn.assignments_received == 4
        conn.close()
        assert conn.assignments_received == 4


def test_assignments_received_counts_those_given_to_on_assignment() -> None:
    """With an on_assignment callback, assignments_received counts the pushes it was handed."""
    seen: queue.Queue[Assignment] = queue.Queue()
    with ScriptedServer() as server:
        conn, peer = open_pair(server, on_assignment=seen.put)
        try:
            for i in range(2):
                peer.push("task.assign", assignment_body(attempt_id=f"{i + 1:032x}"))
            _roundtrip(conn, peer)
            assert seen.qsize() == 2 and conn.assignments_received == 2
        finally:
            conn.close()


def test_ninth_unread_assignment_closes_with_backpressure() -> None:
    """Eight unread assignments are held; a ninth that finds no room within ASSIGNMENT_WAIT
    closes the connection, and next_assignment then raises WorkerBackpressure."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            for i in range(ASSIGNMENT_BUFFER):
                peer.push("task.assign", assignment_body(attempt_id=f"{i + 1:032x}"))
            _roundtrip(conn, peer)
            assert conn.err is None
            peer.push("task.assign", assignment_body(attempt_id="f" * 32))
            assert conn.done.wait(WAIT)
            assert isinstance(conn.err, WorkerBackpressure)
            with pytest.raises(WorkerBackpressure):
                conn.next_assignment(timeout=0)
            assert peer.wait_closed()
        finally:
            conn.close()


def test_blocked_next_assignment_is_released_by_failure() -> None:
    """Threads waiting in next_assignment(None) are all released when the connection ends."""
    with ScriptedServer() as server:
        conn, _peer = open_pair(server)
        errors: queue.Queue[BaseException] = queue.Queue()

        def wait() -> None:
            try:
                conn.next_assignment()
            except BaseException as exc:
                errors.put(exc)

        threads = [threading.Thread(target=wait, daemon=True) for _ in range(3)]
        for thread in threads:
            thread.start()
        conn.close()
        for thread in threads:
            thread.join(WAIT)
        assert [type(errors.get(timeout=WAIT)) for _ in threads] == [WorkerClosed] * 3


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(assignment_body(queue_id="b" * 32), id="other-queue"),
        pytest.param(assignment_body(handler="thumbnail"), id="unregistered-capability"),
        pytest.param(assignment_body(state="RUNNING"), id="not-leased"),
    ],
)
def test_invalid_assignment_closes_with_protocol_error(body: dict[str, Any]) -> None:
    """An assignment failing the client's checks (PROTOCOL §6.1) closes the connection."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            peer.push("task.assign", body)
            assert conn.done.wait(WAIT)
            assert isinstance(conn.err, WorkerProtocolError)
            with pytest.raises(WorkerProtocolError):
                conn.next_assignment(timeout=0)
        finally:
            conn.close()


def test_cancel_push_is_a_protocol_error_unless_requested() -> None:
    """task.cancel to a session that did not ask for notifications closes the connection."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            peer.push("task.cancel", cancel_body())
            assert conn.done.wait(WAIT)
            assert isinstance(conn.err, WorkerProtocolError)
        finally:
            conn.close()


def test_cancel_notices_queue_without_a_callback() -> None:
    """With notifications on and no callback, notices come out of next_cancel."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server, registration(cancellation_notifications=True))
        try:
            with pytest.raises(TimeoutError):
                conn.next_cancel(timeout=0.05)
            peer.push("task.cancel", cancel_body(attempt_id="c" * 32))
            notice = conn.next_cancel(timeout=WAIT)
            assert isinstance(notice, CancelNotice) and notice.attempt_id == "c" * 32
            assert conn.err is None
        finally:
            conn.close()


def test_on_cancel_runs_on_the_reader_and_survives_exceptions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """on_cancel gets each notice on the reader thread; an exception it raises is only logged."""
    seen: queue.Queue[tuple[str, str]] = queue.Queue()

    def on_cancel(notice: CancelNotice) -> None:
        seen.put((threading.current_thread().name, notice.attempt_id))
        if notice.attempt_id == "d" * 32:
            raise RuntimeError("handler bookkeeping failed")

    caplog.set_level(logging.ERROR, logger="orbit_sync")
    with ScriptedServer() as server:
        conn, peer = open_pair(
            server, registration(cancellation_notifications=True), on_cancel=on_cancel
        )
        try:
            peer.push("task.cancel", cancel_body(attempt_id="d" * 32))
            peer.push("task.cancel", cancel_body(attempt_id="e" * 32))
            first, second = seen.get(timeout=WAIT), seen.get(timeout=WAIT)
            assert first[0].startswith("orbit-sync-reader-")
            assert [first[1], second[1]] == ["d" * 32, "e" * 32]
            assert conn.err is None
            assert "on_cancel callback raised" in caplog.text
            with pytest.raises(RuntimeError):
                conn.next_cancel(timeout=0)
        finally:
            conn.close()


def test_on_cancel_may_close_the_connection() -> None:
    """Closing the connection from inside on_cancel does not deadlock the reader."""
    holder: dict[str, Any] = {}

    def on_cancel(notice: CancelNotice) -> None:
        holder["conn"].close()

    with ScriptedServer() as server:
        conn, peer = open_pair(
            server, registration(cancellation_notifications=True), on_cancel=on_cancel
        )
        holder["conn"] = conn
        peer.push("task.cancel", cancel_body())
        assert conn.done.wait(WAIT)
        assert isinstance(conn.err, WorkerClosed)
        conn.close()


def test_on_cancel_cannot_make_requests() -> None:
    """A request from inside on_cancel (it would wait on its own reader) raises RuntimeError."""
    raised: queue.Queue[BaseException] = queue.Queue()
    holder: dict[str, Any] = {}

    def on_cancel(notice: CancelNotice) -> None:
        try:
            holder["conn"].capacity(CapacityReport(1, 1))
        except BaseException as exc:
            raised.put(exc)

    with ScriptedServer() as server:
        conn, peer = open_pair(
            server, registration(cancellation_notifications=True), on_cancel=on_cancel
        )
        holder["conn"] = conn
        try:
            peer.push("task.cancel", cancel_body())
            assert isinstance(raised.get(timeout=WAIT), RuntimeError)
            _roundtrip(conn, peer)  # nothing was sent by the callback; the connection lives
            assert conn.err is None
        finally:
            conn.close()
