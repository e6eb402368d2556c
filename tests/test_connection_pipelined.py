"""A WorkerConnection's pipelined path (``pipeline_of(conn)``: submit and submit_many): requests
sent without a parked thread, completed by callback."""

from __future__ import annotations

import logging
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

from orbit_sync.connection import MAX_IN_FLIGHT, Submission, pipeline_of
from orbit_sync.errors import (
    CallTimeout,
    OrbitError,
    WorkerBusy,
    WorkerClosed,
    WorkerDisconnected,
    WorkerError,
)
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
            pipeline = pipeline_of(conn)
            ids = [pipeline.submit("task.renew", REF, out.callback(str(i))) for i in range(3)]
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
        refused = pipeline_of(conn).submit("task.renew", REF, answered.callback("refused"))
        resume = pipeline_of(conn).submit("worker.resume", REF, out.callback("resume"))
        report = pipeline_of(conn).submit(
            "worker.capacity", CapacityReport(1, 4), out.callback("report")
        )
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
            late = pipeline_of(conn).submit("worker.resume", REF, out.callback("late"), timeout=0.2)
            other = pipeline_of(conn).submit("worker.resume", REF, out.callback("other"))
            peer.recv(), peer.recv()
            assert out.all_in.wait(WAIT)
            [(_, timed_out, _)] = out.got["late"]
            assert isinstance(timed_out, CallTimeout) and timed_out.message_id == late
            [(_, released, _)] = out.got["other"]
            assert isinstance(released, CallTimeout) and released.message_id == other
            assert conn.done.wait(WAIT) and isinstance(conn.err, CallTimeout)
        finally:
            conn.close()


def test_a_batch_bound_shorter_than_the_deadline_threads_sleep_still_ends_it() -> None:
    """A batch sent while the deadline thread sleeps until a longer bound times out on its own."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            out = Outcomes(2)
            pipeline_of(conn).submit("worker.resume", REF, out.callback("long"))  # 10 s bound
            peer.recv()
            [late] = pipeline_of(conn).submit_many(_renews(out, ["late"], timeout=0.2))
            peer.recv()
            assert out.all_in.wait(WAIT)
            [(_, timed_out, _)] = out.got["late"]
            assert isinstance(timed_out, CallTimeout) and timed_out.message_id == late
        finally:
            conn.close()


def test_a_resume_answer_carries_its_local_deadline() -> None:
    """A pipelined resume completes with a Lease anchored like the blocking resume's."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            out = Outcomes(1)
            pipeline_of(conn).submit("worker.resume", REF, out.callback("resume"))
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
                pipeline_of(conn).submit("worker.hello", REF, out.callback("x"))
            with pytest.raises(TypeError):
                pipeline_of(conn).submit("task.renew", CapacityReport(1, 4), out.callback("x"))
            with pytest.raises(ValueError):
                pipeline_of(conn).submit("task.renew", REF, out.callback("x"), message_id="nope")
            probe = pipeline_of(conn).submit("task.renew", REF, out.callback("probe"))
            assert peer.recv()["message_id"] == probe  # the first frame sent is the probe
            assert not out.got
        finally:
            conn.close()


def _renews(out: Outcomes, keys: list[str], **extra: Any) -> list[Submission]:
    return [Submission("task.renew", REF, out.callback(key), **extra) for key in keys]


