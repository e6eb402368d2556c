"""The mock server against an independent raw client written from docs/protocol.md alone.

Every frame the server sends is checked by ``tests/_independent.py`` (its own strict JSON and
field rules, no import of the SDK's codec), under the context a conforming client would have.
Server time is a ManualClock: leases and sessions expire only when a test advances it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _independent import (
    MAX_FRAME,
    NS,
    ClientContext,
    RawClient,
    Violation,
    check_client_frame,
    check_server_frame,
    check_time,
    dumps,
    frame,
    new_id,
    new_secret,
    ref_of,
)
from websockets.exceptions import ConnectionClosed, InvalidStatus

from orbit_sync.testing import ManualClock, MockOrbitServer

# The frame vectors kept in tests/vectors (a fresh clone must pass).
VECTORS = json.loads((Path(__file__).parent / "vectors" / "frames.json").read_text("utf-8"))
CTX = VECTORS["context"]
SID, MID, QID = CTX["session_id"], CTX["pending_message_ids"][0], CTX["queue_id"]
INSTANCE = "c" * 32


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    with MockOrbitServer(
        lease_duration=30.0, session_window=45.0, assignment_rate=None, clock=ManualClock()
    ) as srv:
        yield srv


def client(server: MockOrbitServer, **kw: Any) -> RawClient:
    kw.setdefault("queue_id", server.queue_id)
    token = kw.pop("token", server.token)
    return RawClient(server.url, token, **kw)


def window(body: dict[str, Any], end: str = "lease_until", start: str = "server_time") -> float:
    return (check_time(body[end], end) - check_time(body[start], start)) / NS


def finish_body(ref: dict[str, Any], outcome: str = "SUCCEEDED", **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"ref": ref, "outcome": outcome, "result": kw.pop("result", {"ok": 1})}
    body.update(kw)
    return body


def code(f: dict[str, Any]) -> str | None:
    return f["error"]["code"] if f["type"] == "error" else None


def assigned(c: RawClient, server: MockOrbitServer, payload: Any = None, **kw: Any) -> dict:
    """Enqueue a task and return the body of its ``task.assign``."""
    task_id = server.enqueue("resize", {"w": 1} if payload is None else payload, **kw)
    body: dict[str, Any] = c.next_push("task.assign")["body"]
    assert body["task"]["task_id"] == task_id
    return body


def started(c: RawClient, server: MockOrbitServer, **kw: Any) -> tuple[dict, dict]:
    a = assigned(c, server, **kw)
    ack = c.request("task.start", ref_of(a))
    assert ack["type"] == "ack", ack
    return a, ack["body"]


# --------------------------------------------------------------------------- own peer vs vectors


def _vector_ctx(session: str | None = SID) -> ClientContext:
    caps = {(c["handler"], c["handler_version"], c["payload_version"]) for c in CTX["capabilities"]}
    return ClientContext(
        queue_id=QID,
        capabilities=caps,
        notifications=CTX["cancellation_notifications"],
        session_id=session,
        epoch=2,
        pending={MID: "task.start"} if session else {MID: "worker.hello"},
    )


def test_independent_validator_agrees_with_every_vector() -> None:
    """Our independent validators classify every shared vector as frames.json says."""
    wrong = []
    for v in VECTORS["server_to_client"]:
        try:
            check_server_frame(v["frame"], _vector_ctx())
            ok = True
        except Violation:
            ok = False
        if ok != v["valid"]:
            wrong.append(v["name"])
    for v in VECTORS["welcome_answering_pending_hello"]:
        try:
            check_server_frame(v["frame"], _vector_ctx(None))
            ok = True
        except Violation:
            ok = False
        if ok != v["valid"]:
            wrong.append(v["name"])
    for v in VECTORS["client_to_server"]:
        try:
            check_client_frame(v["frame"], SID)
            ok = True
        except Violation:
            ok = False
        if ok != v["valid"]:
            wrong.append(v["name"])
    assert wrong == []


# --------------------------------------------------------------------------- transport (§1)


def test_bad_token_is_401(server: MockOrbitServer) -> None:
    """An unknown bearer token is refused with HTTP 401 (§1)."""
    with pytest.raises(InvalidStatus) as info:
        client(server, token="not-a-known-token")
    assert info.value.response.status_code == 401


def test_token_without_workers_connect_is_403(server: MockOrbitServer) -> None:
    """A token lacking workers:connect is refused with HTTP 403 (§1)."""
    token = server.add_token({"workers:consume", server.queue_scope(server.queue_id)})
    with pytest.raises(InvalidStatus) as info:
        client(server, token=token)
    assert info.value.response.status_code == 403


def test_query_string_is_refused(server: MockOrbitServer) -> None:
    """No query parameters at all on the connect URL (§1)."""
    with pytest.raises(InvalidStatus) as info:
        client(server, path="/v1/worker/connect?x=1")
    assert info.value.response.status_code >= 400


def test_subprotocol_is_required(server: MockOrbitServer) -> None:
    """An upgrade that does not offer pulse.worker.v1 is not accepted (§1)."""
    with pytest.raises(InvalidStatus):
        client(server, subprotocols=["other.v1"])


def test_subprotocol_selected_and_compression_off(server: MockOrbitServer) -> None:
    """The server selects pulse.worker.v1 and never negotiates permessage-deflate (§1)."""
    with client(server, compression="deflate") as c:
        assert c.ws.subprotocol == "pulse.worker.v1"
        assert c.ws.response is not None
        assert "Sec-WebSocket-Extensions" not in c.ws.response.headers


def test_no_hello_closes_the_connection() -> None:
    """A connection that sends no hello in time is closed (§5.1; hello_timeout shortened)."""
    with (
        MockOrbitServer(assignment_rate=None, clock=ManualClock(), hello_timeout=0.3) as srv,
        client(srv) as c,
        pytest.raises(ConnectionClosed),
    ):
        while True:
            raw = c.ws.recv(timeout=5)
            # Whatever it says before closing must at least be a well-formed error.
            assert json.loads(raw)["type"] == "error"


def test_binary_frame_is_rejected(server: MockOrbitServer) -> None:
    """A binary frame is a protocol error: INVALID_FRAME, then close (§1, §11)."""
    with client(server).open() as c:
        c.send_text(b'{"protocol_version":"1"}')
        seen = c.frames_until_closed()
        assert [code(f) for f in seen] == ["INVALID_FRAME"]


# --------------------------------------------------------------------------- session (§5)


def test_welcome_answers_hello(server: MockOrbitServer) -> None:
    """hello → welcome with reply_to, the new session id in frame and body, valid windows (§5.1)."""
    with client(server) as c:
        w = c.do_hello()
        assert w["type"] == "worker.welcome"
        body = w["body"]
        assert w["session_id"] == body["session_id"]
        assert body["epoch"] == "1"
        assert body["lease_duration_ms"] == 30_000
        assert window(body, "expires_at") == 45.0
        assert body["draining"] is False


def test_permission_denied_without_consume_scope(server: MockOrbitServer) -> None:
    """A token without workers:consume gets PERMISSION_DENIED (fatal) for its hello (§11)."""
    token = server.add_token({"workers:connect", server.queue_scope(server.queue_id)})
    with client(server, token=token) as c:
        assert code(c.do_hello()) == "PERMISSION_DENIED"
        assert c.frames_until_closed() == []


def test_nothing_assigned_before_first_capacity_ack(server: MockOrbitServer) -> None:
    """No task.assign before the first capacity is acknowledged; the ack comes first (§5.5)."""
    with client(server) as c:
        c.do_hello()
        task_id = server.enqueue("resize", {"w": 1})
        assert server.task(task_id).state == "WAITING"
        ack = c.capacity(1, 4)
        assert ack["type"] == "ack"
        assert list(c.pushes) == []  # nothing arrived before the ack
        assert ack["body"]["session_id"] == c.session_id
        assert int(ack["body"]["epoch"]) == c.ctx.epoch
        assert c.next_push()["body"]["task"]["task_id"] == task_id


def test_capacity_sequence_rules(server: MockOrbitServer) -> None:
    """Same sequence+content repeats; other content or older sequence: STATE_CONFLICT (§5.6)."""
    with client(server).open(capacity=4, sequence=1) as c:
        assert c.capacity(1, 4)["type"] == "ack"
        assert code(c.capacity(1, 3)) == "STATE_CONFLICT"
        assert code(c.capacity(1, 4, drain=True)) == "STATE_CONFLICT"
        assert c.capacity(2, 3)["type"] == "ack"
        assert code(c.capacity(1, 4)) == "STATE_CONFLICT"
        assert c.capacity(2, 3)["type"] == "ack"


def test_repeating_the_report_renews_the_session(server: MockOrbitServer) -> None:
    """Repeating the current report (fresh message_id) renews the session window (§5.6)."""
    with client(server) as c:
        welcome = c.do_hello()["body"]
        c.capacity(1, 4)
        server.advance(30)
        ack = c.capacity(1, 4)["body"]
        assert window(ack, "expires_at") == 45.0
        assert check_time(ack["server_time"], "t") - check_time(welcome["server_time"], "t") == (
            30 * NS
        )
        server.advance(30)  # 60 s after the welcome, 30 s after the renewal
        assert c.capacity(1, 4)["type"] == "ack"


def test_drain_is_persistent_across_reconnects(server: MockOrbitServer) -> None:
    """drain:false after drain:true is STATE_CONFLICT; the next welcome says draining (§5.7)."""
    instance, secret = new_id(), new_secret()
    with client(server, instance_id=instance, instance_secret=secret).open() as a:
        ack = a.capacity(2, 4, drain=True)
        assert ack["body"]["draining"] is True
        assert code(a.capacity(3, 4, drain=False)) == "STATE_CONFLICT"
    with client(server, instance_id=instance, instance_secret=secret) as b:
        welcome = b.do_hello()
        assert welcome["body"]["draining"] is True
        assert code(b.capacity(4, 4, drain=False)) == "STATE_CONFLICT"
        assert b.capacity(4, 4, drain=True)["type"] == "ack"


def test_capacity_zero_stops_assignments_but_keeps_held(server: MockOrbitServer) -> None:
    """capacity 0 stops new assignments and releases nothing already held (§5.7)."""
    with client(server).open(capacity=2) as c:
        first = assigned(c, server)
        assert c.capacity(2, 0)["type"] == "ack"
        later = server.enqueue("resize", {"w": 2})
        assert server.task(later).state == "WAITING"
        assert server.task(first["task"]["task_id"]).state == "LEASED"
        ack = c.request("task.start", ref_of(first))
        assert ack["body"]["lease"]["active"] is True
        assert ack["body"]["lease"]["state"] == "RUNNING"


def test_reconnect_increments_epoch_and_stales_old_session(server: MockOrbitServer) -> None:
    """A new connection of the same process gets epoch+1; the old one gets STALE_SESSION (§5.4)."""
    instance, secret = new_id(), new_secret()
    a = client(server, instance_id=instance, instance_secret=secret).open()
    attempt, start = started(a, server)
    with a, client(server, instance_id=instance, instance_secret=secret) as b:
        welcome = b.do_hello()
        assert int(welcome["body"]["epoch"]) == a.ctx.epoch + 1 == 2
        with contextlib.suppress(ConnectionClosed):
            a.send("task.renew", ref_of(attempt))
        seen = a.frames_until_closed()
        assert "STALE_SESSION" in [code(f) for f in seen]
        waiting = server.enqueue("resize", {"w": 2})
        assert server.task(waiting).state == "WAITING"  # §5.5: not before b's first capacity
        # §5.5: the new session may resume before its first capacity report.
        lease = b.request("worker.resume", ref_of(attempt))
        assert lease["type"] == "ack"
        assert lease["body"]["active"] is True
        assert lease["body"]["state"] == "RUNNING"
        # Resume moves the attempt; it renews nothing.
        assert lease["body"]["lease_until"] == start["lease"]["lease_until"]
        renewed = b.request("task.renew", ref_of(attempt))
        assert renewed["type"] == "ack"
        assert renewed["body"]["lease"]["active"] is True


def test_reconnect_with_capabilities_reordered(server: MockOrbitServer) -> None:
    """Capability order is irrelevant: the same set in another order is the same process (§4)."""
    caps = [("resize", "1", "1"), ("crop", "2", "1")]
    instance, secret = new_id(), new_secret()
    with client(server, instance_id=instance, instance_secret=secret, capabilities=caps) as a:
        assert a.do_hello()["type"] == "worker.welcome"
    with client(server, instance_id=instance, instance_secret=secret, capabilities=caps[::-1]) as b:
        welcome = b.do_hello()
        assert welcome["type"] == "worker.welcome"
        assert welcome["body"]["epoch"] == "2"


def test_process_cannot_switch_queues(server: MockOrbitServer) -> None:
    """A process is bound to one queue; reconnecting on another is refused (§5.8)."""
    other = server.add_queue()
    scopes = {"workers:connect", "workers:consume"}
    token = server.add_token(
        scopes | {server.queue_scope(server.queue_id), server.queue_scope(other)}
    )
    instance, secret = new_id(), new_secret()
    with client(server, token=token, instance_id=instance, instance_secret=secret) as a:
        assert a.do_hello()["type"] == "worker.welcome"
    with client(
        server, token=token, queue_id=other, instance_id=instance, instance_secret=secret
    ) as b:
        assert b.do_hello()["type"] == "error"


def test_slots_are_counted_per_process(server: MockOrbitServer) -> None:
    """Reconnects and duplicate results never free a slot twice (§5.9, §7)."""
    instance, secret = new_id(), new_secret()
    kw = {"instance_id": instance, "instance_secret": secret, "capacity": 1}
    a = client(server, **kw).open(capacity=1)
    first = assigned(a, server)
    with a, client(server, **kw) as b:
        b.do_hello()
        b.capacity(2, 1)
        second = server.enqueue("resize", {"w": 2})
        assert server.task(second).state == "WAITING"  # the slot is still held by `first`
        assert b.request("worker.resume", ref_of(first))["type"] == "ack"
        assert b.request("task.start", ref_of(first))["type"] == "ack"
        done = b.request("task.finish", finish_body(ref_of(first)))
        assert done["body"]["receipt"]["disposition"] == "APPLIED"
        assert b.next_push()["body"]["task"]["task_id"] == second
        again = b.request("task.finish", finish_body(ref_of(first)))
        assert again["body"]["receipt"] == done["body"]["receipt"]
        third = server.enqueue("resize", {"w": 3})
        assert server.task(third).state == "WAITING"


# --------------------------------------------------------------------------- attempts (§6)


def test_attempt_lifecycle(server: MockOrbitServer) -> None:
    """assign (LEASED reservation) → start (RUNNING) → renew (extends) → finish (§6.1-§6.4)."""
    with client(server).open() as c:
        a = assigned(c, server, payload={"w": 7}, max_attempts=3)
        task = a["task"]
        assert (task["state"], task["attempt"], task["max_attempts"]) == ("LEASED", "1", "3")
        assert task["payload"] == {"w": 7}
        assert task["queue_id"] == server.queue_id
        assert 0 < window(a) <= 30.0
        start = c.request("task.start", ref_of(a))["body"]
        assert start["receipt"]["operation"] == "start"
        assert start["receipt"]["disposition"] == "APPLIED"
        assert (start["receipt"]["task_state"], start["receipt"]["attempt_state"]) == (
            "RUNNING",
            "RUNNING",
        )
        assert start["deduplicated"] is False
        assert (start["lease"]["active"], start["lease"]["state"]) == (True, "RUNNING")
        assert "cancel_requested_at" not in start["lease"]
        server.advance(10)
        renew = c.request("task.renew", ref_of(a))["body"]
        assert renew["receipt"]["operation"] == "renew"
        assert check_time(renew["lease"]["lease_until"], "t") > check_time(
            start["lease"]["lease_until"], "t"
        )
        assert int(renew["receipt"]["task_revision"]) >= int(start["receipt"]["task_revision"])
        fin = c.request("task.finish", finish_body(ref_of(a), result={"done": True}))["body"]
        assert fin["receipt"]["operation"] == "finish"
        assert fin["receipt"]["task_state"] == "SUCCEEDED"
        assert fin["receipt"]["disposition"] == "APPLIED"
        assert fin["lease"]["active"] is False
        assert int(fin["receipt"]["task_revision"]) > int(start["receipt"]["task_revision"])
        assert server.task(task["task_id"]).state == "SUCCEEDED"


def test_failed_retryable_goes_back_and_reassigns(server: MockOrbitServer) -> None:
    """FAILED+retryable returns the task for another attempt, numbered 2 with a new epoch (§6.4)."""
    with client(server).open() as c:
        a = assigned(c, server, max_attempts=3)
        c.request("task.start", ref_of(a))
        fin = c.request(
            "task.finish", finish_body(ref_of(a), "FAILED", error_code="BOOM", retryable=True)
        )["body"]
        assert fin["receipt"]["task_state"] == "WAITING"
        server.advance(2)  # past the first backoff (1 s by default)
        b = c.next_push()["body"]
        assert b["task"]["task_id"] == a["task"]["task_id"]
        assert b["task"]["attempt"] == "2"
        assert int(b["epoch"]) > int(a["epoch"])
        assert b["attempt_id"] != a["attempt_id"]


def test_replaying_a_message_id_returns_the_original_receipt(server: MockOrbitServer) -> None:
    """The same message_id returns the original receipt with deduplicated:true (§6.3, §7)."""
    with client(server).open() as c:
        a = assigned(c, server)
        ref = ref_of(a)
        start_id = c.send("task.start", ref)
        start = c.answer(start_id)["body"]
        replay = c.request("task.start", ref, message_id=start_id)["body"]
        assert replay["deduplicated"] is True
        assert replay["receipt"] == start["receipt"]
        server.advance(5)
        renew_id = c.send("task.renew", ref)
        renew = c.answer(renew_id)["body"]
        server.advance(5)
        replay = c.request("task.renew", ref, message_id=renew_id)["body"]
        assert replay["deduplicated"] is True
        assert replay["receipt"] == renew["receipt"]
        # Repeating an old renew only returns its receipt: the lease is not extended again.
        assert replay["lease"]["lease_until"] == renew["lease"]["lease_until"]
        fresh = c.request("task.renew", ref)["body"]
        assert check_time(fresh["lease"]["lease_until"], "t") > check_time(
            renew["lease"]["lease_until"], "t"
        )
        fin_id = c.send("task.finish", finish_body(ref))
        fin = c.answer(fin_id)["body"]
        replay = c.request("task.finish", finish_body(ref), message_id=fin_id)["body"]
        assert replay["deduplicated"] is True
        assert replay["receipt"] == fin["receipt"]


def test_same_message_id_other_content_is_idempotency_conflict(server: MockOrbitServer) -> None:
    """Other content, other retryable or another operation under one message_id conflict (§7)."""
    with client(server).open() as c:
        a = assigned(c, server)
        ref = ref_of(a)
        start_id = c.send("task.start", ref)
        c.answer(start_id)
        assert code(c.request("task.renew", ref, message_id=start_id)) == "IDEMPOTENCY_CONFLICT"
        failed = finish_body(ref, "FAILED", error_code="BOOM", retryable=False)
        fin_id = c.send("task.finish", failed)
        assert c.answer(fin_id)["type"] == "ack"
        other = dict(failed, retryable=True)
        assert code(c.request("task.finish", other, message_id=fin_id)) == "IDEMPOTENCY_CONFLICT"
        other = dict(failed, result={"other": True})
        assert code(c.request("task.finish", other, message_id=fin_id)) == "IDEMPOTENCY_CONFLICT"


def test_same_finish_new_message_id_returns_first_receipt(server: MockOrbitServer) -> None:
    """A finish re-reported under a new id returns the first receipt, not a later state (§7)."""
    with client(server).open() as c:
        a = assigned(c, server, max_attempts=3)
        c.request("task.start", ref_of(a))
        failed = finish_body(ref_of(a), "FAILED", error_code="BOOM", retryable=True)
        first = c.request("task.finish", failed)["body"]["receipt"]
        server.advance(2)
        b = c.next_push()["body"]
        c.request("task.start", ref_of(b))  # the task is RUNNING again, revision moved on
        again = c.request("task.finish", failed)
        assert again["type"] == "ack"
        assert again["body"]["receipt"] == first


def test_resend_after_ambiguous_failure_is_deduplicated(server: MockOrbitServer) -> None:
    """Reconnect, resume, re-send the same finish with the same message_id: deduplicated (§7)."""
    instance, secret = new_id(), new_secret()
    kw = {"instance_id": instance, "instance_secret": secret}
    a = client(server, **kw).open()
    attempt, _ = started(a, server)
    dropped = server.faults.drop_reply("task.finish")
    fin_id = a.send("task.finish", finish_body(ref_of(attempt)))
    assert dropped.wait(5)
    a.close()
    with client(server, **kw) as b:
        assert b.do_hello()["body"]["epoch"] == "2"
        lease = b.request("worker.resume", ref_of(attempt))["body"]
        assert lease["active"] is False  # finished: nothing left to run
        again = b.request("task.finish", finish_body(ref_of(attempt)), message_id=fin_id)["body"]
        assert again["deduplicated"] is True
        assert again["receipt"]["task_state"] == "SUCCEEDED"
        assert again["receipt"]["disposition"] == "APPLIED"


def test_late_finish_is_evidence_only(server: MockOrbitServer) -> None:
    """A result after the lease expired is stored EVIDENCE_ONLY and changes nothing (§6.7)."""
    with client(server).open() as c:
        a, _ = started(c, server)
        task_id = a["task"]["task_id"]
        server.advance(31)
        before = server.task(task_id).state
        assert before in ("NEEDS_REVIEW", "WAITING", "LEASED")
        fin = c.request("task.finish", finish_body(ref_of(a)))["body"]
        assert fin["receipt"]["disposition"] == "EVIDENCE_ONLY"
        assert fin["lease"]["active"] is False
        assert server.task(task_id).state == before


def test_finish_never_started_is_evidence_only(server: MockOrbitServer) -> None:
    """A result for an attempt that never started is EVIDENCE_ONLY and grants nothing (§6.7)."""
    with client(server).open() as c:
        a = assigned(c, server)
        fin = c.request("task.finish", finish_body(ref_of(a)))["body"]
        assert fin["receipt"]["disposition"] == "EVIDENCE_ONLY"
        assert server.task(a["task"]["task_id"]).state != "SUCCEEDED"


def test_cancelled_finish_needs_a_cancel_request(server: MockOrbitServer) -> None:
    """CANCELLED is accepted only when a cancel was requested (§6.4)."""
    with client(server).open() as c:
        a, _ = started(c, server)
        answer = c.request("task.finish", finish_body(ref_of(a), "CANCELLED", error_code="STOP"))
        if answer["type"] == "ack":
            assert answer["body"]["receipt"]["disposition"] == "EVIDENCE_ONLY"
        assert server.task(a["task"]["task_id"]).state != "CANCELLED"


def test_lease_expired_before_start_goes_back_to_waiting(server: MockOrbitServer) -> None:
    """An unstarted expired lease returns the task; the next attempt is number 2 (§8)."""
    with client(server).open() as c:
        a = assigned(c, server, max_attempts=3)
        server.advance(32)
        c.capacity(1, 4)
        b = c.next_push()["body"]
        assert b["task"]["task_id"] == a["task"]["task_id"]
        assert (b["task"]["attempt"], b["epoch"]) == ("2", "2")
        assert c.request("task.start", ref_of(a))["type"] == "error"


# --------------------------------------------------------------------------- cancellation (§9)


def test_cancel_pushes_and_stops_renewal(server: MockOrbitServer) -> None:
    """A cancel: task.cancel push (asked for), cancel_requested_at in leases, no extension (§9)."""
    with client(server, notifications=True).open() as c:
        a, start = started(c, server)
        server.request_cancel(a["task"]["task_id"])
        push = c.next_push("task.cancel")["body"]
        assert (push["task_id"], push["attempt_id"], push["epoch"]) == (
            a["task"]["task_id"],
            a["attempt_id"],
            a["epoch"],
        )
        server.advance(5)
        renew = c.request("task.renew", ref_of(a))["body"]
        assert renew["lease"]["cancel_requested_at"] == push["cancel_requested_at"]
        assert renew["lease"]["lease_until"] == start["lease"]["lease_until"]
        lease = c.request("worker.resume", ref_of(a))["body"]
        assert lease["cancel_requested_at"] == push["cancel_requested_at"]
        fin = c.request("task.finish", finish_body(ref_of(a), "CANCELLED", error_code="STOPPED"))
        assert fin["body"]["receipt"]["disposition"] == "APPLIED"
        assert server.task(a["task"]["task_id"]).state == "CANCELLED"


def test_no_cancel_push_unless_requested(server: MockOrbitServer) -> None:
    """Without cancellation_notifications no task.cancel is pushed; the lease still says so (§9)."""
    with client(server).open() as c:  # the validator rejects any task.cancel for this session
        a, _ = started(c, server)
        server.request_cancel(a["task"]["task_id"])
        renew = c.request("task.renew", ref_of(a))["body"]
        assert list(c.pushes) == []
        assert "cancel_requested_at" in renew["lease"]


def test_cancel_waiting_task_is_cancelled_at_once(server: MockOrbitServer) -> None:
    """A task cancelled while WAITING goes straight to CANCELLED (§9)."""
    task_id = server.enqueue("resize", {"w": 1})
    server.request_cancel(task_id)
    assert server.task(task_id).state == "CANCELLED"


# --------------------------------------------------------------------------- limits (§10)


def test_at_most_four_assignments_per_second() -> None:
    """New assignments are limited to 4 per second per node (§10)."""
    with (
        MockOrbitServer(clock=ManualClock()) as srv,  # the default rate
        client(srv, capacity=8).open() as c,
    ):
        ids = [srv.enqueue("resize", {"n": n}) for n in range(6)]
        first = {c.next_push()["body"]["task"]["task_id"] for _ in range(4)}
        assert sum(srv.task(t).state == "LEASED" for t in ids) == 4
        srv.advance(1.0)
        second = {c.next_push()["body"]["task"]["task_id"] for _ in range(2)}
        assert first | second == set(ids)


# --------------------------------------------------------------------------- invalid frames (§11)


def _expect_invalid(c: RawClient, mid: str | None, *, unreadable_ok: bool = False) -> None:
    seen = c.frames_until_closed()
    assert seen, "no answer before the close"
    assert code(seen[0]) == "INVALID_FRAME"
    if unreadable_ok:
        # §11 asks for reply_to "when it could read the message_id"; whether a document the
        # strict parser rejects as a whole counts as readable is not said: both are accepted.
        assert seen[0].get("reply_to") in (None, mid)
    else:
        assert seen[0].get("reply_to") == mid
    assert all(f["type"] == "error" for f in seen)


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"reply_to": None}, id="reply_to-null"),
        pytest.param({"reply_to": "7" * 32}, id="reply_to"),
        pytest.param({"error": None}, id="error-null"),
        pytest.param({"trace": "x"}, id="envelope-unknown"),
    ],
)
def test_request_with_response_or_unknown_envelope_field(
    server: MockOrbitServer, extra: dict[str, Any]
) -> None:
    """Requests carry no response fields, not even null, and no unknown fields (§2, §11)."""
    with client(server).open() as c:
        mid = c.send(
            "worker.capacity", {"sequence": "2", "capacity": 4, "drain": False}, extra=extra
        )
        _expect_invalid(c, mid)


def test_unknown_body_field_is_invalid_frame(server: MockOrbitServer) -> None:
    """The server rejects unknown fields in client bodies: INVALID_FRAME, then close (§2, §11)."""
    with client(server).open() as c:
        body = {"sequence": "2", "capacity": 4, "drain": False, "color": "blue"}
        _expect_invalid(c, c.send("worker.capacity", body))


def test_hello_without_capabilities_is_invalid_frame(server: MockOrbitServer) -> None:
    """A hello without capabilities is INVALID_FRAME with reply_to, then close (§4, §11)."""
    with client(server) as c:
        body = dict(c.hello)
        del body["capabilities"]
        _expect_invalid(c, c.send("worker.hello", body))


def _live_vector(server: MockOrbitServer, vector: dict[str, Any], session: str, mid: str) -> str:
    text: str = vector["frame"]
    for old, new in ((SID, session), (MID, mid), (QID, server.queue_id), (INSTANCE, new_id())):
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize(
    "vector", VECTORS["client_to_server"], ids=[v["name"] for v in VECTORS["client_to_server"]]
)
def test_client_vector_over_a_live_session(server: MockOrbitServer, vector: dict[str, Any]) -> None:
    """Each client_to_server vector is accepted, or answered INVALID_FRAME then closed (§11)."""
    kind = json.loads(vector["frame"])["type"]
    with client(server) as c:
        if kind != "worker.hello":
            c.open()
        mid = new_id()
        c.ctx.pending[mid] = kind
        c.send_text(_live_vector(server, vector, c.ctx.session_id or SID, mid))
        if vector["valid"]:
            answer = c.answer(mid)
            assert code(answer) != "INVALID_FRAME", answer
            if kind == "worker.hello":
                assert answer["type"] == "worker.welcome"
        else:
            _expect_invalid(c, mid)


def test_unparseable_frame_is_invalid_frame_without_reply_to(server: MockOrbitServer) -> None:
    """A frame that is not JSON gets INVALID_FRAME without reply_to, then the close (§11)."""
    with client(server).open() as c:
        c.send_text("{not json")
        seen = c.frames_until_closed()
        assert [code(f) for f in seen] == ["INVALID_FRAME"]
        assert "reply_to" not in seen[0]


def _finish_text(session: str, mid: str, result_json: str) -> str:
    ref = {"task_id": new_id(), "attempt_id": new_id(), "epoch": "1", "lease_secret": new_secret()}
    head = {"protocol_version": "1", "type": "task.finish", "message_id": mid}
    head["session_id"] = session
    # Spliced as text: the result may be JSON that no encoder would produce.
    body = f'{{"ref":{json.dumps(ref)},"outcome":"SUCCEEDED","result":{result_json}}}'
    return json.dumps(head)[:-1] + f', "body": {body}}}'


@pytest.mark.parametrize(
    "result",
    [
        pytest.param('{"x": NaN}', id="nan"),
        pytest.param('{"x": -Infinity}', id="infinity"),
        pytest.param('{"x": 1e400}', id="huge-exponent"),
        pytest.param('{"x": 1' + "0" * 400 + "}", id="400-digit-integer"),
        pytest.param('{"a": 1, "a": 2}', id="duplicate-nested-key"),
        pytest.param('{"x": "\\ud800"}', id="lone-surrogate"),
        pytest.param("null", id="null-result"),
    ],
)
def test_strict_json_in_client_frames(server: MockOrbitServer, result: str) -> None:
    """§2's JSON rules apply at any depth of a client frame: INVALID_FRAME, then close."""
    with client(server).open() as c:
        mid = new_id()
        c.ctx.pending[mid] = "task.finish"
        c.send_text(_finish_text(c.session_id, mid, result))
        _expect_invalid(c, mid, unreadable_ok=result != "null")


