"""One reader thread per connection, on real sockets: only it reads, callers wait on their slot.

The scripted server writes raw bytes, so several frames can share one TCP segment and a frame can
stop halfway. Idle gaps before a call are the scenario itself (they let every thread of the
connection go back to sleep), not a wait for a condition.
"""

from __future__ import annotations

import functools
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _scripted import (
    LEASE_SECRET,
    WAIT,
    Peer,
    ScriptedServer,
    assignment_body,
    cancel_body,
    command_body,
    frame,
    open_pair,
    orbit_threads,
    raw_frame,
    registration,
)

from orbit_sync.connection import (
    ASSIGNMENT_BUFFER,
    MAX_IN_FLIGHT,
    BatchCall,
    WorkerConnection,
)
from orbit_sync.errors import (
    CallTimeout,
    OrbitError,
    WorkerBackpressure,
    WorkerBusy,
    WorkerClosed,
    WorkerDisconnected,
    WorkerError,
    WorkerProtocolError,
)
from orbit_sync.models import AttemptRef, CommandResult

REF = AttemptRef("1" * 32, "2" * 32, 1, LEASE_SECRET)
TEXT = 0x1
CLOSE = 0x8

#: The connection's timers in the gap tests, so that one gap can outlast all of them.
CALL_BOUND = 0.5
READ_IDLE = 0.6


def _text(value: dict[str, Any]) -> bytes:
    """One unmasked text frame carrying *value*."""
    return raw_frame(TEXT, json.dumps(value).encode())


def _ack(request: dict[str, Any], operation: str = "renew") -> bytes:
    return _text(frame("ack", reply_to=request["message_id"], body=command_body(operation)))


def _idle(conn: WorkerConnection, peer: Peer, gap: float) -> None:
    """No request in flight for *gap* seconds. A gap longer than the read-idle bound is kept
    alive by an assignment every 0.2 s, taken at once, and ends with 0.1 s of silence: the
    reader is back to waiting on the socket when the next call comes."""
    end = time.monotonic() + gap
    while end - time.monotonic() > 0.3:
        time.sleep(0.2)  # the gap itself, not a wait for a condition
        peer.send_raw(_text(frame("task.assign", body=assignment_body())))
        assert conn.next_assignment(timeout=WAIT).attempt_id == "2" * 32
    time.sleep(max(0.0, end - time.monotonic()))