def test_submit_many_sends_the_batch_in_order_and_routes_each_answer() -> None:
    """A batch of renews goes out in order before any answer; each callback gets its own, once."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            out = Outcomes(3)
            ids = pipeline_of(conn).submit_many(_renews(out, ["0", "1", "2"]))
            requests = [peer.recv() for _ in range(3)]
            assert [r["message_id"] for r in requests] == ids and None not in ids
            assert all(r["type"] == "task.renew" for r in requests)
            for window, request in zip((10, 20, 30), reversed(requests), strict=True):
                peer.ack(request, command_body("renew", lease=lease_body(window=window)))
            assert out.all_in.wait(WAIT)
            for key, window in zip(("0", "1", "2"), (30, 20, 10), strict=True):
                [(value, error, thread)] = out.got[key]
                assert error is None and value.lease.window == window
                assert thread.startswith("orbit-sync-reader")
        finally:
            conn.close()


def test_submit_many_refuses_what_the_connection_cannot_take() -> None:
    """Past the in-flight limit a request is not sent: its callback gets WorkerBusy, its id None;
    on an ended connection every callback gets the connection's error."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        keys = [str(i) for i in range(MAX_IN_FLIGHT + 2)]
        busy = Outcomes(2)
        sent = Outcomes(MAX_IN_FLIGHT)
        requests = _renews(sent, keys[:MAX_IN_FLIGHT]) + _renews(busy, keys[MAX_IN_FLIGHT:])
        ids = pipeline_of(conn).submit_many(requests)
        assert ids[MAX_IN_FLIGHT:] == [None, None] and None not in ids[:MAX_IN_FLIGHT]
        assert busy.all_in.wait(WAIT)
        assert all(isinstance(v[0][1], WorkerBusy) for v in busy.got.values())
        assert [peer.recv()["message_id"] for _ in ids[:MAX_IN_FLIGHT]] == ids[:MAX_IN_FLIGHT]
        conn.close()
        assert sent.all_in.wait(WAIT)
        closed = Outcomes(2)
        assert pipeline_of(conn).submit_many(_renews(closed, ["a", "b"])) == [None, None]
        assert closed.all_in.wait(WAIT)
        assert all(isinstance(v[0][1], WorkerClosed) for v in closed.got.values())


def test_submit_many_bad_arguments_raise_before_anything_is_sent() -> None:
    """A wrong body, a repeated message_id or one already in flight fail the whole batch first."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            out = Outcomes(1)
            good = Submission("task.renew", REF, out.callback("x"))
            with pytest.raises(TypeError):
                wrong = Submission("task.renew", CapacityReport(1, 4), good[2])
                pipeline_of(conn).submit_many([good, wrong])
            with pytest.raises(TypeError):
                pipeline_of(conn).submit_many([("task.renew", REF, good[2])])  # type: ignore[list-item]
            with pytest.raises(ValueError):
                pipeline_of(conn).submit_many(_renews(out, ["x", "y"], message_id="a" * 32))
            with pytest.raises(ValueError):
                pipeline_of(conn).submit_many(_renews(out, ["x"], timeout=-1.0))
            probe = pipeline_of(conn).submit("task.renew", REF, out.callback("probe"))
            with pytest.raises(ValueError):
                pipeline_of(conn).submit_many([good, Submission("task.renew", REF, good[2], probe)])
            assert peer.recv()["message_id"] == probe  # the first frame sent is the probe
            assert not out.got
        finally:
            conn.close()


def test_a_bug_in_the_reader_is_logged_and_kept_as_the_cause(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected exception while reading ends the connection as WorkerDisconnected, with the
    exception as its cause and one error log line with its traceback; callers are released."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:

            def broken(raw: bytes | str) -> Any:
                raise RuntimeError("decoder bug")

            monkeypatch.setattr(conn._core, "decode", broken)
            out = Outcomes(1)
            pipeline_of(conn).submit("task.renew", REF, out.callback("renew"))
            peer.ack(peer.recv(), command_body("renew"))
            assert out.all_in.wait(WAIT) and conn.done.wait(WAIT)
            [(_, error, _)] = out.got["renew"]
            assert isinstance(error, WorkerDisconnected)
            assert isinstance(conn.err, WorkerDisconnected)
            assert isinstance(conn.err.__cause__, RuntimeError)
            [record] = [
                r
                for r in caplog.records
                if r.name == "orbit_sync.connection" and r.levelno == logging.ERROR
            ]
            assert record.exc_info is not None and record.exc_info[0] is RuntimeError
        finally:
            conn.close()


def test_a_bug_in_the_writer_is_logged_and_kept_as_the_cause(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected exception while writing a batch fails every request of it with
    WorkerDisconnected caused by that exception, logged once with its traceback."""
    with ScriptedServer() as server:
        conn, _peer = open_pair(server)
        try:

            def broken(texts: Any) -> None:
                raise TypeError("writer bug")

            monkeypatch.setattr(conn._transport, "send_texts", broken)
            out = Outcomes(2)
            pipeline_of(conn).submit_many(_renews(out, ["0", "1"]))
            assert out.all_in.wait(WAIT)
            for key in ("0", "1"):
                [(_, error, _)] = out.got[key]
                assert isinstance(error, WorkerDisconnected)
                assert isinstance(error.__cause__, TypeError)
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1 and errors[0].exc_info is not None
        finally:
            conn.close()
