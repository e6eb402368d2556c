"""A WorkerConnection's batch path (``send_many``): several requests in one write, each waited
for on its own slot through a PendingCall."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
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

from orbit_sync.connection import MAX_IN_FLIGHT, BatchCall, PendingCall, WorkerConnection
from orbit_sync.errors import (
    CallTimeout,
    WorkerBusy,
    WorkerClosed,
    WorkerDisconnected,
    WorkerError,
)
from orbit_sync.models import AttemptRef, CapacityReport, CommandResult, Lease

REF = AttemptRef("1" * 32, "2" * 32, 1, LEASE_SECRET)


class Wakes:
    """A Settable that counts its set() calls, and lets a test wait until it reached a count."""

    def __init__(self) -> None:
        self.count = 0
        self.threads: list[str] = []
        self._cond = threading.Condition()

    def set(self) -> None:
        with self._cond:
            self.count += 1
            self.threads.append(threading.current_thread().name)
            self._cond.notify_all()

    def reach(self, count: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.count >= count, WAIT)


def _renews(count: int, **extra: Any) -> list[BatchCall]:
    return [BatchCall("task.renew", REF, **extra) for _ in range(count)]


def _raised(pending: PendingCall) -> BaseException:
    """The exception *pending*'s result() raises (the test fails if it returns)."""
    with pytest.raises(Exception) as caught:
        pending.result()
    return caught.value


def test_requests_are_all_in_flight_and_answers_route_out_of_order() -> None:
    """Three renews are sent before any answer; each PendingCall gets its own answer."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            calls = [conn.send_many([BatchCall("task.renew", REF)])[0] for _ in range(3)]
            requests = [peer.recv() for _ in range(3)]  # all sent, none answered yet
            assert [r["message_id"] for r in requests] == [c.message_id for c in calls]
            assert not any(c.done() for c in calls)
            for window, request in zip((10, 20, 30), reversed(requests), strict=True):
                peer.ack(request, command_body("renew", lease=lease_body(window=window)))
            for call, window in zip(calls, (30, 20, 10), strict=True):
                value = call.result()
                assert isinstance(value, CommandResult)
                assert value.lease.window == window and value.lease.deadline is not None
        finally:
            conn.close()


def test_error_answer_then_close_release_every_pending_call_once() -> None:
    """An error answer reaches its call; close() releases the rest with WorkerClosed bound to
    each one's message_id, and each call is completed once."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        wakes = Wakes()
        refused, resume, report = conn.send_many(
            [
                BatchCall("task.renew", REF),
                BatchCall("worker.resume", REF),
                BatchCall("worker.capacity", CapacityReport(1, 4)),
            ],
            wake=wakes,
        )
        first = peer.recv()
        assert first["message_id"] == refused.message_id
        peer.error(first, "LEASE_LOST")
        peer.recv(), peer.recv()
        assert wakes.reach(1)
        lost = _raised(refused)
        assert isinstance(lost, WorkerError) and lost.code == "LEASE_LOST"
        assert lost.message_id == refused.message_id
        assert conn.err is None and not resume.done() and not report.done()
        conn.close()
        assert wakes.reach(3)
        for pending in (resume, report):
            error = _raised(pending)
            assert isinstance(error, WorkerClosed) and error.message_id == pending.message_id
        assert conn.done.wait(WAIT)
        assert wakes.count == 3  # one wake-up per call: none was completed twice


def test_an_unanswered_request_times_out_and_closes_the_connection() -> None:
    """A request past its own bound raises CallTimeout and the connection ends, releasing the
    other call of the batch with CallTimeout bound to its message_id."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            late, other = conn.send_many(
                [BatchCall("worker.resume", REF, timeout=0.2), BatchCall("worker.resume", REF)]
            )
            peer.recv(), peer.recv()
            timed_out = _raised(late)
            assert isinstance(timed_out, CallTimeout) and timed_out.message_id == late.message_id
            released = _raised(other)
            assert isinstance(released, CallTimeout) and released.message_id == other.message_id
            assert conn.done.wait(WAIT) and isinstance(conn.err, CallTimeout)
        finally:
            conn.close()


def test_a_batch_bound_shorter_than_the_deadline_threads_sleep_still_ends_it() -> None:
    """A batch sent while the deadline thread sleeps until a longer bound times out on its own
    (its wake is set by the deadline thread, with no caller waiting on the slot)."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            conn.send_many([BatchCall("worker.resume", REF)])  # a 10 s bound
            peer.recv()
            wakes = Wakes()
            [late] = conn.send_many(_renews(1, timeout=0.2), wake=wakes)
            peer.recv()
            assert wakes.reach(1), "nobody ended the call at its bound"
            assert late.done()
            timed_out = _raised(late)
            assert isinstance(timed_out, CallTimeout) and timed_out.message_id == late.message_id
        finally:
            conn.close()