def test_finite_numbers_in_results_are_accepted(server: MockOrbitServer) -> None:
    """Large but finite numbers and non-ASCII text are valid results (not INVALID_FRAME) (§2)."""
    with client(server).open() as c:
        mid = new_id()
        c.ctx.pending[mid] = "task.finish"
        c.send_text(_finish_text(c.session_id, mid, '{"x": 1e308, "y": -0.5, "z": "été ✓"}'))
        assert code(c.answer(mid)) == "LEASE_LOST"  # the ref is unknown; the frame is valid


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sequence", "01"),
        ("sequence", "+1"),
        ("sequence", " 1"),
        ("sequence", "\u0661"),
        ("sequence", 2),
        ("capacity", 4.0),
        ("capacity", True),
        ("capacity", -1),
        ("drain", "false"),
        ("drain", None),
    ],
)
def test_malformed_capacity_fields(server: MockOrbitServer, field: str, value: Any) -> None:
    """Counters are canonical decimal strings, integers plain, bools bools (§2, §4)."""
    with client(server).open() as c:
        body = {"sequence": "2", "capacity": 4, "drain": False, field: value}
        _expect_invalid(c, c.send("worker.capacity", body))


def test_request_without_session_id_is_invalid(server: MockOrbitServer) -> None:
    """session_id is absent only on worker.hello (§2)."""
    with client(server).open() as c:
        body = {"sequence": "2", "capacity": 4, "drain": False}
        _expect_invalid(c, c.send("worker.capacity", body, session_id=None))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"capacity": 256}, id="capacity-256"),
        pytest.param({"capacity": 1}, id="capacity-1"),
        pytest.param({"cancellation_notifications": False}, id="notifications-false"),
        pytest.param(
            {"capabilities": [[f"h{n}", "1", "1"] for n in range(32)]}, id="32-capabilities"
        ),
        pytest.param({"capabilities": [["r" + "x" * 63, "7", "12"]]}, id="64-char-handler"),
        pytest.param({"capabilities": [["a.b_c-d9", "1", "1"]]}, id="handler-punctuation"),
    ],
)
def test_boundary_hellos_are_welcomed(server: MockOrbitServer, change: dict[str, Any]) -> None:
    """Hellos at the edges of §4's ranges are valid and welcomed."""
    caps = change.pop("capabilities", None)
    with client(
        server,
        capacity=change.get("capacity", 4),
        notifications=change.get("cancellation_notifications"),
        capabilities=[tuple(c) for c in caps] if caps else None,
    ) as c:
        assert c.do_hello()["type"] == "worker.welcome"