def _run(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run *fn* on a daemon thread; the dict gets 'result' or 'error'."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=body, name="test-caller", daemon=True)
    thread.start()
    return thread, out


@pytest.fixture
def pair() -> Iterator[tuple[WorkerConnection, Peer]]:
    """A connection without push callbacks (every push is queued) and its scripted peer."""
    with ScriptedServer() as server:
        conn, peer = open_pair(server, max_call_timeout=CALL_BOUND, read_idle_timeout=READ_IDLE)
        try:
            yield conn, peer
        finally:
            conn.close()


@pytest.mark.parametrize("callers", [2, 8])
@pytest.mark.parametrize(
    ("gap", "rounds"),
    [(0.002, 10), (0.05, 10), (0.7, 2)],
    ids=["gap-shorter-than-every-timer", "gap-50ms", "gap-longer-than-every-timer"],
)
def test_callers_after_an_idle_gap_all_get_their_answers_from_one_segment(
    pair: tuple[WorkerConnection, Peer], callers: int, gap: float, rounds: int
) -> None:
    """After an idle gap, concurrent callers whose answers arrive in one TCP segment are all
    answered, round after round, and nothing is left unread."""
    conn, peer = pair
    for _ in range(rounds):
        _idle(conn, peer, gap)
        runs = [_run(lambda: conn.renew(REF)) for _ in range(callers)]
        requests = [peer.recv() for _ in range(callers)]
        peer.send_raw(b"".join(_ack(r) for r in requests))
        for thread, out in runs:
            thread.join(WAIT)
            assert isinstance(out.get("result"), CommandResult), out
    assert conn.err is None


def _nine_assignments() -> bytes:
    ids = [f"{i + 1:032x}" for i in range(ASSIGNMENT_BUFFER + 1)]
    return b"".join(_text(frame("task.assign", body=assignment_body(attempt_id=i))) for i in ids)


#: A push that must end the connection once the reader handles it, and the error it ends with.
PUSHES: dict[str, tuple[Callable[[], bytes], type[OrbitError]]] = {
    # One more assignment than the buffer holds: WorkerBackpressure.
    "assignment": (_nine_assignments, WorkerBackpressure),
    # The registration did not ask for cancel notices: a protocol violation.
    "cancel": (lambda: _text(frame("task.cancel", body=cancel_body())), WorkerProtocolError),
    # An error with no reply_to ends the session.
    "error": (
        lambda: _text(frame("error", error=("STALE_SESSION", "session replaced"))),
        WorkerError,
    ),
    "close": (lambda: raw_frame(CLOSE, (1001).to_bytes(2, "big")), WorkerDisconnected),
}


@pytest.mark.parametrize("push", sorted(PUSHES))
def test_a_push_sharing_a_segment_with_an_answer_is_handled_without_another_call(
    push: str,
) -> None:
    """An answer followed by a push in the same segment: the caller gets its answer and the
    push takes effect at once, with no further call to carry it (on five connections, since
    the push ends each one)."""
    build, error = PUSHES[push]
    with ScriptedServer() as server:
        for _ in range(5):
            conn, peer = open_pair(server)
            try:
                _idle(conn, peer, 0.05)  # the reader is back to waiting on the socket
                thread, out = _run(functools.partial(conn.renew, REF))
                peer.send_raw(_ack(peer.recv()) + build())
                thread.join(WAIT)
                assert isinstance(out.get("result"), CommandResult), out
                assert conn.done.wait(WAIT), "the push was left unread"
                assert isinstance(conn.err, error)
            finally:
                conn.close()


def test_a_push_callback_that_closes_the_connection_ends_it_without_a_deadlock() -> None:
    """An on_assignment callback that calls close() (on the reader) while a batched and a
    blocking request wait ends the connection: each gets WorkerClosed with its own message_id
    and no thread hangs."""
    holder: dict[str, WorkerConnection] = {}
    closed = threading.Event()

    def on_assignment(assignment: Any) -> None:
        holder["conn"].close()
        closed.set()

    with ScriptedServer() as server:
        conn, peer = open_pair(server, on_assignment=on_assignment)
        holder["conn"] = conn
        [batched] = conn.send_many([BatchCall("task.renew", REF)])
        assert peer.recv()["message_id"] == batched.message_id
        thread, out = _run(lambda: conn.renew(REF))
        blocked = peer.recv()
        peer.send_raw(_text(frame("task.assign", body=assignment_body())))
        assert closed.wait(WAIT), "close() from the callback did not return"
        thread.join(WAIT)
        assert not thread.is_alive()
        assert isinstance(out.get("error"), WorkerClosed)
        assert out["error"].message_id == blocked["message_id"]
        with pytest.raises(WorkerClosed) as caught:
            batched.result()
        assert caught.value.message_id == batched.message_id
        assert conn.done.wait(WAIT)
        conn.close()  # from the test thread: joins the reader, which has exited
    assert orbit_threads() == []


@pytest.mark.parametrize("callback", ["on_cancel", "on_assignment"])
def test_a_request_from_a_push_callback_fails_at_once(callback: str) -> None:
    """A request made from a push callback (the reader thread) raises RuntimeError at once,
    blocking or batched (the reader only reads), instead of waiting out its bound or writing;
    a request in flight meanwhile is answered and the connection stays open."""
    seen: dict[str, BaseException] = {}
    ran = threading.Event()
    holder: dict[str, WorkerConnection] = {}

    def on_push(item: Any) -> None:
        conn = holder["conn"]
        # The queue wait is the one this callback does not take over.
        wait = conn.next_cancel if callback == "on_assignment" else conn.next_assignment
        for name, call in (
            ("renew", lambda: conn.renew(REF, timeout=CALL_BOUND)),
            ("queue wait", lambda: wait(timeout=CALL_BOUND)),
            ("send_many", lambda: conn.send_many([BatchCall("task.renew", REF)])),
            ("empty send_many", lambda: conn.send_many([])),
        ):
            try:
                call()
            except BaseException as exc:
                seen[name] = exc
        ran.set()

    callbacks: dict[str, Any] = {callback: on_push}
    with ScriptedServer() as server:
        conn, peer = open_pair(
            server,
            registration(cancellation_notifications=True),
            max_call_timeout=CALL_BOUND,
            **callbacks,
        )
        holder["conn"] = conn
        try:
            thread, out = _run(lambda: conn.renew(REF))
            in_flight = peer.recv()
            if callback == "on_cancel":
                peer.send_raw(_text(frame("task.cancel", body=cancel_body())))
            else:
                peer.send_raw(_text(frame("task.assign", body=assignment_body())))
            assert ran.wait(WAIT)
            peer.send_raw(_ack(in_flight))
            thread.join(WAIT)
            for name in ("renew", "queue wait", "send_many", "empty send_many"):
                assert isinstance(seen.get(name), RuntimeError), seen
                assert "reader thread" in str(seen[name])
            assert isinstance(out.get("result"), CommandResult), out
            [probe] = conn.send_many([BatchCall("task.renew", REF)])
            request = peer.recv()
            assert request["message_id"] == probe.message_id  # the callback sent nothing
            peer.send_raw(_ack(request))
            assert isinstance(probe.result(), CommandResult)
            assert conn.err is None
        finally:
            conn.close()


def _half(data: bytes) -> tuple[bytes, bytes]:
    cut = len(data) // 2
    return data[:cut], data[cut:]


def test_a_server_stalling_mid_frame_times_out_the_waiting_call(
    pair: tuple[WorkerConnection, Peer],
) -> None:
    """Half an answer, then silence: the caller gets CallTimeout (its bound), the connection
    closes, and the caller's thread is not left reading."""
    conn, peer = pair
    thread, out = _run(lambda: conn.renew(REF, timeout=0.2))
    head, _ = _half(_ack(peer.recv()))
    peer.send_raw(head)
    thread.join(WAIT)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), CallTimeout), out
    assert conn.done.wait(WAIT)