def test_a_resume_answer_carries_its_local_deadline() -> None:
    """A batched resume's result is a Lease anchored like the blocking resume's."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            [resume] = conn.send_many([BatchCall("worker.resume", REF)])
            peer.ack(peer.recv(), lease_body(window=20))
            lease = resume.result()
            assert isinstance(lease, Lease) and lease.remaining() > 19
        finally:
            conn.close()


def _probe(conn: WorkerConnection, peer: Any, **extra: Any) -> None:
    """One renew sent and answered: it is the first frame the peer gets, and it succeeds."""
    [probe] = conn.send_many([BatchCall("task.renew", REF, **extra)])
    request = peer.recv()
    assert request["message_id"] == probe.message_id  # nothing was sent before it
    peer.ack(request, command_body("renew"))
    assert isinstance(probe.result(), CommandResult)
    assert conn.err is None


def test_bad_arguments_raise_before_anything_is_sent() -> None:
    """An unknown type, a wrong body or a bad message_id raise, send nothing, and leave the
    connection usable."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            with pytest.raises(ValueError):
                conn.send_many([BatchCall("worker.hello", REF)])
            with pytest.raises(TypeError):
                conn.send_many([BatchCall("task.renew", CapacityReport(1, 4))])
            with pytest.raises(ValueError):
                conn.send_many([BatchCall("task.renew", REF, message_id="nope")])
            _probe(conn, peer)
        finally:
            conn.close()


def test_send_many_writes_the_batch_once_in_order_and_routes_each_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch of renews goes out in one write, in order, before any answer; each PendingCall
    gets its own answer, and the wake is set once per answer."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            writes: list[int] = []
            transport = conn._transport
            real = transport.send_texts

            def spy(texts: Sequence[str]) -> None:
                writes.append(len(texts))
                real(texts)

            monkeypatch.setattr(transport, "send_texts", spy)
            wakes = Wakes()
            calls = conn.send_many(_renews(3), wake=wakes)
            assert writes == [3]
            requests = [peer.recv() for _ in range(3)]
            assert [r["message_id"] for r in requests] == [c.message_id for c in calls]
            assert None not in [c.message_id for c in calls]
            assert all(r["type"] == "task.renew" for r in requests)
            for window, request in zip((10, 20, 30), reversed(requests), strict=True):
                peer.ack(request, command_body("renew", lease=lease_body(window=window)))
            for call, window in zip(calls, (30, 20, 10), strict=True):
                assert call.result().lease.window == window
            assert wakes.reach(3) and wakes.count == 3
            assert all(name.startswith("orbit-sync-reader") for name in wakes.threads)
        finally:
            conn.close()


