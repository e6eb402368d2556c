"""MockOrbitServer over real loopback WebSockets: handshake, sessions, attempts, recovery,
cancellation, limits and lifecycle, driven by a raw client that checks every server frame with
the SDK's own client-side decoder."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from _independent import parse_time
from _rawclient import RawClient, error_code, small_window_socket
from _scripted import registration
from _serverkit import SCOPE_CONNECT
from websockets.exceptions import InvalidStatus

from orbit_sync.client import Client
from orbit_sync.models import (
    CapacityReport,
    Finish,
    Lease,
    TaskState,
    new_message_id,
    new_secret,
)
from orbit_sync.testing import ManualClock, MockOrbitServer

VECTORS = json.loads((Path(__file__).parent / "vectors" / "frames.json").read_text("utf-8"))


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A server on a manual clock with no assignment rate limit."""
    with MockOrbitServer(clock=ManualClock(), assignment_rate=None) as srv:
        yield srv


def _status(server: MockOrbitServer, **kw: Any) -> int:
    with pytest.raises(InvalidStatus) as info:
        RawClient(server, **kw).connect()
    return info.value.response.status_code


# --------------------------------------------------------------------------- handshake


def test_upgrade_requires_a_valid_token(server: MockOrbitServer) -> None:
    """No token or an unknown token is 401; a token without workers:connect is 403."""
    assert _status(server, token="") == 401
    assert _status(server, token="not-a-token") == 401
    assert _status(server, token=server.add_token({"workers:consume"})) == 403
    RawClient(server, token=server.add_token({SCOPE_CONNECT})).connect().close()


def test_upgrade_requires_the_subprotocol(server: MockOrbitServer) -> None:
    """A client that does not offer pulse.worker.v1 is refused; one that does gets it."""
    assert _status(server, subprotocols=[]) == 400
    assert _status(server, subprotocols=["chat"]) == 400
    client = RawClient(server).connect()
    assert client.ws is not None and client.ws.subprotocol == "pulse.worker.v1"
    client.close()


def test_upgrade_path_and_query(server: MockOrbitServer) -> None:
    """Only /v1/worker/connect upgrades; a query string is refused."""
    with pytest.raises(InvalidStatus) as info:
        RawClient(server).connect("/v1/other")
    assert info.value.response.status_code == 404
    with pytest.raises(InvalidStatus) as info:
        RawClient(server).connect("/v1/worker/connect?token=x")
    assert info.value.response.status_code == 400


