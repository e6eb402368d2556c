"""WorkerConnection requests against the scripted server: frames, answers, deadlines, limits."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from _scripted import (
    LEASE_SECRET,
    SESSION_ID,
    WAIT,
    ScriptedServer,
    command_body,
    lease_body,
    open_pair,
    orbit_threads,
    welcome_body,
)

from orbit_sync.connection import CALL_TIMEOUT, MAX_IN_FLIGHT, READ_IDLE_TIMEOUT
from orbit_sync.errors import (
    CallTimeout,
    FrameError,
    WorkerBusy,
    WorkerClosed,
    WorkerError,
    WorkerProtocolError,
)
from orbit_sync.models import (
    AttemptRef,
    AttemptState,
    CapacityReport,
    CommandResult,
    Disposition,
    Finish,
    Lease,
    Outcome,
    Welcome,
    new_message_id,
)
from orbit_sync.testing import ManualClock

REF = AttemptRef("1" * 32, "2" * 32, 1, LEASE_SECRET)


def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run fn on a thread; the dict gets 'result' or 'error'."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, name="test-call", daemon=True)
    thread.start()
    return thread, out


def test_each_request_sends_its_frame_and_returns_its_answer() -> None:
    """capacity/resume/start/renew/finish send well-formed frames and return typed answers."""
    clock = ManualClock(1000.0)
    with ScriptedServer() as server:
        conn, peer = open_pair(server, clock=clock)
        try:
            calls: list[tuple[Any, dict[str, Any]]] = [
                (lambda: conn.capacity(CapacityReport(1, 4)), welcome_body()),
                (lambda: conn.resume(REF), lease_body(window=20)),
                (lambda: conn.start(REF), command_body("start")),
                (lambda: conn.renew(REF), command_body("renew")),
                (
                    lambda: conn.finish(Finish(REF, Outcome.SUCCEEDED, {"ok": True})),
                    command_body("finish", task_state="SUCCEEDED", attempt_state="SUCCEEDED"),
                ),
            ]
            types = ["worker.capacity", "worker.resume", "task.start", "task.renew", "task.finish"]
            answers: list[Any] = []
            for (call, body), expected_type in zip(calls, types, strict=True):
                thread, out = _in_thread(call)
                request = peer.recv()
                assert request["type"] == expected_type
                assert request["session_id"] == SESSION_ID
                assert set(request) == {
                    "protocol_version",
                    "type",
                    "message_id",
                    "session_id",
                    "body",
                }
                peer.ack(request, body)
                thread.join(WAIT)
                answers.append(out["result"])
            welcome, lease, started, renewed, finished = answers
            assert isinstance(welcome, Welcome) and welcome.session_id == SESSION_ID
            assert isinstance(lease, Lease) and lease.deadline == pytest.approx(1000 + 20 - 0.25)
            for result in (started, renewed, finished):
                assert isinstance(result, CommandResult)
                assert result.lease.deadline == pytest.approx(1000 + 30 - 0.25)
            assert started.lease.may_run(clock)
            assert finished.receipt.disposition is Disposition.APPLIED
            assert conn.err is None
        finally:
            conn.close()


def test_local_deadline_is_anchored_at_call_entry() -> None:
    """t_sent is read when the call starts: time spent waiting for the answer is deducted."""
    clock = ManualClock(50.0)
    with ScriptedServer() as server:
        conn, peer = open_pair(server, clock=clock)
        try:
            thread, out = _in_thread(conn.start, REF)
            request = peer.recv()
            clock.advance(9.0)  # the answer takes 9 s of (fake) time to arrive
            peer.ack(request, command_body("start"))
            thread.join(WAIT)
            lease = out["result"].lease
            assert lease.deadline == pytest.approx(50 + 30 - 0.25)
            assert lease.remaining(clock) == pytest.approx(30 - 9 - 0.25)
            clock.advance(30 - 9 - 0.25)
            assert not lease.may_run(clock)
        finally:
            conn.close()


def test_inactive_or_cancelled_lease_grants_nothing() -> None:
    """An inactive lease has no deadline; a cancel request makes may_run() false."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            thread, out = _in_thread(conn.start, REF)
            peer.ack(
                peer.recv(), command_body("start", lease=lease_body(active=False, state="EXPIRED"))
            )
            thread.join(WAIT)
            assert out["result"].lease.deadline is None
            assert not out["result"].lease.may_run()
            thread, out = _in_thread(conn.renew, REF)
            cancelled = lease_body(cancel_requested_at="2026-09-17T07:59:59Z")
            peer.ack(peer.recv(), command_body("renew", lease=cancelled))
            thread.join(WAIT)
            assert out["result"].lease.deadline is not None
            assert not out["result"].lease.may_run()
            thread, out = _in_thread(conn.start, REF)
            peer.ack(peer.recv(), command_body("start", lease=lease_body(state="LEASED")))
            thread.join(WAIT)
            assert out["result"].lease.state is AttemptState.LEASED
            assert not out["result"].lease.may_run()
        finally:
            conn.close()