def test_oversized_client_frame_closes(server: MockOrbitServer) -> None:
    """A client frame over 512 KiB is rejected and the connection closed (§2)."""
    with client(server).open() as c:
        mid = new_id()
        c.ctx.pending[mid] = "task.finish"
        c.send_text(_finish_text(c.session_id, mid, json.dumps("x" * MAX_FRAME)))
        seen = c.frames_until_closed()
        assert all(code(f) == "INVALID_FRAME" for f in seen)


def test_revoked_token_gets_unauthenticated(server: MockOrbitServer) -> None:
    """A revoked token's session answers UNAUTHENTICATED (fatal), then closes (§11)."""
    token = server.add_token(
        {"workers:connect", "workers:consume", server.queue_scope(server.queue_id)}
    )
    with client(server, token=token).open() as c:
        server.revoke_token(token)
        assert code(c.capacity(1, 4)) == "UNAUTHENTICATED"
        assert c.frames_until_closed() == []


def test_read_idle_closes_the_connection() -> None:
    """A connection idle past the read-idle bound is closed by the server (§10; shortened)."""
    with (
        MockOrbitServer(assignment_rate=None, clock=ManualClock(), read_idle_timeout=0.3) as srv,
        client(srv).open() as c,
    ):
        assert all(f["type"] == "error" for f in c.frames_until_closed())


