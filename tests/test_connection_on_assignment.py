"""The on_assignment callback: task.assign pushes handed over on the reader thread, unbounded."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import pytest
from _scripted import (
    TOKEN,
    WAIT,
    ScriptedServer,
    assignment_body,
    open_pair,
    registration,
    welcome_body,
)

from orbit_sync.client import Client
from orbit_sync.connection import ASSIGNMENT_BUFFER
from orbit_sync.errors import WorkerClosed
from orbit_sync.models import Assignment, CapacityReport, Welcome


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


def _ids(count: int) -> list[str]:
    """*count* distinct attempt ids."""
    return [f"{i:032x}" for i in range(1, count + 1)]


def test_callback_gets_every_assignment_on_the_reader_without_backpressure() -> None:
    """More than eight assignments in a row all reach on_assignment, in order, on the reader."""
    seen: queue.Queue[tuple[str, Assignment]] = queue.Queue()
    with ScriptedServer() as server:
        conn, peer = open_pair(
            server,
            on_assignment=lambda a: seen.put((threading.current_thread().name, a)),
        )
        try:
            ids = _ids(3 * ASSIGNMENT_BUFFER)
            for attempt_id in ids:
                peer.push("task.assign", assignment_body(attempt_id=attempt_id))
            got = [seen.get(timeout=WAIT) for _ in ids]
            assert all(name.startswith("orbit-sync-reader-") for name, _ in got)
            assert all(isinstance(a, Assignment) for _, a in got)
            assert [a.attempt_id for _, a in got] == ids
            _roundtrip(conn, peer)
            assert conn.err is None
        finally:
            conn.close()


def test_next_assignment_raises_when_a_callback_is_set() -> None:
    """With on_assignment set, next_assignment raises RuntimeError instead of waiting."""
    with ScriptedServer() as server:
        conn, _peer = open_pair(server, on_assignment=lambda a: None)
        try:
            with pytest.raises(RuntimeError, match="on_assignment"):
                conn.next_assignment(timeout=0)
            with pytest.raises(RuntimeError, match="on_assignment"):
                conn.next_assignment()
        finally:
            conn.close()


def test_callback_exception_is_logged_and_the_connection_lives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exception in on_assignment is logged, that assignment dropped, the next one delivered."""
    seen: queue.Queue[str] = queue.Queue()

    def on_assignment(assignment: Assignment) -> None:
        seen.put(assignment.attempt_id)
        if assignment.attempt_id == "d" * 32:
            raise RuntimeError("dispatch bookkeeping failed")

    caplog.set_level(logging.ERROR, logger="orbit_sync")
    with ScriptedServer() as server:
        conn, peer = open_pair(server, on_assignment=on_assignment)
        try:
            peer.push("task.assign", assignment_body(attempt_id="d" * 32))
            peer.push("task.assign", assignment_body(attempt_id="e" * 32))
            assert [seen.get(timeout=WAIT), seen.get(timeout=WAIT)] == ["d" * 32, "e" * 32]
            _roundtrip(conn, peer)
            assert conn.err is None
            assert "on_assignment callback raised; the assignment is dropped" in caplog.text
        finally:
            conn.close()


def test_callback_cannot_make_requests() -> None:
    """A request from inside on_assignment (it would wait on its own reader) raises RuntimeError."""
    raised: queue.Queue[BaseException] = queue.Queue()
    holder: dict[str, Any] = {}

    def on_assignment(assignment: Assignment) -> None:
        try:
            holder["conn"].start(assignment.attempt)
        except BaseException as exc:
            raised.put(exc)

    with ScriptedServer() as server:
        conn, peer = open_pair(server, on_assignment=on_assignment)
        holder["conn"] = conn
        try:
            peer.push("task.assign", assignment_body())
            exc = raised.get(timeout=WAIT)
            assert isinstance(exc, RuntimeError) and "on_assignment" in str(exc)
            _roundtrip(conn, peer)  # nothing was sent by the callback; the connection lives
            assert conn.err is None
        finally:
            conn.close()


def test_callback_may_close_the_connection() -> None:
    """Closing the connection from inside on_assignment does not deadlock the reader."""
    holder: dict[str, Any] = {}

    with ScriptedServer() as server:
        conn, peer = open_pair(server, on_assignment=lambda a: holder["conn"].close())
        holder["conn"] = conn
        peer.push("task.assign", assignment_body())
        assert conn.done.wait(WAIT)
        assert isinstance(conn.err, WorkerClosed)
        conn.close()


def test_dial_rejects_a_non_callable_on_assignment() -> None:
    """on_assignment must be callable; the check happens before any connection is made."""
    client = Client("ws://127.0.0.1:9", TOKEN)
    with pytest.raises(TypeError, match="on_assignment"):
        client.dial_worker(registration(), on_assignment="not callable")  # type: ignore[arg-type]