def test_finish_cancelled_is_allowed_and_message_id_is_kept() -> None:
    """A CANCELLED finish (PROTOCOL allows it) is sent with the caller's message_id."""
    mid = new_message_id()
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            finish = Finish(REF, Outcome.CANCELLED, {"stopped": True}, error_code="CANCELLED")
            thread, out = _in_thread(conn.finish, finish, message_id=mid)
            request = peer.recv()
            assert request["message_id"] == mid
            assert request["body"]["outcome"] == "CANCELLED"
            assert request["body"]["error_code"] == "CANCELLED"
            peer.ack(request, command_body("finish", deduplicated=True))
            thread.join(WAIT)
            assert out["result"].deduplicated is True
        finally:
            conn.close()


def test_non_fatal_error_answer_is_raised_and_connection_stays_open() -> None:
    """LEASE_LOST or an unknown code reaches the caller as WorkerError; the connection lives."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            for code in ("LEASE_LOST", "STATE_CONFLICT", "BRAND_NEW_CODE"):
                mid = new_message_id()
                thread, out = _in_thread(conn.renew, REF, message_id=mid)
                peer.error(peer.recv(), code)
                thread.join(WAIT)
                err = out["error"]
                assert isinstance(err, WorkerError) and err.code == code
                assert err.message_id == mid and not err.fatal
            assert conn.err is None
            thread, out = _in_thread(conn.capacity, CapacityReport(1, 1))
            peer.ack(peer.recv(), welcome_body())
            thread.join(WAIT)
            assert isinstance(out["result"], Welcome)
        finally:
            conn.close()


@pytest.mark.parametrize("code", ["UNAUTHENTICATED", "PERMISSION_DENIED", "STALE_SESSION"])
def test_fatal_code_is_delivered_then_the_connection_closes(code: str) -> None:
    """A fatal code reaches its caller as itself; the connection then closes, releasing others."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            first, second = new_message_id(), new_message_id()
            t1, out1 = _in_thread(conn.start, REF, message_id=first)
            r1 = peer.recv()
            t2, out2 = _in_thread(conn.renew, REF, message_id=second)
            peer.recv()
            peer.error(r1, code)
            t1.join(WAIT)
            t2.join(WAIT)
            assert isinstance(out1["error"], WorkerError) and out1["error"].code == code
            assert out1["error"].message_id == first
            assert conn.done.wait(WAIT)
            assert isinstance(conn.err, WorkerError) and conn.err.code == code
            assert isinstance(out2["error"], WorkerError) and out2["error"].code == code
            assert out2["error"].message_id == second
            with pytest.raises(WorkerError):
                conn.capacity(CapacityReport(1, 1))
        finally:
            conn.close()


def test_error_without_reply_to_ends_the_connection() -> None:
    """An error push without reply_to is fatal: callers and next_assignment get it."""
    from _scripted import frame

    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            mid = new_message_id()
            thread, out = _in_thread(conn.start, REF, message_id=mid)
            peer.recv()
            peer.send(frame("error", error=("UNAVAILABLE", "going away")))
            thread.join(WAIT)
            assert isinstance(out["error"], WorkerError) and out["error"].code == "UNAVAILABLE"
            assert out["error"].message_id == mid
            assert conn.done.wait(WAIT)
            with pytest.raises(WorkerError):
                conn.next_assignment(timeout=1)
        finally:
            conn.close()