# --------------------------------------------------------------------------- defaults and policy


def test_default_windows() -> None:
    """The server's defaults: session window 45 s, lease window 30 s (§5.6)."""
    with MockOrbitServer(clock=ManualClock()) as srv, client(srv) as c:
        body = c.do_hello()["body"]
        assert window(body, "expires_at") == 45.0
        assert body["lease_duration_ms"] == 30_000


def test_connection_limit_refuses_the_extra_connection() -> None:
    """Connections per node are bounded (§10; limit shortened): one more is not served."""
    with MockOrbitServer(clock=ManualClock(), max_connections=2) as srv:
        first, second = client(srv).open(), client(srv).open()
        with first, second:
            try:
                extra = client(srv)
            except InvalidStatus as exc:
                assert exc.response.status_code >= 400
            else:
                with extra:
                    assert [f["type"] for f in extra.frames_until_closed()] in ([], ["error"])


@pytest.mark.parametrize(
    ("safety", "cancel", "expected"),
    [
        ("IDEMPOTENT", False, "WAITING"),
        ("RECONCILE_ONLY", False, "NEEDS_REVIEW"),
        ("IDEMPOTENT", True, "NEEDS_REVIEW"),
    ],
)
def test_unknown_outcome_follows_the_retry_policy(
    server: MockOrbitServer, safety: str, cancel: bool, expected: str
) -> None:
    """UNKNOWN retries only if IDEMPOTENT, uncancelled, with budget; else NEEDS_REVIEW (§6.4)."""
    with client(server).open() as c:
        a, _ = started(c, server, retry_safety=safety, max_attempts=3)
        if cancel:
            server.request_cancel(a["task"]["task_id"])
        fin = c.request("task.finish", finish_body(ref_of(a), "UNKNOWN", error_code="LOST"))
        assert fin["body"]["receipt"]["task_state"] == expected
        assert server.task(a["task"]["task_id"]).state == expected