def test_a_server_stalling_mid_frame_does_not_hold_a_queue_wait_past_its_timeout(
    pair: tuple[WorkerConnection, Peer],
) -> None:
    """Half an assignment, then silence: next_assignment(timeout) returns TimeoutError at its
    timeout with the connection open, and the assignment arrives once the rest is sent."""
    conn, peer = pair
    head, tail = _half(_text(frame("task.assign", body=assignment_body())))
    _idle(conn, peer, 0.05)
    thread, out = _run(lambda: conn.next_assignment(timeout=0.3))
    time.sleep(0.05)  # the scenario: the half frame comes while the caller already waits
    peer.send_raw(head)
    thread.join(WAIT)
    assert not thread.is_alive(), "the wait outlived its timeout"
    error = out.get("error")
    assert isinstance(error, TimeoutError) and not isinstance(error, OrbitError), out
    assert conn.err is None
    peer.send_raw(tail)
    assert conn.next_assignment(timeout=WAIT).attempt_id == "2" * 32


@pytest.fixture
def interruptible() -> Iterator[Callable[[], None]]:
    """A function that sends SIGINT to this (the main) thread, as Ctrl-C would."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.main_thread().ident
    assert main is not None
    try:
        yield lambda: signal.pthread_kill(main, signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_in_a_waiting_request_abandons_only_its_slot(
    pair: tuple[WorkerConnection, Peer], interruptible: Callable[[], None]
) -> None:
    """KeyboardInterrupt while a request waits and half its answer is on the wire: the rest
    still arrives in frame, the connection stays open and the next request is answered."""
    conn, peer = pair
    parts: list[bytes] = []

    def server() -> None:
        parts.extend(_half(_ack(peer.recv())))
        peer.send_raw(parts[0])
        interruptible()

    helper = threading.Thread(target=server, daemon=True)
    with pytest.raises(KeyboardInterrupt):
        helper.start()
        conn.renew(REF, timeout=WAIT)
    helper.join(WAIT)
    peer.send_raw(parts[1])
    thread, out = _run(lambda: conn.renew(REF))
    peer.send_raw(_ack(peer.recv()))
    thread.join(WAIT)
    assert isinstance(out.get("result"), CommandResult), out
    assert conn.err is None


def test_calls_hold_reused_event_slots_capped_at_the_in_flight_limit(
    pair: tuple[WorkerConnection, Peer],
) -> None:
    """Sequential calls reuse one Event slot; a batch of 32 holds 32, a 33rd request is refused
    without one, and every slot is idle again once its result is read."""
    conn, peer = pair
    idle = conn._slots  # the connection's idle slots (one list, kept for its life)
    for _ in range(3):
        thread, out = _run(lambda: conn.renew(REF))
        peer.send_raw(_ack(peer.recv()))
        thread.join(WAIT)
        assert isinstance(out.get("result"), CommandResult), out
    assert len(idle) == 1
    assert isinstance(idle[0].event, threading.Event)
    calls = conn.send_many([BatchCall("task.renew", REF) for _ in range(MAX_IN_FLIGHT)])
    assert idle == []
    [refused] = conn.send_many([BatchCall("task.renew", REF)])
    assert refused.message_id is None
    with pytest.raises(WorkerBusy):
        refused.result()
    assert idle == [], "a refused request took a slot"
    requests = [peer.recv() for _ in range(MAX_IN_FLIGHT)]
    peer.send_raw(b"".join(_ack(request) for request in requests))
    assert all(isinstance(call.result(), CommandResult) for call in calls)
    assert len({id(slot) for slot in idle}) == MAX_IN_FLIGHT


def test_ctrl_c_as_the_write_holds_it_sends_nothing_and_leaves_ctrl_c_working(
    pair: tuple[WorkerConnection, Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C that lands just before the main thread's write holds it raises as the mask call
    returns: nothing is sent, SIGINT is not left blocked, and the next request is answered."""
    conn, peer = pair
    real = signal.pthread_sigmask
    landed: list[bool] = []

    def mask_then_interrupt(how: int, mask: Any) -> Any:
        previous = real(how, mask)
        if how == signal.SIG_BLOCK and not landed:
            landed.append(True)
            raise KeyboardInterrupt  # raised where a pending Ctrl-C is: as the call returns
        return previous

    monkeypatch.setattr(signal, "pthread_sigmask", mask_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        conn.renew(REF, timeout=WAIT)
    assert signal.SIGINT not in real(signal.SIG_BLOCK, []), "Ctrl-C left blocked"
    thread, out = _run(lambda: conn.renew(REF))
    request = peer.recv()  # the first frame on the wire is the second request's
    peer.send_raw(_ack(request))
    thread.join(WAIT)
    assert isinstance(out.get("result"), CommandResult), out
    assert conn.err is None


def test_ctrl_c_in_next_assignment_leaves_the_stream_in_frame(
    pair: tuple[WorkerConnection, Peer], interruptible: Callable[[], None]
) -> None:
    """KeyboardInterrupt in next_assignment while half an assignment is on the wire: the
    assignment is delivered whole afterwards and the connection stays open."""
    conn, peer = pair
    head, tail = _half(_text(frame("task.assign", body=assignment_body())))

    def server() -> None:
        # The scenario: half a frame comes while the caller waits, then Ctrl-C.
        time.sleep(0.05)
        peer.send_raw(head)
        time.sleep(0.05)
        interruptible()

    _idle(conn, peer, 0.05)
    helper = threading.Thread(target=server, daemon=True)
    with pytest.raises(KeyboardInterrupt):
        helper.start()
        conn.next_assignment(timeout=WAIT)
    helper.join(WAIT)
    peer.send_raw(tail)
    assert conn.next_assignment(timeout=WAIT).attempt_id == "2" * 32
    assert conn.err is None


def test_ctrl_c_during_a_stuck_write_never_leaves_half_a_frame_on_an_open_connection(
    interruptible: Callable[[], None],
) -> None:
    """Ctrl-C while the main thread is blocked writing a large frame: the write is not cut
    short; the call bound ends the connection, then KeyboardInterrupt is raised. An open
    connection with half a frame on the wire would corrupt every later request."""
    from _scripted import TOKEN, StallingServer, registration, small_send_buffers

    from orbit_sync.client import Client
    from orbit_sync.models import Finish, Outcome

    with StallingServer() as server:
        # A small send buffer and the server's tiny receive window make this 250 KiB write block.
        with small_send_buffers():
            conn = Client(server.url, TOKEN).dial_worker(registration())
        try:
            timer = threading.Timer(0.2, interruptible)  # the scenario: Ctrl-C mid-write
            timer.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    conn.finish(Finish(REF, Outcome.SUCCEEDED, "x" * (250 * 1024)), timeout=1.0)
            finally:
                timer.join(WAIT)
            # Raised only once the write had ended the connection, never while it was open.
            assert isinstance(conn.err, CallTimeout), "open with half a frame written"
            assert conn.done.wait(WAIT)
        finally:
            conn.close()


def test_close_does_not_wait_for_ever_on_a_callback_that_blocks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An on_assignment callback that blocks keeps the reader: close() from another thread
    still returns after its bound, says why, and ``done`` is set once the callback returns."""
    import orbit_sync.connection as connection_module

    monkeypatch.setattr(connection_module, "READER_EXIT_WAIT", 0.2)
    entered, release = threading.Event(), threading.Event()

    def stuck(assignment: object) -> None:
        entered.set()
        release.wait(WAIT)

    with ScriptedServer() as server:
        conn, peer = open_pair(server, on_assignment=stuck)
        try:
            peer.send_raw(_text(frame("task.assign", body=assignment_body())))
            assert entered.wait(WAIT)
            closer, out = _run(conn.close)
            closer.join(WAIT)
            assert not closer.is_alive() and "error" not in out, "close() waited on the callback"
            assert not conn.done.is_set()  # the reader is still inside the callback
            assert "still inside a callback" in caplog.text
        finally:
            release.set()
        assert conn.done.wait(WAIT)