def test_call_bound_closes_the_connection_and_names_the_operation() -> None:
    """A request never answered raises CallTimeout carrying its message_id; others are released."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            other = new_message_id()
            t_other, out_other = _in_thread(conn.renew, REF, message_id=other, timeout=5)
            peer.recv()
            mid = new_message_id()
            started = time.monotonic()
            with pytest.raises(CallTimeout) as caught:
                conn.finish(Finish(REF, Outcome.SUCCEEDED, 1), message_id=mid, timeout=0.3)
            assert 0.25 < time.monotonic() - started < 3
            assert caught.value.message_id == mid
            assert isinstance(caught.value, TimeoutError)
            t_other.join(WAIT)
            assert isinstance(out_other["error"], CallTimeout)
            assert out_other["error"].message_id == other
            assert conn.done.wait(WAIT)
            assert isinstance(conn.err, CallTimeout)
            assert peer.wait_closed()
        finally:
            conn.close()


def test_call_bound_is_capped() -> None:
    """A timeout longer than the connection's cap is clamped to it (10 s by default)."""
    assert CALL_TIMEOUT == 10.0 and READ_IDLE_TIMEOUT == 60.0
    with ScriptedServer() as server:
        conn, _peer = open_pair(server, max_call_timeout=0.3)
        try:
            started = time.monotonic()
            with pytest.raises(CallTimeout):
                conn.start(REF, timeout=30)
            assert time.monotonic() - started < 3
        finally:
            conn.close()


def test_read_idle_bound_closes_a_silent_connection() -> None:
    """Nothing received for the read-idle bound ends the connection; server traffic resets it."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server, read_idle_timeout=0.6)
        try:
            pace = threading.Event()
            for _ in range(10):  # 1 s of pings, each well inside the 0.6 s bound
                peer.conn.ping()
                pace.wait(0.1)
            assert conn.err is None
            assert conn.done.wait(WAIT)
            from orbit_sync.errors import WorkerDisconnected

            assert isinstance(conn.err, WorkerDisconnected)
            assert peer.wait_closed()
        finally:
            conn.close()


def test_busy_limit_refuses_the_33rd_call_before_encoding() -> None:
    """With 32 calls in flight, a 33rd raises WorkerBusy before its body is even encoded."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            running = [_in_thread(conn.renew, REF) for _ in range(MAX_IN_FLIGHT)]
            requests = [peer.recv() for _ in range(MAX_IN_FLIGHT)]
            too_big = Finish(REF, Outcome.SUCCEEDED, "x" * (300 * 1024))  # would fail to encode
            with pytest.raises(WorkerBusy) as caught:
                conn.finish(too_big)
            assert caught.value.message_id is None
            for request in requests:
                peer.ack(request, command_body("renew"))
            for thread, out in running:
                thread.join(WAIT)
                assert isinstance(out["result"], CommandResult)
            # Slots are free again: the oversized result now fails where it should, in encoding.
            with pytest.raises(FrameError):
                conn.finish(too_big)
            assert conn.err is None
        finally:
            conn.close()


def test_duplicate_in_flight_message_id_is_refused() -> None:
    """A message_id already in flight is refused with ValueError and nothing is sent."""
    mid = new_message_id()
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            thread, out = _in_thread(conn.start, REF, message_id=mid)
            request = peer.recv()
            with pytest.raises(ValueError):
                conn.renew(REF, message_id=mid)
            peer.ack(request, command_body("start"))
            thread.join(WAIT)
            assert isinstance(out["result"], CommandResult)
            # Answered, so the same id may be re-sent (the server deduplicates it).
            thread, out = _in_thread(conn.start, REF, message_id=mid)
            again = peer.recv()
            assert again["message_id"] == mid and again["type"] == "task.start"
            peer.ack(again, command_body("start", deduplicated=True))
            thread.join(WAIT)
            assert out["result"].deduplicated
        finally:
            conn.close()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c: c.start(REF, message_id="ABC"), ValueError),
        (lambda c: c.start(REF, message_id="A" * 32), ValueError),
        (lambda c: c.start(REF, timeout=0), ValueError),
        (lambda c: c.start(REF, timeout=-1), ValueError),
        (lambda c: c.start(REF, timeout=float("nan")), ValueError),
        (lambda c: c.start(REF, timeout=True), TypeError),
        (lambda c: c.start("ref"), TypeError),
        (lambda c: c.resume(None), TypeError),
        (lambda c: c.capacity({"sequence": "1"}), TypeError),
        (lambda c: c.finish(REF), TypeError),
        (lambda c: c.finish(Finish(REF, Outcome.SUCCEEDED, "x" * (257 * 1024))), FrameError),
        (lambda c: c.finish(Finish(REF, Outcome.SUCCEEDED, {1: "a", "1": "b"})), FrameError),
        (lambda c: c.next_assignment(timeout=-1), ValueError),
        (lambda c: c.next_cancel(timeout=1), RuntimeError),
    ],
)
def test_bad_arguments_raise_before_anything_is_sent(call: Any, error: type[Exception]) -> None:
    """Invalid arguments raise ValueError/TypeError; the connection stays open and silent."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            with pytest.raises(error):
                call(conn)
            assert conn.err is None
            thread, out = _in_thread(conn.capacity, CapacityReport(1, 1))
            request = peer.recv()
            assert request["type"] == "worker.capacity"  # nothing was sent before it
            peer.ack(request, welcome_body())
            thread.join(WAIT)
            assert isinstance(out["result"], Welcome)
        finally:
            conn.close()


def test_close_releases_waiters_and_is_idempotent() -> None:
    """close() from another thread releases callers with WorkerClosed; repeating it is harmless."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        mid = new_message_id()
        thread, out = _in_thread(conn.start, REF, message_id=mid)
        peer.recv()
        waiting, got = _in_thread(conn.next_assignment)
        closers = [threading.Thread(target=conn.close) for _ in range(3)]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(WAIT)
        thread.join(WAIT)
        waiting.join(WAIT)
        assert isinstance(out["error"], WorkerClosed) and out["error"].message_id == mid
        assert isinstance(got["error"], WorkerClosed)
        assert isinstance(conn.err, WorkerClosed) and conn.done.is_set()
        conn.close()
        assert peer.wait_closed()
        with pytest.raises(WorkerClosed) as caught:
            conn.renew(REF)
        assert caught.value.message_id is None
    assert orbit_threads() == []