def test_failed_retryable_without_budget_is_failed(server: MockOrbitServer) -> None:
    """retryable:true retries only while attempts remain (§6.4)."""
    with client(server).open() as c:
        a, _ = started(c, server, max_attempts=1)
        body = finish_body(ref_of(a), "FAILED", error_code="BOOM", retryable=True)
        assert c.request("task.finish", body)["body"]["receipt"]["task_state"] == "FAILED"


def test_lost_started_attempt_keeps_uncertainty(server: MockOrbitServer) -> None:
    """A lost started attempt is UNKNOWN; a later failure never hides that uncertainty (§8)."""
    with client(server).open() as c:
        a, _ = started(c, server, retry_safety="IDEMPOTENT", max_attempts=3)
        task_id = a["task"]["task_id"]
        server.advance(31)  # lease lost at 30 s; backoff 1 s; the session lives until 45 s
        c.capacity(1, 4)
        b = c.next_push()["body"]
        assert b["task"]["attempt"] == "2"
        assert server.task(task_id).attempts[0].state == "UNKNOWN"
        c.request("task.start", ref_of(b))
        body = finish_body(ref_of(b), "FAILED", error_code="BOOM")
        assert c.request("task.finish", body)["body"]["receipt"]["task_state"] == "NEEDS_REVIEW"