def test_the_wake_is_set_as_each_answer_arrives() -> None:
    """One thread can wait for the first answer of many: the batch's wake is set by each
    answer as it arrives, and only the answered call is done."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            wakes = Wakes()
            calls = conn.send_many(_renews(3), wake=wakes)
            requests = [peer.recv() for _ in range(3)]
            assert wakes.count == 0 and not any(c.done() for c in calls)
            peer.ack(requests[1], command_body("renew"))
            assert wakes.reach(1)
            assert [c.done() for c in calls] == [False, True, False]
            peer.ack(requests[2], command_body("renew"))
            assert wakes.reach(2)
            assert [c.done() for c in calls] == [False, True, True]
            peer.ack(requests[0], command_body("renew"))
            assert wakes.reach(3)
            assert all(isinstance(c.result(), CommandResult) for c in calls)
        finally:
            conn.close()


def test_send_many_refuses_what_the_connection_cannot_take() -> None:
    """Past the in-flight limit a request is not sent: its message_id is None and result()
    raises WorkerBusy; on an ended connection every result() raises the connection's error."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        calls = conn.send_many(_renews(MAX_IN_FLIGHT + 2))
        sent, busy = calls[:MAX_IN_FLIGHT], calls[MAX_IN_FLIGHT:]
        assert [c.message_id for c in busy] == [None, None]
        assert None not in [c.message_id for c in sent]
        assert all(c.done() for c in busy) and not any(c.done() for c in sent)
        assert all(isinstance(_raised(c), WorkerBusy) for c in busy)
        assert [peer.recv()["message_id"] for _ in sent] == [c.message_id for c in sent]
        conn.close()
        assert all(isinstance(_raised(c), WorkerClosed) for c in sent)
        closed = conn.send_many(_renews(2))
        assert [c.message_id for c in closed] == [None, None] and all(c.done() for c in closed)
        assert all(isinstance(_raised(c), WorkerClosed) for c in closed)


def test_send_many_bad_arguments_raise_before_anything_is_sent() -> None:
    """A wrong body, a non-BatchCall, a repeated message_id, a bad timeout or a message_id
    already in flight fail the whole batch first, and leave the connection usable."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            good = BatchCall("task.renew", REF)
            with pytest.raises(TypeError):
                conn.send_many([good, BatchCall("task.renew", CapacityReport(1, 4))])
            with pytest.raises(TypeError):
                conn.send_many([good, ("task.renew", REF)])  # a plain tuple
            with pytest.raises(ValueError):
                conn.send_many(_renews(2, message_id="a" * 32))
            with pytest.raises(ValueError):
                conn.send_many([good, BatchCall("task.renew", REF, timeout=-1.0)])
            [held] = conn.send_many([good])
            with pytest.raises(ValueError):
                conn.send_many([good, BatchCall("task.renew", REF, held.message_id)])
            request = peer.recv()
            assert request["message_id"] == held.message_id  # the first frame sent
            peer.ack(request, command_body("renew"))
            assert isinstance(held.result(), CommandResult)
            # The refused batches left no call open: their message_id is free again.
            _probe(conn, peer, message_id="a" * 32)
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
            [renew] = conn.send_many([BatchCall("task.renew", REF)])
            peer.ack(peer.recv(), command_body("renew"))
            assert isinstance(_raised(renew), WorkerDisconnected)
            assert conn.done.wait(WAIT)
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
            calls = conn.send_many(_renews(2))
            assert all(c.done() for c in calls)
            for call in calls:
                error = _raised(call)
                assert isinstance(error, WorkerDisconnected)
                assert isinstance(error.__cause__, TypeError)
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1 and errors[0].exc_info is not None
        finally:
            conn.close()


def test_wake_on_end_is_set_when_the_connection_ends() -> None:
    """A settable given to wake_on_end stays clear while the connection lives and is set, once,
    when close() ends it."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        wakes = Wakes()
        conn.wake_on_end(wakes)
        _probe(conn, peer)  # an answered call does not set it
        assert wakes.count == 0
        conn.close()
        assert wakes.reach(1) and conn.done.wait(WAIT)
        conn.close()
        assert wakes.count == 1


def test_wake_on_end_is_set_when_the_server_drops_the_connection() -> None:
    """The server closing the socket ends the connection and sets every wake_on_end settable."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            first, second = threading.Event(), threading.Event()
            conn.wake_on_end(first)
            conn.wake_on_end(second)
            peer.close()
            assert first.wait(WAIT) and second.wait(WAIT)
            assert isinstance(conn.err, WorkerDisconnected)
        finally:
            conn.close()


def test_wake_on_end_on_an_ended_connection_is_set_at_once() -> None:
    """wake_on_end after the connection has ended sets the settable before it returns."""
    with ScriptedServer() as server:
        conn, _peer = open_pair(server)
        conn.close()
        assert conn.done.wait(WAIT)
        late = threading.Event()
        conn.wake_on_end(late)
        assert late.is_set()
