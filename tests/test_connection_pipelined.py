"""WorkerConnection.submit: requests sent without a parked thread, completed by callback."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from _scripted import (
    LEASE_SECRET,
    WAIT,
    ScriptedServer,
    command_body,
    lease_body,
    open_pair,
)

from orbit_sync.errors import CallTimeout, OrbitError, WorkerClosed, WorkerError
from orbit_sync.models import AttemptRef, CapacityReport, CommandResult, Lease

REF = AttemptRef("1" * 32, "2" * 32, 1, LEASE_SECRET)


class Outcomes:
    """Collects (value, error, thread name) per message_id and signals when *expected* came."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.got: dict[str, list[tuple[Any, OrbitError | None, str]]] = {}
        self.all_in = threading.Event()
        self._lock = threading.Lock()

    def callback(self, key: str) -> Any:
        def done(value: Any, error: OrbitError | None) -> None:
            with self._lock:
                self.got.setdefault(key, []).append((value, error, threading.current_thread().name))
                if sum(len(v) for v in self.got.values()) >= self.expected:
                    self.all_in.set()

        return done


def test_requests_are_all_in_flight_and_answers_route_out_of_order() -> None:
    """Three renews are sent before any answer; each callback gets its own answer, once."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            out = Outcomes(3)
            ids = [conn.submit("task.renew", REF, out.callback(str(i))) for i in range(3)]
            requests = [peer.recv() for _ in range(3)]  # all sent, none answered yet
            assert [r["message_id"] for r in requests] == ids
            for window, request in zip((10, 20, 30), reversed(requests), strict=True):
                peer.ack(request, command_body("renew", lease=lease_body(window=window)))
            assert out.all_in.wait(WAIT)
            for i, window in zip(range(3), (30, 20, 10), strict=True):
                [(value, error, thread)] = out.got[str(i)]
                assert error is None and isinstance(value, CommandResult)
                assert value.lease.window == window and value.lease.deadline is not None
                assert thread.startswith("orbit-sync-reader")
        finally:
            conn.close()


def test_error_answer_then_close_release_every_callback_once() -> None:
    """An error answer reaches its callback; close() releases the rest with WorkerClosed."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        answered, out = Outcomes(1), Outcomes(2)
        refused = conn.submit("task.renew", REF, answered.callback("refused"))
        resume = conn.submit("worker.resume", REF, out.callback("resume"))
        report = conn.submit("worker.capacity", CapacityReport(1, 4), out.callback("report"))
        first = peer.recv()
        assert first["message_id"] == refused
        peer.error(first, "LEASE_LOST")
        peer.recv(), peer.recv()
        assert answered.all_in.wait(WAIT)
        [(_, lost, _)] = answered.got["refused"]
        assert isinstance(lost, WorkerError) and lost.code == "LEASE_LOST"
        assert conn.err is None and not out.got
        conn.close()
        assert out.all_in.wait(WAIT)
        for key, mid in (("resume", resume), ("report", report)):
            [(value, error, _)] = out.got[key]
            assert value is None and isinstance(error, WorkerClosed)
            assert error.message_id == mid
        assert len(answered.got["refused"]) == 1
        assert conn.done.wait(WAIT)


def test_an_unanswered_request_times_out_and_closes_the_connection() -> None:
    """A request past its bound completes with CallTimeout and the connection ends."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            out = Outcomes(2)
            late = conn.submit("worker.resume", REF, out.callback("late"), timeout=0.2)
            other = conn.submit("worker.resume", REF, out.callback("other"))
            peer.recv(), peer.recv()
            assert out.all_in.wait(WAIT)
            [(_, timed_out, _)] = out.got["late"]
            assert isinstance(timed_out, CallTimeout) and timed_out.message_id == late
            [(_, released, _)] = out.got["other"]
            assert isinstance(released, CallTimeout) and released.message_id == other
            assert conn.done.wait(WAIT) and isinstance(conn.err, CallTimeout)
        finally:
            conn.close()


def test_a_resume_answer_carries_its_local_deadline() -> None:
    """A pipelined resume completes with a Lease anchored like the blocking resume's."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            out = Outcomes(1)
            conn.submit("worker.resume", REF, out.callback("resume"))
            peer.ack(peer.recv(), lease_body(window=20))
            assert out.all_in.wait(WAIT)
            [(lease, error, _)] = out.got["resume"]
            assert error is None and isinstance(lease, Lease) and lease.remaining() > 19
        finally:
            conn.close()


def test_bad_arguments_raise_before_anything_is_sent() -> None:
    """An unknown type, a wrong body or a bad message_id raise and never call back."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            out = Outcomes(1)
            with pytest.raises(ValueError):
                conn.submit("worker.hello", REF, out.callback("x"))
            with pytest.raises(TypeError):
                conn.submit("task.renew", CapacityReport(1, 4), out.callback("x"))
            with pytest.raises(ValueError):
                conn.submit("task.renew", REF, out.callback("x"), message_id="nope")
            probe = conn.submit("task.renew", REF, out.callback("probe"))
            assert peer.recv()["message_id"] == probe  # the first frame sent is the probe
            assert not out.got
        finally:
            conn.close()