def test_context_manager_closes_and_repr_shows_state() -> None:
    """`with conn:` closes it; repr names the session and its state."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        with conn as same:
            assert same is conn
            assert SESSION_ID in repr(conn) and "open" in repr(conn)
        assert conn.done.is_set()
        assert "WorkerClosed" in repr(conn)
        assert peer.wait_closed()
    assert orbit_threads() == []


def test_server_disconnect_releases_callers_as_disconnected() -> None:
    """The server closing the socket releases every waiting caller with WorkerDisconnected."""
    from orbit_sync.errors import WorkerDisconnected

    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            mid = new_message_id()
            thread, out = _in_thread(conn.finish, Finish(REF, Outcome.SUCCEEDED, 1), message_id=mid)
            peer.recv()
            peer.conn.close()
            thread.join(WAIT)
            assert isinstance(out["error"], WorkerDisconnected)
            assert out["error"].message_id == mid
            assert conn.done.wait(WAIT)
        finally:
            conn.close()


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda req: welcome_body(epoch="2"), id="capacity-ack-other-epoch"),
        pytest.param(lambda req: welcome_body("9" * 32), id="capacity-ack-other-session"),
        pytest.param(lambda req: welcome_body(window=0), id="capacity-ack-invalid-window"),
    ],
)
def test_capacity_ack_must_name_this_session(answer: Any) -> None:
    """A capacity ack for another session or epoch, or an invalid one, is a protocol error."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            thread, out = _in_thread(conn.capacity, CapacityReport(1, 1))
            request = peer.recv()
            peer.ack(request, answer(request))
            thread.join(WAIT)
            assert isinstance(out["error"], WorkerProtocolError)
            assert conn.done.wait(WAIT) and isinstance(conn.err, WorkerProtocolError)
        finally:
            conn.close()


def test_second_answer_to_the_same_request_is_a_protocol_error() -> None:
    """A duplicate reply (the request is no longer pending) closes the connection."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            thread, out = _in_thread(conn.start, REF)
            request = peer.recv()
            peer.ack(request, command_body("start"))
            peer.ack(request, command_body("start"))
            thread.join(WAIT)
            assert isinstance(out["result"], CommandResult)
            assert conn.done.wait(WAIT)
            assert isinstance(conn.err, WorkerProtocolError)
        finally:
            conn.close()


def test_call_bound_releases_a_caller_stuck_in_a_blocked_write() -> None:
    """A caller blocked inside send (peer not reading) is released by the call bound too."""
    from _scripted import TOKEN, StallingServer, registration, small_send_buffers

    from orbit_sync.client import Client

    with StallingServer() as server:
        # A small send buffer (and the server's tiny receive window) makes this one 250 KiB
        # write block, so the caller never reaches its own wait.
        with small_send_buffers():
            conn = Client(server.url, TOKEN).dial_worker(registration())
        try:
            mid = new_message_id()
            started = time.monotonic()
            with pytest.raises(CallTimeout) as caught:
                conn.finish(
                    Finish(REF, Outcome.SUCCEEDED, "x" * (250 * 1024)), message_id=mid, timeout=0.5
                )
            assert time.monotonic() - started < 3
            assert caught.value.message_id == mid
            assert conn.done.wait(WAIT)
        finally:
            conn.close()