def _http_get(server: MockOrbitServer, path: str) -> tuple[int, bytes]:
    host, port = server.url.removeprefix("ws://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_admin_paths_are_delegated() -> None:
    """Requests under /admin/ go to admin_handler; without one (or on None) they are 404."""
    seen: list[str] = []

    def admin(srv: MockOrbitServer, connection: Any, request: Any) -> Any:
        seen.append(request.path)
        if request.path == "/admin/ping":
            return connection.respond(200, f"{srv.queue_id}\n")
        return None

    with MockOrbitServer(admin_handler=admin) as srv:
        status, data = _http_get(srv, "/admin/ping")
        assert status == 200 and data.decode().strip() == srv.queue_id
        assert _http_get(srv, "/admin/unknown")[0] == 404
    assert seen == ["/admin/ping", "/admin/unknown"]
    with MockOrbitServer() as srv:
        assert _http_get(srv, "/admin/ping")[0] == 404


def test_hello_deadline_closes_silent_connections() -> None:
    """A connection that sends no hello within the deadline is closed."""
    with MockOrbitServer(hello_timeout=0.2) as srv:
        client = RawClient(srv).connect()
        started = time.monotonic()
        client.wait_closed(timeout=5)
        assert time.monotonic() - started < 4
        assert any(e.kind == "connection.hello_timeout" for e in srv.events())


def test_read_idle_closes_the_connection() -> None:
    """A session that stays silent past the read-idle bound is closed."""
    with MockOrbitServer(read_idle_timeout=0.3) as srv:
        client = RawClient(srv).connect()
        client.hello()
        client.wait_closed(timeout=5)
        assert any(e.kind == "connection.read_idle" for e in srv.events())


def test_connection_limit(server: MockOrbitServer) -> None:
    """Past max_connections the upgrade is answered 503; a freed slot is reusable."""
    with MockOrbitServer(max_connections=2) as srv:
        a = RawClient(srv).connect()
        b = RawClient(srv).connect()
        a.hello()
        assert _status(srv) == 503
        a.close()
        srv.wait_until(lambda s: not [x for x in s.sessions() if x.connected])
        c = RawClient(srv).connect()
        assert c.hello()["type"] == "worker.welcome"
        b.close()
        c.close()


def test_wss(tmp_path: Path) -> None:
    """With an ssl_context the server speaks wss:// with a verifiable certificate."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    # The SDK's own client, not the raw one: websockets' sync client starts its reading thread
    # before it writes the upgrade request, and OpenSSL forbids reading and writing one TLS
    # connection from two threads at once; the server's session tickets arriving meanwhile
    # lost the request now and then (docs/reliability.md, "TLS and threads"). Generous
    # handshake deadlines: this test is about TLS, not deadlines, on a loaded 2-core machine.
    with MockOrbitServer(ssl_context=server_ctx, clock=ManualClock(), handshake_timeout=20) as srv:
        assert srv.url.startswith("wss://127.0.0.1:")
        task_id = srv.enqueue("resize", {"n": 1})
        reg = registration(queue_id=srv.queue_id, capacity=1)
        client = Client(srv.url, srv.token, ssl_context=client_ctx)
        with client.dial_worker(reg, timeout=20) as conn:
            conn.capacity(CapacityReport(sequence=1, capacity=1))
            assignment = conn.next_assignment(timeout=10)
            assert conn.start(assignment.attempt).lease.may_run()
            conn.finish(Finish(ref=assignment.attempt, outcome="SUCCEEDED", result={"n": 1}))
        assert srv.wait_for(task_id, ["SUCCEEDED"]).state is TaskState.SUCCEEDED


# --------------------------------------------------------------------------- frames


def test_invalid_frame_with_readable_id(server: MockOrbitServer) -> None:
    """A malformed request is answered INVALID_FRAME with reply_to, then the connection closes."""
    client = RawClient(server, strict=False).connect()
    client.hello()
    mid = new_message_id()
    client.send_text(
        json.dumps(
            {
                "protocol_version": "1",
                "type": "task.start",
                "message_id": mid,
                "session_id": client.session_id,
                "body": {"task_id": "x"},
            }
        )
    )
    frame = client.recv()
    assert error_code(frame) == "INVALID_FRAME"
    assert frame["reply_to"] == mid and frame["session_id"] == client.session_id
    client.wait_closed()


def test_invalid_frame_without_readable_id(server: MockOrbitServer) -> None:
    """Unparsable JSON is answered INVALID_FRAME without reply_to, then closed."""
    client = RawClient(server, strict=False).connect()
    client.send_text('{"message_id": "abc", "message_id": "abc"}')
    frame = client.recv()
    assert error_code(frame) == "INVALID_FRAME" and "reply_to" not in frame
    assert "session_id" not in frame
    client.wait_closed()


def test_binary_frames_are_invalid(server: MockOrbitServer) -> None:
    """A binary frame is INVALID_FRAME."""
    client = RawClient(server, strict=False).connect()
    client.send_text(b'{"type": "worker.hello"}')
    assert error_code(client.recv()) == "INVALID_FRAME"
    client.wait_closed()


def test_first_frame_must_be_hello(server: MockOrbitServer) -> None:
    """A request before worker.hello is INVALID_FRAME."""
    client = RawClient(server, strict=False).connect()
    client.session_id = "3" * 32
    frame = client.request("worker.capacity", {"sequence": "1", "capacity": 1, "drain": False})
    assert error_code(frame) == "INVALID_FRAME"
    client.wait_closed()


@pytest.mark.parametrize(
    "vector",
    [v for v in VECTORS["client_to_server"] if not v["valid"]],
    ids=lambda v: v["name"],
)
def test_invalid_client_vectors_get_invalid_frame(
    server: MockOrbitServer, vector: dict[str, Any]
) -> None:
    """Every invalid client vector is answered INVALID_FRAME (reply_to = its id) and closed."""
    client = RawClient(server, strict=False).connect()
    client.send_text(vector["frame"])
    frame = client.recv()
    assert error_code(frame) == "INVALID_FRAME"
    assert frame.get("reply_to") == json.loads(vector["frame"]).get("message_id")
    client.wait_closed()


def test_valid_hello_vectors_pass_validation(server: MockOrbitServer) -> None:
    """Valid hello vectors pass frame validation (refused only for their unknown queue)."""
    for vector in VECTORS["client_to_server"]:
        if vector["valid"] and json.loads(vector["frame"])["type"] == "worker.hello":
            client = RawClient(server, strict=False).connect()
            client.send_text(vector["frame"])
            assert error_code(client.recv()) == "PERMISSION_DENIED"
            client.wait_closed()


def test_oversized_frame_closes(server: MockOrbitServer) -> None:
    """A frame over 512 KiB closes the connection (message too big)."""
    client = RawClient(server, strict=False).connect()
    client.send_text("x" * (512 * 1024 + 1))
    client.wait_closed()


# --------------------------------------------------------------------------- sessions


def test_welcome_and_session_ids_on_every_frame(server: MockOrbitServer) -> None:
    """The welcome names the session in frame and body; every later frame carries it."""
    client = RawClient(server).connect()
    welcome = client.hello()
    assert welcome["session_id"] == welcome["body"]["session_id"]
    assert welcome["body"]["epoch"] == "1" and welcome["body"]["lease_duration_ms"] == 30000
    ack = client.capacity(1, 2)
    assert ack["session_id"] == client.session_id == ack["body"]["session_id"]
    server.enqueue("resize", {"n": 1})
    assert client.next_push()["session_id"] == client.session_id


def test_reconnect_stales_the_old_connection(server: MockOrbitServer) -> None:
    """A new connection of the same process pushes STALE_SESSION to the old one and closes it."""
    first = RawClient(server).open()
    second = first.reconnect().connect()
    assert second.hello()["body"]["epoch"] == "2"
    notice = first.recv()
    assert error_code(notice) == "STALE_SESSION" and "reply_to" not in notice
    assert notice["session_id"] == first.session_id
    first.wait_closed()
    stale = [s for s in server.sessions() if s.session_id == first.session_id]
    assert stale[0].stale


def test_identity_mismatch_is_refused(server: MockOrbitServer) -> None:
    """A reconnect with the same instance_id and another secret is PERMISSION_DENIED."""
    import attrs

    first = RawClient(server).open()
    thief = RawClient(
        server,
        registration=attrs.evolve(first.registration, instance_secret=new_secret()),
    ).connect()
    assert error_code(thief.hello()) == "PERMISSION_DENIED"
    thief.wait_closed()
    assert first.capacity(2, 4)["type"] == "ack"  # the real process is untouched


def test_hello_without_consume_scope(server: MockOrbitServer) -> None:
    """A token with workers:connect only connects but its hello is PERMISSION_DENIED."""
    client = RawClient(server, token=server.add_token({SCOPE_CONNECT})).connect()
    frame = client.hello()
    assert error_code(frame) == "PERMISSION_DENIED" and "session_id" not in frame
    client.wait_closed()


def test_no_assignment_before_capacity(server: MockOrbitServer) -> None:
    """Nothing is pushed until the first capacity report is acknowledged."""
    task_id = server.enqueue("resize", {"n": 1})
    client = RawClient(server).connect()
    client.hello()
    assert server.task(task_id).state is TaskState.WAITING
    ack = client.capacity(1, 1)
    assert ack["type"] == "ack"
    assert client.next_push()["body"]["task"]["task_id"] == task_id


def test_capacity_conflicts_and_drain(server: MockOrbitServer) -> None:
    """Sequence conflicts and clearing drain are STATE_CONFLICT; drain survives reconnects."""
    client = RawClient(server).connect()
    client.hello()
    assert client.capacity(3, 2)["type"] == "ack"
    assert error_code(client.capacity(3, 1)) == "STATE_CONFLICT"
    assert error_code(client.capacity(2, 2)) == "STATE_CONFLICT"
    assert client.capacity(4, 2, drain=True)["body"]["draining"] is True
    assert error_code(client.capacity(5, 2, drain=False)) == "STATE_CONFLICT"
    again = client.reconnect().connect()
    assert again.hello()["body"]["draining"] is True


def test_session_expiry_over_socket(server: MockOrbitServer) -> None:
    """Advancing past the session window closes the connection with STALE_SESSION."""
    client = RawClient(server).open()
    server.advance(46)
    notice = client.recv()
    assert error_code(notice) == "STALE_SESSION" and "reply_to" not in notice
    client.wait_closed()


# --------------------------------------------------------------------------- attempts


def test_full_attempt_lifecycle(server: MockOrbitServer) -> None:
    """assign -> start -> renew -> finish, with snapshots following along."""
    client = RawClient(server).open()
    task_id = server.enqueue("resize", {"w": 2})
    assign = client.next_push()
    ref = client.ref(assign)
    start = client.start(ref)["body"]
    assert start["lease"]["active"] is True and start["lease"]["state"] == "RUNNING"
    server.advance(10)
    renew = client.renew(ref)["body"]
    assert parse_time(renew["lease"]["lease_until"]) > parse_time(start["lease"]["lease_until"])
    done = client.finish(ref, result={"out": 1})["body"]
    assert done["receipt"]["task_state"] == "SUCCEEDED"
    snap = server.wait_for(task_id, {"SUCCEEDED"})
    assert snap.result == {"out": 1} and snap.attempts[0].state.value == "SUCCEEDED"
    server.check_invariants()


def test_resume_and_replay_after_reconnect(server: MockOrbitServer) -> None:
    """After a lost answer the client reconnects, resumes and replays the same message_id."""
    client = RawClient(server).open()
    task_id = server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    client.start(ref)
    dropped = server.faults.drop_reply("task.finish")
    mid = client.send("task.finish", _finish_body(ref))
    assert dropped.wait(5)
    assert server.task(task_id).state is TaskState.SUCCEEDED
    server.disconnect(client.session_id)
    client.wait_closed()
    again = client.reconnect().connect()
    again.hello()
    lease = again.resume(ref)["body"]
    assert lease["active"] is False and lease["state"] == "SUCCEEDED"
    replay = again.request("task.finish", _finish_body(ref), message_id=mid)["body"]
    assert replay["deduplicated"] is True
    assert replay["receipt"]["disposition"] == "APPLIED"
    conflict = again.request("task.finish", _finish_body(ref, "FAILED", "X"), message_id=mid)
    assert error_code(conflict) == "IDEMPOTENCY_CONFLICT"
    server.check_invariants()


def _finish_body(ref: Any, outcome: str = "SUCCEEDED", code: str | None = None) -> Finish:
    return Finish(ref=ref, outcome=outcome, result={"ok": True}, error_code=code)


def test_resume_moves_live_attempt_to_new_session(server: MockOrbitServer) -> None:
    """A running attempt resumed on a new session keeps its lease and can be renewed there."""
    client = RawClient(server).open()
    task_id = server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    client.start(ref)
    again = client.reconnect().connect()
    again.hello()
    assert error_code(again.renew(ref)) == "LEASE_LOST"
    lease = again.resume(ref)["body"]
    assert lease["active"] is True and lease["state"] == "RUNNING"
    assert again.renew(ref)["body"]["lease"]["active"] is True
    assert server.task(task_id).attempts[0].session_id == again.session_id


def test_late_result_is_evidence(server: MockOrbitServer) -> None:
    """A finish after the lease expired is EVIDENCE_ONLY and inspectable."""
    client = RawClient(server).open()
    task_id = server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    client.start(ref)
    server.advance(32)
    assert server.task(task_id).state is TaskState.NEEDS_REVIEW
    answer = client.finish(ref, result={"late": True})["body"]
    assert answer["receipt"]["disposition"] == "EVIDENCE_ONLY"
    (ev,) = server.task(task_id).evidence
    assert ev.reason == "late" and ev.result == {"late": True}


def test_wrong_secret_is_lease_lost(server: MockOrbitServer) -> None:
    """A forged lease_secret is LEASE_LOST and the connection stays usable."""
    import attrs

    client = RawClient(server).open()
    server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    assert error_code(client.start(attrs.evolve(ref, lease_secret=new_secret()))) == "LEASE_LOST"
    assert client.start(ref)["type"] == "ack"


def test_capacity_shared_across_sessions_over_socket(server: MockOrbitServer) -> None:
    """A process with capacity 1 gets nothing new on a new session while it still holds one."""
    client = RawClient(server, capacity=1).open()
    first = server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    second = server.enqueue("resize", {"n": 2})
    again = client.reconnect().connect()
    again.hello()
    again.resume(ref)
    again.capacity(2, 1)
    assert server.task(second).state is TaskState.WAITING
    again.start(ref)
    again.finish(ref)
    assert server.wait_for(first, {"SUCCEEDED"})
    assert again.next_push()["body"]["task"]["task_id"] == second


# --------------------------------------------------------------------------- recovery, policy


def test_real_time_scheduler_recovers_without_advance() -> None:
    """On the real clock the scheduler thread expires leases by itself (scan every 2 s)."""
    with MockOrbitServer(lease_duration=1.0, assignment_rate=None) as srv:
        client = RawClient(srv).open()
        task_id = srv.enqueue("resize", {"n": 1}, max_attempts=1)
        client.next_push()
        snap = srv.wait_for(task_id, {"FAILED"}, timeout=6)
        assert snap.error_code == "LEASE_EXPIRED" and snap.attempts[0].state.value == "EXPIRED"


def test_backoff_retry_over_socket(server: MockOrbitServer) -> None:
    """A retryable failure comes back as attempt 2 after its backoff."""
    client = RawClient(server).open()
    task_id = server.enqueue("resize", {"n": 1}, backoff_initial=3)
    ref = client.ref(client.next_push())
    client.start(ref)
    client.finish(ref, "FAILED", {}, "TRANSIENT", True)
    assert server.task(task_id).state is TaskState.WAITING
    server.advance(3)
    assign = client.next_push()
    assert assign["body"]["task"]["attempt"] == "2" and assign["body"]["epoch"] == "2"


def test_wait_for_times_out(server: MockOrbitServer) -> None:
    """wait_for raises TimeoutError when the state is not reached."""
    task_id = server.enqueue("resize", {"n": 1})
    with pytest.raises(TimeoutError, match="WAITING"):
        server.wait_for(task_id, {"SUCCEEDED"}, timeout=0.05)


def test_wait_for_wakes_on_change(server: MockOrbitServer) -> None:
    """wait_for returns as soon as another thread changes the task."""
    task_id = server.enqueue("resize", {"n": 1})
    timer = threading.Timer(0.05, server.request_cancel, args=(task_id,))
    timer.start()
    try:
        assert server.wait_for(task_id, {"CANCELLED"}, timeout=5).state is TaskState.CANCELLED
    finally:
        timer.join()


# --------------------------------------------------------------------------- cancellation


def test_cancel_push_and_cancelled_finish(server: MockOrbitServer) -> None:
    """A session that asked gets task.cancel; renew stops extending; CANCELLED is accepted."""
    client = RawClient(server, notifications=True).open()
    task_id = server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    client.start(ref)
    server.request_cancel(task_id)
    notice = client.next_push("task.cancel")
    assert notice["body"]["attempt_id"] == ref.attempt_id
    renewed = client.renew(ref)["body"]["lease"]
    assert renewed["cancel_requested_at"] == notice["body"]["cancel_requested_at"]
    client.finish(ref, "CANCELLED", {}, "STOPPED")
    assert server.task(task_id).state is TaskState.CANCELLED


# --------------------------------------------------------------------------- limits


def test_rate_and_concurrency_limits_over_socket() -> None:
    """Assignments respect the per-second rate and the queue's max_concurrency."""
    clock = ManualClock()
    with MockOrbitServer(clock=clock, assignment_rate=2, max_concurrency=3) as srv:
        client = RawClient(srv, capacity=10).open()
        ids = [srv.enqueue("resize", {"n": i}) for i in range(6)]
        leased = [t for t in srv.tasks() if t.state is TaskState.LEASED]
        assert len(leased) == 2
        srv.advance(1)
        assert len([t for t in srv.tasks() if t.state is TaskState.LEASED]) == 3
        refs = [client.ref(client.next_push()) for _ in range(3)]
        client.start(refs[0])
        client.finish(refs[0])
        srv.advance(1)
        assert len([t for t in srv.tasks() if t.state is TaskState.LEASED]) == 3
        assert client.next_push()["body"]["task"]["task_id"] == ids[3]


def test_pause_over_socket(server: MockOrbitServer) -> None:
    """A paused queue refuses start with UNAVAILABLE until resumed."""
    client = RawClient(server).open()
    server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    server.pause_queue()
    mid = new_message_id()
    assert error_code(client.start(ref, message_id=mid)) == "UNAVAILABLE"
    server.resume_queue()
    assert client.start(ref, message_id=mid)["body"]["deduplicated"] is False


def test_request_rate_limited_over_socket() -> None:
    """Past the request rate the answer is RATE_LIMITED and the connection stays open."""
    with MockOrbitServer(clock=ManualClock(), request_rate=2) as srv:
        client = RawClient(srv).open()
        assert client.capacity(1, 4)["type"] == "ack"
        assert error_code(client.capacity(1, 4)) == "RATE_LIMITED"
        srv.advance(1)
        assert client.capacity(1, 4)["type"] == "ack"


def _stalled_client(server: MockOrbitServer) -> RawClient:
    """A session whose client stops reading at once, over a small receive window."""
    client = RawClient(server, strict=False)
    client.connect(max_queue=1, sock=small_window_socket(server))
    client.hello()
    return client


#: A few of these fill a small window, the frames a stopped client has buffered and the server's
#: socket buffer (a few MiB on loopback): the writer sending them then gets stuck in the socket.
_PAD = json.dumps({"pad": "x" * (4 * 1024 * 1024)})


def _disconnected(server: MockOrbitServer) -> bool:
    return not any(s.connected for s in server.sessions())


@pytest.mark.parametrize("seconds", [0, -1.0, float("inf"), float("nan")])
def test_write_timeout_is_positive_and_finite(seconds: float) -> None:
    """write_timeout must be a positive, finite number of seconds."""
    with pytest.raises(ValueError, match="write_timeout"):
        MockOrbitServer(write_timeout=seconds)


def test_answers_wait_out_a_short_stall() -> None:
    """A link that takes nothing for less than write_timeout delays answers, never drops them."""
    with MockOrbitServer(clock=ManualClock(), assignment_rate=None, write_timeout=2.0) as srv:
        client = RawClient(srv).open()
        srv.faults.delay_reply("worker.capacity", seconds=0.3)  # the writer holds the first
        sent = [client.send("worker.capacity", CapacityReport(1, 4, False)) for _ in range(16)]
        assert [client.answer(mid)["type"] for mid in sent] == ["ack"] * 16
        assert srv.sessions()[0].connected
        assert not any(e.kind == "connection.slow_consumer" for e in srv.events())


def test_slow_consumer_is_disconnected() -> None:
    """An answer that finds no room within write_timeout disconnects the client."""
    with MockOrbitServer(clock=ManualClock(), assignment_rate=None, write_timeout=0.3) as srv:
        client = RawClient(srv).open()
        srv.faults.delay_reply("worker.capacity", seconds=3.0)  # a link that takes nothing
        started = time.monotonic()
        for _ in range(10):  # one held by the writer, 8 queued, one that finds no room
            client.send("worker.capacity", CapacityReport(1, 4, False))
        srv.wait_until(_disconnected, timeout=5)
        assert 0.3 <= time.monotonic() - started < 3.0
        kinds = [e.kind for e in srv.events() if e.kind.startswith("connection.")]
        assert kinds == ["connection.slow_consumer"]


def test_pushes_to_a_stalled_client_disconnect_it() -> None:
    """A client that stops reading is cut off by a push once its socket took nothing for 0.3 s."""
    with MockOrbitServer(clock=ManualClock(), assignment_rate=None, write_timeout=0.3) as srv:
        client = _stalled_client(srv)
        started = time.monotonic()
        for _ in range(100):  # one push per 20 ms at most: 2 s, then the test fails
            try:
                srv.faults.send_raw(_PAD, client.session_id)
            except LookupError:
                break  # disconnected: no session left to push to
            with contextlib.suppress(TimeoutError):
                srv.wait_until(_disconnected, timeout=0.02)
        srv.wait_until(_disconnected, timeout=1)
        assert time.monotonic() - started >= 0.3
        assert [e.kind for e in srv.events() if e.kind == "connection.slow_consumer"] == [
            "connection.slow_consumer"
        ]
        client.wait_closed()  # read what it buffered, up to the cut


def test_32_requests_in_flight_are_answered(server: MockOrbitServer) -> None:
    """A client that reads promptly gets every answer with 32 requests in flight (PROTOCOL §10)."""
    client = RawClient(server).open()
    report = CapacityReport(1, 4, False)
    pending = {client.send("worker.capacity", report) for _ in range(32)}  # all at once
    answered = 0
    while pending:
        frame = client.recv()
        assert frame["type"] == "ack"
        pending.remove(frame["reply_to"])
        answered += 1
        if answered + len(pending) < 256:  # keep 32 in flight, 256 requests in all
            pending.add(client.send("worker.capacity", report))
    assert answered == 256
    assert server.sessions()[0].connected
    assert not any(e.kind == "connection.slow_consumer" for e in server.events())


def test_cancel_notices_amid_32_requests_in_flight(server: MockOrbitServer) -> None:
    """Cancel notices that find the outbox full of answers still reach a prompt reader."""
    client = RawClient(server, capacity=16, notifications=True).open()
    task_ids = [server.enqueue("resize", {"n": i}) for i in range(16)]
    for ref in [client.ref(client.next_push()) for _ in task_ids]:
        assert client.start(ref)["type"] == "ack"
    report = CapacityReport(1, 16, False)
    pending = {client.send("worker.capacity", report) for _ in range(32)}
    canceller = threading.Thread(target=lambda: [server.request_cancel(t) for t in task_ids])
    canceller.start()
    try:
        notices, answered = set(), 0
        while pending or len(notices) < len(task_ids):
            frame = client.recv()
            if frame["type"] == "task.cancel":
                notices.add(frame["body"]["task_id"])
                continue
            pending.remove(frame["reply_to"])
            answered += 1
            if answered + len(pending) < 128:
                pending.add(client.send("worker.capacity", report))
    finally:
        canceller.join()
    assert notices == set(task_ids) and answered == 128
    assert not any(e.kind == "connection.slow_consumer" for e in server.events())


def test_dispatch_keeps_room_for_answers(server: MockOrbitServer) -> None:
    """Many assignments at once are paced by the outbox, and all of them arrive."""
    client = RawClient(server, capacity=40).connect()
    client.hello()
    ids = {server.enqueue("resize", {"n": i}) for i in range(40)}
    client.capacity(1, 40)
    got = {client.next_push()["body"]["task"]["task_id"] for _ in range(40)}
    assert got == ids
    assert not any(e.kind == "connection.slow_consumer" for e in server.events())


# --------------------------------------------------------------------------- lifecycle


def test_stop_is_idempotent_and_joins_threads() -> None:
    """stop() closes connections, joins every thread it started and can be called twice."""
    before = set(threading.enumerate())
    srv = MockOrbitServer(clock=ManualClock()).start()
    client = RawClient(srv).open()
    srv.stop()
    srv.stop()
    client.wait_closed()
    client.close()
    # The client's own threads (its reader, and its keepalive in websockets 14+) end just after
    # its close returns: joined here, so that only the server's could be left over.
    ws = client.ws
    for thread in (getattr(ws, "recv_events_thread", None), getattr(ws, "keepalive_thread", None)):
        if thread is not None:
            thread.join(5)
    leftovers = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert leftovers == []


def test_disconnect_returns_count(server: MockOrbitServer) -> None:
    """disconnect() cuts connections abruptly and says how many."""
    a = RawClient(server).open()
    b = RawClient(server).open()
    assert server.disconnect(a.session_id) == 1
    a.wait_closed()
    assert server.disconnect("f" * 32) == 0
    assert server.disconnect() == 1
    b.wait_closed()
    server.wait_until(lambda s: not any(x.connected for x in s.sessions()))


def test_secrets_never_logged_or_shown(caplog: pytest.LogCaptureFixture) -> None:
    """Token, instance_secret and lease_secret appear in no log record, repr or snapshot."""
    caplog.set_level(logging.DEBUG)
    with MockOrbitServer(clock=ManualClock()) as srv:
        client = RawClient(srv).open()
        srv.enqueue("resize", {"n": 1})
        ref = client.ref(client.next_push())
        client.start(ref)
        client.finish(ref)
        # The test's own raw client logs its headers; only the server side is under test.
        server_logs = [
            r.getMessage() for r in caplog.records if not r.name.startswith("websockets.client")
        ]
        assert any(r.name.startswith("orbit_sync.testing") for r in caplog.records)
        shown = " ".join(
            [*server_logs, repr(srv), repr(srv.tasks()), repr(srv.sessions()), repr(srv.events())]
        )
    for secret in (srv.token, client.registration.instance_secret, ref.lease_secret):
        assert secret not in shown


def test_deadline_latest_start_and_time_limit_over_socket(server: MockOrbitServer) -> None:
    """Overdue WAITING tasks fail; an attempt's lease stops at start + attempt_time_limit."""
    late = server.enqueue("crop", {"n": 1}, latest_start=3)
    overdue = server.enqueue("crop", {"n": 2}, deadline=5)
    server.advance(4)
    assert server.task(late).state is TaskState.FAILED
    server.advance(2)
    assert server.task(overdue).error_code == "DEADLINE_EXCEEDED"
    client = RawClient(server).open()
    server.enqueue("resize", {"n": 3}, attempt_time_limit=4)
    ref = client.ref(client.next_push())
    lease = client.start(ref)["body"]["lease"]
    window = parse_time(lease["lease_until"]) - parse_time(lease["server_time"])
    assert window.total_seconds() == 4


def test_unknown_outcome_over_socket(server: MockOrbitServer) -> None:
    """UNKNOWN retries an IDEMPOTENT task (keeping effect_uncertain), else NEEDS_REVIEW."""
    client = RawClient(server, capacity=2).open()
    retried = server.enqueue("resize", {"n": 1}, retry_safety="IDEMPOTENT", backoff_initial=2)
    reviewed = server.enqueue("resize", {"n": 2})
    pushes = [client.next_push(), client.next_push()]
    for ref in (client.ref(a) for a in pushes):
        client.start(ref)
        client.finish(ref, "UNKNOWN", {}, "TIMEOUT")
    assert server.task(reviewed).state is TaskState.NEEDS_REVIEW
    server.advance(2)
    again = client.next_push()
    assert again["body"]["task"]["task_id"] == retried
    snap = server.task(retried)
    assert snap.effect_uncertain and [a.state.value for a in snap.attempts] == [
        "UNKNOWN",
        "LEASED",
    ]


def test_cancel_before_start_over_socket(server: MockOrbitServer) -> None:
    """Cancel while LEASED: task.cancel, start answers RUNNING + cancel, CANCELLED is accepted."""
    client = RawClient(server, notifications=True).open()
    task_id = server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    server.request_cancel(task_id)
    notice = client.next_push("task.cancel")["body"]
    assert notice["task_id"] == task_id and notice["attempt_id"] == ref.attempt_id
    assert server.task(task_id).state is TaskState.LEASED
    start = client.start(ref)["body"]
    lease = start["lease"]
    assert start["receipt"]["disposition"] == "APPLIED"
    assert lease["active"] is True and lease["state"] == "RUNNING"
    assert lease["cancel_requested_at"] == notice["cancel_requested_at"]
    cancelled = parse_time(lease["cancel_requested_at"])
    parsed = Lease(
        active=True,
        state="RUNNING",
        lease_until=parse_time(lease["lease_until"]),
        server_time=parse_time(lease["server_time"]),
        cancel_requested_at=cancelled,
    ).with_deadline(time.monotonic())
    assert parsed.may_run() is False
    done = client.finish(ref, "CANCELLED", {"ran": False}, "CANCELLED")["body"]
    assert done["receipt"]["task_state"] == "CANCELLED"
    assert server.task(task_id).state is TaskState.CANCELLED
    assert server.sessions()[0].held == 0
    waiting = server.enqueue("crop", {"n": 2})
    server.request_cancel(waiting)
    assert server.task(waiting).state is TaskState.CANCELLED
    server.check_invariants()


def test_cancel_before_start_then_lease_expiry_over_socket(server: MockOrbitServer) -> None:
    """Cancel while LEASED and never started: past the lease the task is CANCELLED, slot freed."""
    client = RawClient(server, notifications=True).open()
    task_id = server.enqueue("resize", {"n": 1})
    ref = client.ref(client.next_push())
    server.request_cancel(task_id)
    client.next_push("task.cancel")
    assert server.sessions()[0].held == 1
    server.advance(31)
    snap = server.wait_for(task_id, {"CANCELLED"})
    assert [a.state.value for a in snap.attempts] == ["EXPIRED"]
    assert server.sessions()[0].held == 0
    assert error_code(client.start(ref)) == "LEASE_LOST"
    server.check_invariants()


def test_events_and_invariants_over_socket(server: MockOrbitServer) -> None:
    """The event log names sessions and attempts; invariants hold after a busy run."""
    clients = [RawClient(server, capacity=2).open() for _ in range(3)]
    ids = [server.enqueue("resize", {"n": i}) for i in range(6)]
    for client in clients:
        for _ in range(2):
            ref = client.ref(client.next_push())
            client.start(ref)
            client.finish(ref)
    for task_id in ids:
        server.wait_for(task_id, {"SUCCEEDED"})
    server.check_invariants()
    assigned = [e for e in server.events() if e.kind == "attempt.assigned"]
    assert {e.session_id for e in assigned} == {c.session_id for c in clients}
    assert all(e.attempt_id for e in assigned)


# --------------------------------------------------------------------------- hostile clients


def test_unauthenticated_connections_beyond_the_limit_are_closed_at_once() -> None:
    """Past max_pending_connections idle sockets, the next is closed on accept; once the idle
    ones close, a worker dials normally."""
    with MockOrbitServer(max_pending_connections=2, handshake_timeout=30) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        srv.wait_until(lambda s: s.pending_connections == 2)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            assert extra.recv(1) == b""  # closed without a byte read or sent
        refused = [e for e in srv.events() if e.kind == "connection.refused"]
        assert [e.detail for e in refused] == ["pre-authentication limit"]
        for sock in idle:
            sock.close()
        srv.wait_until(lambda s: s.pending_connections == 0)
        client = RawClient(srv).connect()
        assert client.hello()["type"] == "worker.welcome"
        client.close()


def test_wait_until_sees_connections_admitted_and_released() -> None:
    """``wait_until`` re-checks when a connection is admitted or released, not only at its
    timeout: a waiter on ``pending_connections`` wakes for each change."""
    with MockOrbitServer(handshake_timeout=30) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        for want in (1, 0):
            seen = threading.Event()

            def wait(want: int = want, seen: threading.Event = seen) -> None:
                srv.wait_until(lambda s: s.pending_connections == want, timeout=60)
                seen.set()

            waiter = threading.Thread(target=wait)
            waiter.start()
            if want == 1:
                idle = socket.create_connection(("127.0.0.1", port), timeout=5)
            else:
                idle.close()
            assert seen.wait(10), f"no wake-up when pending_connections became {want}"
            waiter.join(10)


def test_handshake_deadline_closes_silent_connections() -> None:
    """A connection that sends no request head within handshake_timeout is closed."""
    with MockOrbitServer(handshake_timeout=0.2) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /v1/worker/connect HTTP/1.1\r\n")  # and then nothing
            assert sock.recv(1) == b""
        assert any(e.kind == "connection.handshake_timeout" for e in srv.events())
        assert srv.pending_connections == 0


def test_admin_over_tls_takes_json_bodies() -> None:
    """Over wss:// the admin API reads JSON bodies too (TLS is ours, not websockets')."""
    from orbit_sync.testing import AdminAPI, AdminClient

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    api = AdminAPI()
    with MockOrbitServer(ssl_context=server_ctx, admin_handler=api) as srv:
        admin = AdminClient(srv.url, api.token, ssl_context=client_ctx)
        assert admin.url.startswith("https://")
        task_id = admin.enqueue("resize", {"w": 1}, max_attempts=2)
        assert srv.task(task_id).policy.max_attempts == 2


_EMFILE_CHILD = """
import logging, os, resource, sys
from orbit_sync.testing import MockOrbitServer
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="LOG %(message)s")
srv = MockOrbitServer(max_pending_connections=1000, handshake_timeout=30).start()
print("URL", srv.url, srv.token, srv.queue_id, flush=True)
# Room for a few more descriptors only: the parent's idle connections exhaust them.
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
print("READY", flush=True)
import threading; threading.Event().wait(60)  # the test kills this process
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_accept_loop_survives_descriptor_exhaustion() -> None:
    """With RLIMIT_NOFILE lowered (in a child process), more idle connections than descriptors
    make accept() fail with EMFILE: the loop logs it, backs off, and accepts again (a worker
    dials) once they close."""
    from _cli_process import Proc

    from orbit_sync.client import Client

    proc = Proc([sys.executable, "-c", _EMFILE_CHILD])
    try:
        _, url, token, queue_id = proc.line().split()
        assert proc.line() == "READY"
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(24)]
        line = proc.line()
        assert line.startswith("LOG cannot accept connections (EMFILE"), line
        for sock in idle:
            sock.close()
        assert proc.line().startswith("LOG accepting connections again")
        Client(url, token).dial_worker(registration(queue_id=queue_id, capacity=1)).close()
    finally:
        proc.kill()
        proc.wait()