def test_truthful_success_after_cancel_request(server: MockOrbitServer) -> None:
    """After a cancel request the attempt may still report a truthful SUCCEEDED (§9)."""
    with client(server).open() as c:
        a, _ = started(c, server)
        server.request_cancel(a["task"]["task_id"])
        fin = c.request("task.finish", finish_body(ref_of(a)))["body"]
        assert fin["receipt"]["disposition"] == "APPLIED"
        assert fin["receipt"]["task_state"] == "SUCCEEDED"


def test_second_start_grants_nothing_new(server: MockOrbitServer) -> None:
    """A new start of a running attempt never grants a second run (§7)."""
    with client(server).open() as c:
        a, _ = started(c, server)
        again = c.request("task.start", ref_of(a))
        if again["type"] == "ack":
            receipt = again["body"]["receipt"]
            assert again["body"]["deduplicated"] or receipt["disposition"] == "EVIDENCE_ONLY"


@pytest.mark.parametrize("kind", [["worker.capacity"], {"t": 1}], ids=repr)
def test_non_string_request_type_is_invalid_frame(server: MockOrbitServer, kind: Any) -> None:
    """A request type of the wrong JSON type is INVALID_FRAME with reply_to, then close (§2)."""
    with client(server).open() as c:
        body = {"sequence": "2", "capacity": 4, "drain": False}
        _expect_invalid(c, c.send("worker.capacity", body, extra={"type": kind}))


def test_other_serializations_are_accepted(server: MockOrbitServer) -> None:
    """Pretty-printed JSON with escaped characters is the same frame to a conforming server (§2)."""
    with client(server) as c:
        mid = new_id()
        c.ctx.pending[mid] = "worker.hello"
        hello = {"protocol_version": "1", "type": "worker.hello", "message_id": mid}
        hello["body"] = c.hello
        text = json.dumps(hello, indent=2, ensure_ascii=True).replace('"resize"', '"\\u0072esize"')
        c.send_text(text)
        welcome = c.answer(mid)
        assert welcome["type"] == "worker.welcome"


def test_falsy_result_and_explicit_retryable_false(server: MockOrbitServer) -> None:
    """result may be any JSON but null; retryable:false is valid with any outcome (§4)."""
    with client(server).open() as c:
        a, _ = started(c, server)
        body = finish_body(ref_of(a), result=False, retryable=False)
        fin = c.request("task.finish", body)
        assert fin["type"] == "ack"
        assert fin["body"]["receipt"]["disposition"] == "APPLIED"


def test_invalid_utf8_text_frame_is_invalid_frame(server: MockOrbitServer) -> None:
    """A text frame that is not UTF-8 is answered INVALID_FRAME, then the close (§2, §11)."""
    with client(server).open() as c:
        mid = new_id()
        c.ctx.pending[mid] = "worker.capacity"
        body = {"sequence": "2", "capacity": 4, "drain": False}
        data = dumps(frame("worker.capacity", message_id=mid, session_id=c.session_id, body=body))
        c.ws.send(data.encode().replace(b'"drain"', b'"dr\xffain"'), text=True)
        _expect_invalid(c, mid, unreadable_ok=True)


def test_wrong_lease_secret_grants_and_stores_nothing(server: MockOrbitServer) -> None:
    """Identity and secret are checked before anything, evidence included (§6.7)."""
    with client(server).open() as c:
        a, _ = started(c, server)
        forged = dict(ref_of(a), lease_secret=new_secret())
        for kind, body in (
            ("worker.resume", forged),
            ("task.renew", forged),
            ("task.finish", finish_body(forged)),
        ):
            assert c.request(kind, body)["type"] == "error", kind
        snap = server.task(a["task"]["task_id"])
        assert snap.state == "RUNNING"
        assert snap.evidence == ()


def test_instance_id_alone_takes_nothing_over(server: MockOrbitServer) -> None:
    """A known instance_id with another secret is refused; the real session stays (§3, §5.4)."""
    instance = new_id()
    with client(server, instance_id=instance).open() as a:
        with client(server, instance_id=instance) as rogue:
            assert rogue.do_hello()["type"] == "error"
        assert a.capacity(1, 4)["type"] == "ack"
