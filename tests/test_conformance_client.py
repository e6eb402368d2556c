"""Our client against an independent raw server written from docs/protocol.md (§ = its sections).

The server side is ``tests/_independent.py``: its own frame builder and validator, no import of
the SDK's codec. Every frame our client sends is checked there; each test scripts what the
server answers and checks how ``Client.dial_worker`` / ``WorkerConnection`` react.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _independent import (
    T0,
    Peer,
    RawServer,
    assignment_body,
    command_body,
    dumps,
    fmt_time,
    frame,
    lease_body,
    new_id,
    new_secret,
    ref_of,
    welcome_body,
)
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.sync.server import ServerConnection

from orbit_sync import (
    AttemptRef,
    Backoff,
    CallTimeout,
    Capability,
    CapacityReport,
    Client,
    Finish,
    HTTPError,
    OrbitError,
    Registration,
    Worker,
    WorkerBackpressure,
    WorkerBusy,
    WorkerConnection,
    WorkerDisconnected,
    WorkerError,
    WorkerProtocolError,
)
from orbit_sync.testing import ManualClock

# The frame vectors kept in tests/vectors (a fresh clone must pass).
VECTORS = json.loads((Path(__file__).parent / "vectors" / "frames.json").read_text("utf-8"))
CTX = VECTORS["context"]
SID, MID, QID = CTX["session_id"], CTX["pending_message_ids"][0], CTX["queue_id"]
TOKEN = "tok-" + secrets.token_urlsafe(24)
WAIT = 5.0


class Background:
    """Run one blocking call on a daemon thread; ``result()`` returns or re-raises it."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        self._out: queue.Queue[tuple[bool, Any]] = queue.Queue()

        def run() -> None:
            try:
                self._out.put((True, fn(*args, **kw)))
            except BaseException as exc:
                self._out.put((False, exc))

        threading.Thread(target=run, name="conformance-call", daemon=True).start()

    def result(self, timeout: float = WAIT) -> Any:
        ok, value = self._out.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def error(self, timeout: float = WAIT) -> BaseException:
        ok, value = self._out.get(timeout=timeout)
        assert not ok, f"expected an error, got {value!r}"
        assert isinstance(value, BaseException)
        return value


def registration(**kw: Any) -> Registration:
    kw.setdefault("queue_id", QID)
    kw.setdefault("capabilities", [Capability(**c) for c in CTX["capabilities"]])
    kw.setdefault("capacity", 4)
    kw.setdefault("instance_id", new_id())
    kw.setdefault("instance_secret", new_secret())
    return Registration(**kw)


REF = AttemptRef(task_id="1" * 32, attempt_id="2" * 32, epoch=1, lease_secret="s" * 43)


@pytest.fixture
def raw() -> Iterator[RawServer]:
    with RawServer() as server:
        yield server


@pytest.fixture
def conns() -> Iterator[list[WorkerConnection]]:
    """Connections opened by a test; closed (threads joined) at its end."""
    opened: list[WorkerConnection] = []
    yield opened
    for conn in opened:
        conn.close()


def dial(raw: RawServer, reg: Registration | None = None, **kw: Any) -> Background:
    return Background(Client(raw.url, TOKEN).dial_worker, reg or registration(), **kw)


def session(
    raw: RawServer,
    conns: list[WorkerConnection],
    reg: Registration | None = None,
    *,
    epoch: int = 1,
    session_id: str | None = None,
    **kw: Any,
) -> tuple[WorkerConnection, Peer]:
    """Dial, answer the hello with a valid welcome; the connection and the server's peer."""
    pending = dial(raw, reg, **kw)
    peer = raw.accept()
    peer.handshake(epoch, session_id=session_id)
    conn: WorkerConnection = pending.result()
    conns.append(conn)
    assert conn.session_id == peer.session_id
    return conn, peer


def still_open(conn: WorkerConnection, peer: Peer) -> None:
    """A capacity round trip succeeds: the connection survived what came before."""
    call = Background(conn.capacity, CapacityReport(sequence=9, capacity=1))
    request = peer.recv()
    assert request["type"] == "worker.capacity"
    peer.reply(request, welcome_body(conn.session_id, peer.epoch))
    assert call.result().session_id == conn.session_id
    assert conn.err is None


def ended(conn: WorkerConnection, peer: Peer, kind: type[BaseException]) -> None:
    """The connection ended with *kind* and our client closed the socket."""
    assert conn.done.wait(WAIT)
    assert isinstance(conn.err, kind), repr(conn.err)
    assert peer.closed(WAIT)


# --------------------------------------------------------------------------- dial (§1, §5.1-§5.2)


def test_upgrade_request_and_hello(raw: RawServer, conns: list[WorkerConnection]) -> None:
    """Bearer token, subprotocol offered, no query, no compression; hello within 5 s (§1, §5.1)."""
    reg = registration(capacity=7)
    pending = dial(raw, reg)
    peer = raw.accept()
    request = raw.requests[0]
    assert request.path == "/v1/worker/connect"
    assert request.headers.get_all("Authorization") == [f"Bearer {TOKEN}"]
    offered = [
        p.strip() for h in request.headers.get_all("Sec-WebSocket-Protocol") for p in h.split(",")
    ]
    assert "pulse.worker.v1" in offered
    assert not any("deflate" in h for h in request.headers.get_all("Sec-WebSocket-Extensions"))
    assert TOKEN not in request.path
    hello = peer.recv(timeout=5.0)  # checked: no session_id, closed envelope and body
    assert hello["type"] == "worker.hello"
    body = hello["body"]
    assert body["instance_id"] == reg.instance_id
    assert body["instance_secret"] == reg.instance_secret
    assert body["queue_id"] == QID
    assert body["capacity"] == 7
    assert body["capabilities"] == CTX["capabilities"]
    assert body.get("cancellation_notifications", False) is False
    peer.welcome(hello, 3, session_id=SID, draining=True)
    conn: WorkerConnection = pending.result()
    conns.append(conn)
    assert (conn.session_id, conn.welcome.epoch, conn.welcome.draining) == (SID, 3, True)


def test_base_path_prefix_is_kept(conns: list[WorkerConnection]) -> None:
    """The connect path is appended to the base URL's path (§1)."""
    with RawServer() as raw:
        pending = Background(Client(raw.url + "/orbit", TOKEN).dial_worker, registration())
        raw.accept().handshake()
        conns.append(pending.result())
        assert raw.requests[0].path == "/orbit/v1/worker/connect"


def _welcome_text(hello_id: str, mutate: Callable[[dict[str, Any]], Any] | None = None) -> str:
    f = frame("worker.welcome", session_id=SID, reply_to=hello_id, body=welcome_body(SID, 2))
    if mutate is not None:
        mutate(f)
    return dumps(f)


def _vector_welcome(name: str) -> Callable[[str], str]:
    text = next(v["frame"] for v in VECTORS["welcome_answering_pending_hello"] if v["name"] == name)
    return lambda hello_id: text.replace(MID, hello_id)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(f: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = f
        for p in parents:
            target = target[p]
        target[last] = value

    return mutate


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(f: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = f
        for p in parents:
            target = target[p]
        del target[last]

    return mutate


INVALID_WELCOMES: dict[str, Callable[[str], str]] = {
    **{
        v["name"]: _vector_welcome(v["name"])
        for v in VECTORS["welcome_answering_pending_hello"]
        if not v["valid"]
    },
    "no-reply-to": lambda h: _welcome_text(h, _drop("reply_to")),
    "reply-to-other": lambda h: _welcome_text(h, _set("reply_to", new_id())),
    "frame-without-session": lambda h: _welcome_text(h, _drop("session_id")),
    "envelope-unknown-field": lambda h: _welcome_text(h, _set("trace", "x")),
    "protocol-version-2": lambda h: _welcome_text(h, _set("protocol_version", "2")),
    "type-ack": lambda h: _welcome_text(h, _set("type", "ack")),
    "with-error-field": lambda h: _welcome_text(h, _set("error", {"code": "X", "message": ""})),
    "epoch-leading-zero": lambda h: _welcome_text(h, _set("body.epoch", "02")),
    "epoch-number": lambda h: _welcome_text(h, _set("body.epoch", 2)),
    "lease-bool": lambda h: _welcome_text(h, _set("body.lease_duration_ms", True)),
    "lease-string": lambda h: _welcome_text(h, _set("body.lease_duration_ms", "30000")),
    "draining-string": lambda h: _welcome_text(h, _set("body.draining", "false")),
    "server-time-offset": lambda h: _welcome_text(
        h, _set("body.server_time", "2026-09-17T08:00:00+00:00")
    ),
    "expires-before": lambda h: _welcome_text(h, _set("body.expires_at", "2026-09-17T07:59:59Z")),
    "expires-300.001-s": lambda h: _welcome_text(
        h, _set("body.expires_at", "2026-09-17T08:05:00.001Z")
    ),
    "session-id-uppercase": lambda h: _welcome_text(
        h, lambda f: (f.update(session_id="A" * 32), f["body"].update(session_id="A" * 32))
    ),
    "body-not-object": lambda h: _welcome_text(h, _set("body", [])),
    "duplicate-key": lambda h: _welcome_text(h)[:-1] + ', "type": "worker.welcome"}',
    "not-json": lambda h: "{not json",
    "assign-first": lambda h: dumps(
        frame("task.assign", session_id=SID, body=assignment_body(QID))
    ),
}


@pytest.mark.parametrize("make", INVALID_WELCOMES.values(), ids=INVALID_WELCOMES.keys())
def test_invalid_welcome_fails_the_dial(raw: RawServer, make: Callable[[str], str]) -> None:
    """A welcome breaking §5.1/§5.2/§2/§12 fails the dial with WorkerProtocolError, closed."""
    pending = dial(raw)
    peer = raw.accept()
    hello = peer.recv()
    peer.send(make(hello["message_id"]))
    err = pending.error()
    assert isinstance(err, WorkerProtocolError), repr(err)
    assert peer.closed(WAIT)


VALID_WELCOMES: dict[str, Callable[[str], str]] = {
    **{
        v["name"]: _vector_welcome(v["name"])
        for v in VECTORS["welcome_answering_pending_hello"]
        if v["valid"]
    },
    "expires-exactly-5-min": lambda h: _welcome_text(
        h, _set("body.expires_at", "2026-09-17T08:05:00Z")
    ),
    "lease-1000-ms": lambda h: _welcome_text(h, _set("body.lease_duration_ms", 1000)),
    "epoch-beyond-64-bits": lambda h: _welcome_text(h, _set("body.epoch", "99999999999999999999")),
    "lease-120000-ms": lambda h: _welcome_text(h, _set("body.lease_duration_ms", 120_000)),
    "unknown-body-fields": lambda h: _welcome_text(
        h, lambda f: f["body"].update(region="eu", limits={"x": [1, 2.5]})
    ),
    "fraction-9-digits": lambda h: _welcome_text(
        h, _set("body.server_time", "2026-09-17T08:00:00.123456789Z")
    ),
    "far-from-local-clock": lambda h: _welcome_text(
        h,
        lambda f: f["body"].update(
            server_time="1999-12-31T23:59:59Z", expires_at="2000-01-01T00:00:44Z"
        ),
    ),
}


@pytest.mark.parametrize("make", VALID_WELCOMES.values(), ids=VALID_WELCOMES.keys())
def test_valid_welcome_opens_the_session(
    raw: RawServer, conns: list[WorkerConnection], make: Callable[[str], str]
) -> None:
    """A conforming welcome is accepted; the session id comes from it (§5.2)."""
    pending = dial(raw)
    peer = raw.accept()
    hello = peer.recv()
    peer.send(make(hello["message_id"]))
    conn: WorkerConnection = pending.result()
    conns.append(conn)
    assert conn.session_id == SID
    peer.session_id, peer.epoch = SID, conn.welcome.epoch
    still_open(conn, peer)


@pytest.mark.parametrize("with_session", [False, True], ids=["no-session-id", "session-id"])
@pytest.mark.parametrize("code", ["PERMISSION_DENIED", "UNAUTHENTICATED", "QUOTA_EXCEEDED"])
def test_error_answering_hello_is_a_worker_error(
    raw: RawServer, code: str, with_session: bool
) -> None:
    """An error answering the hello, with or without session_id, is raised as WorkerError (§12)."""
    pending = dial(raw)
    peer = raw.accept()
    hello = peer.recv()
    sid = new_id() if with_session else None
    peer.send(frame("error", session_id=sid, reply_to=hello["message_id"], error=(code, "no")))
    err = pending.error()
    assert type(err) is WorkerError, repr(err)
    assert err.code == code


def test_error_without_reply_to_before_the_welcome_fails_the_dial(raw: RawServer) -> None:
    """An error without reply_to instead of the welcome ends the dial (§11)."""
    # docs/protocol.md does not say whether that is a WorkerError or a protocol error: both are
    # accepted.
    pending = dial(raw)
    peer = raw.accept()
    peer.recv()
    peer.send(frame("error", error=("UNAVAILABLE", "later")))
    err = pending.error()
    assert isinstance(err, WorkerError | WorkerProtocolError), repr(err)
    assert peer.closed(WAIT)


def test_subprotocol_not_selected_is_a_protocol_error() -> None:
    """A server that does not select pulse.worker.v1 fails the dial (§1)."""
    with RawServer(select=lambda offered: None) as raw:
        err = dial(raw).error()
        assert isinstance(err, WorkerProtocolError), repr(err)


def _refuse(status: int, location: str | None = None) -> Callable[..., Response]:
    def refuse(ws: ServerConnection, request: Request) -> Response:
        response = ws.respond(status, "refused\n")
        if location is not None:
            response.headers["Location"] = location
        return response

    return refuse


@pytest.mark.parametrize("status", [401, 403, 503])
def test_refused_upgrade_is_an_http_error(status: int) -> None:
    """A non-101 answer raises HTTPError with its status, without the token (§1)."""
    with RawServer(refuse=_refuse(status)) as raw:
        err = dial(raw).error()
        assert isinstance(err, HTTPError), repr(err)
        assert err.status_code == status
        assert TOKEN not in str(err) and TOKEN not in repr(err)


def test_redirect_is_reported_not_followed() -> None:
    """A 3xx answer raises HTTPError and is never followed (§12)."""
    with RawServer() as target:
        redirect = _refuse(307, target.url + "/v1/worker/connect")
        with RawServer(refuse=redirect) as raw:
            err = dial(raw).error()
            assert isinstance(err, HTTPError), repr(err)
            assert err.status_code == 307
            assert target.requests == []


def test_dial_is_bounded(raw: RawServer) -> None:
    """A dial whose welcome never comes raises CallTimeout within its bound (§1, §12)."""
    started = time.monotonic()
    pending = dial(raw, timeout=0.5)
    peer = raw.accept()
    assert peer.recv()["type"] == "worker.hello"
    err = pending.error()
    assert isinstance(err, CallTimeout), repr(err)
    assert time.monotonic() - started < 3.0


# --------------------------------------------------------------------------- requests (§2, §4, §7)


def test_requests_are_well_formed(
    raw: RawServer, conns: list[WorkerConnection], caplog: pytest.LogCaptureFixture
) -> None:
    """Requests carry session id, canonical counters, explicit drain; nothing secret logged."""
    caplog.set_level(logging.DEBUG, logger="orbit_sync")
    reg = registration()
    conn, peer = session(raw, conns, reg, epoch=4)
    ids = set()

    call = Background(conn.capacity, CapacityReport(sequence=12, capacity=0))
    req = peer.recv()
    assert req["body"] == {"sequence": "12", "capacity": 0, "drain": False}
    peer.reply(req, welcome_body(conn.session_id, 4))
    call.result()
    ids.add(req["message_id"])

    a = assignment_body(QID, epoch=7)
    peer.push("task.assign", a)
    ref = conn.next_assignment(WAIT).attempt
    wire_ref = {
        "task_id": a["task"]["task_id"],
        "attempt_id": a["attempt_id"],
        "epoch": "7",
        "lease_secret": a["lease_secret"],
    }
    for kind, method, answer in (
        ("worker.resume", conn.resume, lease_body()),
        ("task.start", conn.start, command_body("start")),
        ("task.renew", conn.renew, command_body("renew")),
    ):
        call = Background(method, ref)
        req = peer.recv()
        assert (req["type"], req["body"]) == (kind, wire_ref)
        peer.reply(req, answer)
        call.result()
        ids.add(req["message_id"])

    finishes = [
        (Finish(ref=ref, outcome="SUCCEEDED", result={"ok": [1, "é"]}), {}),
        (
            Finish(ref=ref, outcome="FAILED", result=0, error_code="BOOM", retryable=True),
            {"error_code": "BOOM", "retryable": True},
        ),
        (Finish(ref=ref, outcome="UNKNOWN", result="?", error_code="LOST"), {"error_code": "LOST"}),
    ]
    for fin, extra in finishes:
        call = Background(conn.finish, fin)
        req = peer.recv()
        body = req["body"]
        assert body["ref"] == wire_ref
        assert body["outcome"] == fin.outcome.value
        assert body["result"] == fin.result
        assert {k: body[k] for k in ("error_code", "retryable") if k in body} == extra
        peer.reply(req, command_body("finish", task_state="SUCCEEDED", attempt_state="SUCCEEDED"))
        call.result()
        ids.add(req["message_id"])
    assert len(ids) == 7  # one fresh message_id per operation
    for secret in (TOKEN, reg.instance_secret, a["lease_secret"]):
        assert secret not in caplog.text


def test_timed_out_operation_keeps_its_message_id(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """An unanswered call names its message_id, re-sent unchanged on the next session (§7, §10)."""
    conn, peer = session(raw, conns, max_call_timeout=0.3)
    call = Background(conn.start, REF)
    sent = peer.recv()
    err = call.error()
    assert isinstance(err, CallTimeout), repr(err)
    assert err.message_id == sent["message_id"]
    ended(conn, peer, CallTimeout)
    again, peer2 = session(raw, conns, conn.registration, epoch=2)
    call = Background(again.start, REF, message_id=err.message_id)
    resent = peer2.recv()
    assert resent["message_id"] == sent["message_id"]
    assert resent["session_id"] == again.session_id != conn.session_id
    assert resent["body"] == sent["body"]
    peer2.reply(resent, command_body("start", deduplicated=True))
    assert call.result().deduplicated is True


def test_disconnect_names_the_operation(raw: RawServer, conns: list[WorkerConnection]) -> None:
    """A connection lost under a call raises an error carrying that call's message_id (§7)."""
    conn, peer = session(raw, conns)
    call = Background(conn.finish, Finish(ref=REF, outcome="SUCCEEDED", result=1))
    sent = peer.recv()
    peer.close()
    err = call.error()
    assert isinstance(err, WorkerDisconnected), repr(err)
    assert err.message_id == sent["message_id"]


def test_oversized_result_is_refused_before_sending(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """A result over 256 KiB is never sent (§2)."""
    conn, peer = session(raw, conns)
    with pytest.raises(ValueError):
        conn.finish(Finish(ref=REF, outcome="SUCCEEDED", result="x" * (256 * 1024)))
    still_open(conn, peer)  # the next frame the server reads is the capacity report


def test_in_flight_requests_are_bounded(raw: RawServer, conns: list[WorkerConnection]) -> None:
    """A 33rd concurrent request raises WorkerBusy and sends nothing (§10)."""
    conn, peer = session(raw, conns)
    calls = [Background(conn.renew, REF) for _ in range(32)]
    requests = [peer.recv() for _ in range(32)]
    with pytest.raises(WorkerBusy):
        conn.renew(REF)
    for req in requests:
        peer.reply(req, command_body("renew"))
    for call in calls:
        call.result()
    still_open(conn, peer)


# --------------------------------------------------------------------------- server frames


S2C = VECTORS["server_to_client"]


@pytest.mark.parametrize("vector", S2C, ids=[v["name"] for v in S2C])
def test_server_vector_over_a_live_session(
    raw: RawServer, conns: list[WorkerConnection], vector: dict[str, Any]
) -> None:
    """Each server vector is accepted, or fails the connection and every waiter (§2-§6, §11)."""
    conn, peer = session(raw, conns, session_id=SID, epoch=2)
    call = Background(conn.start, REF, message_id=MID)
    assert peer.recv()["message_id"] == MID
    if not vector["valid"]:
        # More waiters, released too: another request in flight and a reader of assignments.
        other = Background(conn.capacity, CapacityReport(sequence=1, capacity=4))
        assert peer.recv()["type"] == "worker.capacity"
        reader = Background(conn.next_assignment, None)
    peer.send(vector["frame"])
    sent = json.loads(vector["frame"]) if vector["valid"] else None
    if sent is None:
        err = call.error()
        assert isinstance(err, WorkerProtocolError), repr(err)
        assert err.message_id == MID
        assert isinstance(other.error(), WorkerProtocolError)
        assert isinstance(reader.error(), WorkerProtocolError)
        ended(conn, peer, WorkerProtocolError)
    elif sent["type"] == "ack":
        result = call.result()
        assert result.receipt.task_revision == 3
        still_open(conn, peer)
    elif sent["type"] == "task.assign":
        assert conn.next_assignment(WAIT).task.task_id == sent["body"]["task"]["task_id"]
        peer.reply({"message_id": MID}, command_body("start"))
        call.result()
        still_open(conn, peer)
    elif "reply_to" in sent:
        err = call.error()
        assert type(err) is WorkerError, repr(err)
        assert err.code == sent["error"]["code"]
        still_open(conn, peer)  # neither code is fatal (§11, §12)
    else:
        err = call.error()
        assert isinstance(err, WorkerError), repr(err)
        ended(conn, peer, WorkerError)


def test_lease_deadline_uses_only_the_server_difference(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """deadline = t_sent + (lease_until - server_time) - 250 ms, never the wall clock (§6.6)."""
    clock = ManualClock(1000.0)
    conn, peer = session(raw, conns, clock=clock)
    call = Background(conn.start, REF)
    req = peer.recv()
    old = T0 - 10**9 * 86_400 * 365 * 20  # twenty years ago: only the difference counts
    peer.reply(req, command_body("start", lease=lease_body(now=old, window=12.5)))
    lease = call.result().lease
    assert lease.deadline == pytest.approx(1000.0 + 12.5 - 0.25)
    clock.advance(12.2)
    assert lease.may_run(clock) and lease.remaining(clock) == pytest.approx(0.05)
    clock.advance(lease.deadline - clock.now())
    assert not lease.may_run(clock) and lease.remaining(clock) == 0.0


def _lease_at(server_time: str, lease_until: str) -> dict[str, Any]:
    return {
        "active": True,
        "state": "RUNNING",
        "server_time": server_time,
        "lease_until": lease_until,
    }


@pytest.mark.parametrize(
    ("lease", "valid"),
    [
        pytest.param(_lease_at("2026-09-17T08:00:00Z", "2026-09-17T08:02:00Z"), True, id="2-min"),
        pytest.param(
            _lease_at("2026-09-17T08:00:00Z", "2026-09-17T08:02:00.000000001Z"),
            False,
            id="2-min-plus-1ns",
        ),
        pytest.param(
            _lease_at("2026-09-17T08:00:00.000000001Z", "2026-09-17T08:02:00.000000001Z"),
            True,
            id="2-min-at-nanoseconds",
        ),
        pytest.param(
            _lease_at("2026-09-17T08:00:00Z", "2026-09-17T08:00:00.000000001Z"), True, id="1ns"
        ),
        pytest.param(
            _lease_at("2026-09-17T08:00:00.0000001Z", "2026-09-17T08:00:00.0000009Z"),
            True,
            id="800ns-within-one-microsecond",
        ),
        pytest.param(
            _lease_at("2026-09-17T08:00:00.0000009Z", "2026-09-17T08:00:00.0000001Z"),
            False,
            id="minus-800ns",
        ),
        pytest.param(
            _lease_at("2026-09-17T08:00:00.000000001Z", "2026-09-17T08:00:00.000000001Z"),
            False,
            id="zero-at-nanoseconds",
        ),
    ],
)
def test_active_lease_window_is_exact_to_the_nanosecond(
    raw: RawServer, conns: list[WorkerConnection], lease: dict[str, Any], valid: bool
) -> None:
    """Times carry up to 9 fraction digits (§12), so (0, 2 min] is checked on all of them (§6.6)."""
    conn, peer = session(raw, conns)
    call = Background(conn.start, REF)
    peer.reply(peer.recv(), command_body("start", lease=lease))
    if valid:
        assert call.result().lease.active is True
        still_open(conn, peer)
    else:
        assert isinstance(call.error(), WorkerProtocolError)
        ended(conn, peer, WorkerProtocolError)


@pytest.mark.parametrize(
    ("expires_at", "valid"),
    [
        pytest.param("2026-09-17T08:05:00.000000001Z", False, id="5-min-plus-1ns"),
        pytest.param("2026-09-17T08:05:00.0000001Z", False, id="5-min-plus-100ns"),
        pytest.param("2026-09-17T08:00:00.000000001Z", True, id="1ns"),
    ],
)
def test_session_window_is_exact_to_the_nanosecond(
    raw: RawServer, conns: list[WorkerConnection], expires_at: str, valid: bool
) -> None:
    """expires_at is after server_time and at most 5 minutes later, to the nanosecond (§5.2)."""
    pending = dial(raw)
    peer = raw.accept()
    hello = peer.recv()
    peer.send(_welcome_text(hello["message_id"], _set("body.expires_at", expires_at)))
    if valid:
        conns.append(pending.result())
    else:
        assert isinstance(pending.error(), WorkerProtocolError)


@pytest.mark.parametrize(
    "lease",
    [
        pytest.param(lease_body(state="LEASED"), id="leased-reservation"),
        pytest.param(lease_body(cancel_requested_at=T0 - 10**9), id="cancel-requested"),
        pytest.param(lease_body(active=False, state="EXPIRED"), id="inactive"),
        pytest.param(lease_body(active=False, state="RUNNING"), id="inactive-running"),
        pytest.param(lease_body(active=False, window=-60), id="inactive-in-the-past"),
        pytest.param(lease_body(active=False, window=600), id="inactive-beyond-2-min"),
    ],
)
def test_only_an_active_running_uncancelled_lease_may_run(
    raw: RawServer, conns: list[WorkerConnection], lease: dict[str, Any]
) -> None:
    """A receipt never revives a lease: only active + RUNNING + no cancel may run (§6.5)."""
    conn, peer = session(raw, conns)
    call = Background(conn.start, REF)
    peer.reply(peer.recv(), command_body("start", lease=lease))
    assert call.result().lease.may_run() is False


def test_capacity_ack_with_own_session_is_accepted(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """The capacity ack is a Welcome naming the session's own id and epoch (§4, §12)."""
    conn, peer = session(raw, conns, epoch=5)
    call = Background(conn.capacity, CapacityReport(sequence=1, capacity=4, drain=True))
    req = peer.recv()
    assert req["body"]["drain"] is True
    peer.reply(req, welcome_body(conn.session_id, 5, now=T0 + 10**9, draining=True))
    ack = call.result()
    assert (ack.session_id, ack.epoch, ack.draining) == (conn.session_id, 5, True)


BAD_CAPACITY_ACKS: dict[str, Callable[[str, int], dict[str, Any]]] = {
    "other-session": lambda sid, epoch: welcome_body(new_id(), epoch),
    "other-epoch": lambda sid, epoch: welcome_body(sid, epoch + 1),
    "lease-body": lambda sid, epoch: lease_body(),
    "window-over-5-min": lambda sid, epoch: welcome_body(sid, epoch, window=301),
    "missing-draining": lambda sid, epoch: {
        k: v for k, v in welcome_body(sid, epoch).items() if k != "draining"
    },
}


@pytest.mark.parametrize("make", BAD_CAPACITY_ACKS.values(), ids=BAD_CAPACITY_ACKS.keys())
def test_bad_capacity_ack_is_a_protocol_error(
    raw: RawServer,
    conns: list[WorkerConnection],
    make: Callable[[str, int], dict[str, Any]],
) -> None:
    """A capacity ack naming another session or epoch, or not a Welcome, is fatal (§12)."""
    conn, peer = session(raw, conns, epoch=2)
    call = Background(conn.capacity, CapacityReport(sequence=1, capacity=4))
    peer.reply(peer.recv(), make(conn.session_id, 2))
    assert isinstance(call.error(), WorkerProtocolError)
    ended(conn, peer, WorkerProtocolError)


def test_second_answer_to_one_request_is_a_protocol_error(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """Once answered, a request is no longer pending: another answer names nothing (§2)."""
    conn, peer = session(raw, conns)
    call = Background(conn.start, REF)
    req = peer.recv()
    peer.reply(req, command_body("start"))
    call.result()
    peer.reply(req, command_body("start"))
    ended(conn, peer, WorkerProtocolError)


@pytest.mark.parametrize("code", ["UNAUTHENTICATED", "PERMISSION_DENIED", "STALE_SESSION"])
def test_fatal_code_is_delivered_then_the_connection_closes(
    raw: RawServer, conns: list[WorkerConnection], code: str
) -> None:
    """A fatal code reaches its caller, then the client closes the connection (§11)."""
    conn, peer = session(raw, conns)
    call = Background(conn.renew, REF)
    peer.fail(peer.recv(), code)
    err = call.error()
    assert type(err) is WorkerError and err.code == code, repr(err)
    ended(conn, peer, WorkerError)


@pytest.mark.parametrize(
    "code",
    [
        "LEASE_LOST",
        "STATE_CONFLICT",
        "IDEMPOTENCY_CONFLICT",
        "RATE_LIMITED",
        "UNAVAILABLE",
        "QUOTA_EXCEEDED",
        "X",
        "A" * 64,
    ],
)
def test_non_fatal_code_keeps_the_connection(
    raw: RawServer, conns: list[WorkerConnection], code: str
) -> None:
    """Other codes, unknown ones included, are delivered and are not fatal (§11, §12)."""
    conn, peer = session(raw, conns)
    message = "" if code == "X" else "public message"  # any string is a message
    call = Background(conn.renew, REF)
    sent = peer.recv()
    peer.fail(sent, code, message)
    err = call.error()
    assert type(err) is WorkerError, repr(err)
    assert (err.code, err.message, err.message_id) == (code, message, sent["message_id"])
    still_open(conn, peer)


def test_error_without_reply_to_releases_every_caller(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """An error without reply_to ends the connection and releases every waiting caller (§11)."""
    conn, peer = session(raw, conns)
    calls = [
        Background(conn.capacity, CapacityReport(sequence=1, capacity=1)),
        Background(conn.start, REF),
        Background(conn.renew, REF),
    ]
    for _ in calls:
        peer.recv()
    consumer = Background(conn.next_assignment, None)
    peer.send(frame("error", session_id=conn.session_id, error=("QUOTA_EXCEEDED", "bye")))
    for call in calls:
        assert isinstance(call.error(), OrbitError)
    assert isinstance(consumer.error(), OrbitError)
    ended(conn, peer, WorkerError)


def test_unknown_fields_in_bodies_are_ignored(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """Unknown fields in server bodies, at any depth, are tolerated (§2 [decided], §12)."""
    conn, peer = session(raw, conns, registration(cancellation_notifications=True))
    a = assignment_body(QID)
    a["hint"] = {"x": 1}
    a["task"]["labels"] = ["a", "b"]
    peer.push("task.assign", a)
    assert conn.next_assignment(WAIT).attempt_id == a["attempt_id"]
    call = Background(conn.start, REF)
    body = command_body("start")
    body["receipt"]["shard"] = 7
    body["lease"]["region"] = "eu"
    body["extra"] = None
    peer.reply(peer.recv(), body)
    assert call.result().lease.may_run()
    cancel = {
        "task_id": REF.task_id,
        "attempt_id": REF.attempt_id,
        "epoch": "1",
        "cancel_requested_at": fmt_time(T0),
        "reason": "operator",
    }
    peer.push("task.cancel", cancel)
    assert conn.next_cancel(WAIT).task_id == REF.task_id
    call = Background(conn.resume, REF)
    lease = lease_body()
    lease["note"] = "x"
    peer.reply(peer.recv(), lease)
    assert call.result().active is True


def test_task_cancel_is_delivered_when_asked_for(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """task.cancel reaches a session that asked for cancellation notifications (§4 [decided])."""
    conn, peer = session(raw, conns, registration(cancellation_notifications=True))
    peer.push(
        "task.cancel",
        {
            "task_id": REF.task_id,
            "attempt_id": REF.attempt_id,
            "epoch": "1",
            "cancel_requested_at": "2026-09-17T08:00:10.5Z",
        },
    )
    notice = conn.next_cancel(WAIT)
    assert (notice.task_id, notice.attempt_id, notice.epoch) == (REF.task_id, REF.attempt_id, 1)
    still_open(conn, peer)


def test_ninth_unread_assignment_closes_the_connection(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """Eight unread assignments are buffered; a ninth closes the connection (§10)."""
    conn, peer = session(raw, conns)
    for _ in range(8):
        peer.push("task.assign", assignment_body(QID))
    still_open(conn, peer)  # answered after the eight pushes were read: they were all kept
    call = Background(conn.renew, REF)
    peer.recv()
    peer.push("task.assign", assignment_body(QID))
    assert isinstance(call.error(), WorkerBackpressure)
    ended(conn, peer, WorkerBackpressure)


def test_binary_frame_is_a_protocol_error(raw: RawServer, conns: list[WorkerConnection]) -> None:
    """A binary frame is a protocol error (§1)."""
    conn, peer = session(raw, conns)
    peer.send(dumps(frame("task.assign", session_id=SID, body=assignment_body(QID))).encode())
    ended(conn, peer, WorkerProtocolError)


def test_read_idle_bound_closes_a_silent_connection(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """Nothing received for the read-idle bound ends the connection (§10; bound shortened)."""
    conn, peer = session(raw, conns, read_idle_timeout=0.3)
    ended(conn, peer, WorkerDisconnected)


def test_call_bound_closes_the_connection(raw: RawServer, conns: list[WorkerConnection]) -> None:
    """An unanswered call raises CallTimeout and closes the connection (§10, §12)."""
    conn, peer = session(raw, conns)
    call = Background(conn.renew, REF, timeout=0.3)
    peer.recv()
    err = call.error()
    assert isinstance(err, CallTimeout), repr(err)
    ended(conn, peer, CallTimeout)


# --------------------------------------------------------------------------- limits and transport


def _ack_of_size(reply_to: str, size: int) -> str:
    """A valid start ack padded (in an unknown body field) to exactly *size* bytes."""
    body = command_body("start")
    body["pad"] = ""
    text = dumps(frame("ack", session_id=SID, reply_to=reply_to, body=body))
    body["pad"] = "x" * (size - len(text.encode("utf-8")))
    text = dumps(frame("ack", session_id=SID, reply_to=reply_to, body=body))
    assert len(text.encode("utf-8")) == size
    return text


@pytest.mark.parametrize(("size", "valid"), [(524_288, True), (524_289, False)])
def test_frame_size_limit_is_512_kib(
    raw: RawServer, conns: list[WorkerConnection], size: int, valid: bool
) -> None:
    """A server frame of 524,288 bytes is read; one byte more is a protocol error (§2)."""
    conn, peer = session(raw, conns, session_id=SID)
    call = Background(conn.start, REF)
    peer.send(_ack_of_size(peer.recv()["message_id"], size))
    if valid:
        assert call.result().receipt.operation.value == "start"
        still_open(conn, peer)
    else:
        assert isinstance(call.error(), WorkerProtocolError)
        ended(conn, peer, WorkerProtocolError)


def test_result_of_exactly_256_kib_is_sent(raw: RawServer, conns: list[WorkerConnection]) -> None:
    """A result of 262,144 bytes serialized is within the limit and is sent (§2)."""
    conn, peer = session(raw, conns)
    result = "é" * ((256 * 1024 - 2) // 2)  # 2 bytes each in UTF-8, plus the quotes
    assert len(dumps(result).encode("utf-8")) == 256 * 1024
    call = Background(conn.finish, Finish(ref=REF, outcome="SUCCEEDED", result=result))
    req = peer.recv()
    assert req["body"]["result"] == result
    peer.reply(req, command_body("finish", task_state="SUCCEEDED", attempt_state="SUCCEEDED"))
    call.result()


@pytest.mark.parametrize("payload", [False, 0, "", [], {}, 1.5, "null"], ids=repr)
def test_any_payload_but_null_is_accepted(
    raw: RawServer, conns: list[WorkerConnection], payload: Any
) -> None:
    """A task's payload is any JSON except null (§4, §6.1)."""
    conn, peer = session(raw, conns)
    a = assignment_body(QID)
    a["task"]["payload"] = payload
    peer.push("task.assign", a)
    assert conn.next_assignment(WAIT).task.payload == payload
    still_open(conn, peer)


def test_other_subprotocol_selected_is_a_protocol_error() -> None:
    """A server selecting a subprotocol other than pulse.worker.v1 fails the dial (§1)."""
    with RawServer(select=lambda offered: "pulse.worker.v2") as raw:
        err = dial(raw).error()
        assert isinstance(err, WorkerProtocolError | HTTPError), repr(err)


@pytest.mark.parametrize("status", [200, 400, 500])
def test_any_non_101_answer_is_an_http_error(status: int) -> None:
    """Any answer other than 101 to the upgrade is an HTTPError carrying its status (§1)."""
    with RawServer(refuse=_refuse(status)) as raw:
        err = dial(raw).error()
        assert isinstance(err, HTTPError), repr(err)
        assert err.status_code == status


def test_silent_server_bounds_the_dial() -> None:
    """A server that accepts TCP and never answers the upgrade: CallTimeout in time (§1, §12)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        started = time.monotonic()
        pending = Background(
            Client(f"ws://127.0.0.1:{port}", TOKEN).dial_worker, registration(), timeout=0.5
        )
        accepted, _ = listener.accept()
        with accepted:
            err = pending.error()
        assert isinstance(err, CallTimeout), repr(err)
        assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("kind", [["ack"], {"t": "ack"}, 1, None], ids=repr)
def test_non_string_frame_type_is_a_protocol_error(
    raw: RawServer, conns: list[WorkerConnection], kind: Any
) -> None:
    """A frame type of the wrong JSON type is a protocol error, like any wrong type (§2)."""
    conn, peer = session(raw, conns, session_id=SID)
    call = Background(conn.start, REF)
    bad = frame(
        "ack", session_id=SID, reply_to=peer.recv()["message_id"], body=command_body("start")
    )
    bad["type"] = kind
    peer.send(bad)
    assert isinstance(call.error(), WorkerProtocolError)
    ended(conn, peer, WorkerProtocolError)


@pytest.mark.parametrize("kind", [["worker.welcome"], {"t": 1}], ids=repr)
def test_non_string_welcome_type_fails_the_dial(raw: RawServer, kind: Any) -> None:
    """The welcome's type of the wrong JSON type fails the dial as a protocol error (§2)."""
    pending = dial(raw)
    peer = raw.accept()
    hello = peer.recv()
    peer.send(_welcome_text(hello["message_id"], _set("type", kind)))
    assert isinstance(pending.error(), WorkerProtocolError)


def test_fragmented_message_is_one_frame(raw: RawServer, conns: list[WorkerConnection]) -> None:
    """A text message split into WebSocket fragments is read as one frame (§1, §2)."""
    conn, peer = session(raw, conns, session_id=SID)
    call = Background(conn.start, REF)
    text = dumps(
        frame("ack", session_id=SID, reply_to=peer.recv()["message_id"], body=command_body("start"))
    )
    peer.ws.send([text[:10], text[10:100], text[100:]])
    assert call.result().receipt.operation.value == "start"
    still_open(conn, peer)


def test_fragments_over_512_kib_are_a_protocol_error(
    raw: RawServer, conns: list[WorkerConnection]
) -> None:
    """The 512 KiB bound covers a whole fragmented message (§2)."""
    conn, peer = session(raw, conns, session_id=SID)
    call = Background(conn.start, REF)
    text = _ack_of_size(peer.recv()["message_id"], 524_289)
    with contextlib.suppress(ConnectionClosed):
        peer.ws.send([text[i : i + 65_536] for i in range(0, len(text), 65_536)])
    assert isinstance(call.error(), WorkerProtocolError)
    ended(conn, peer, WorkerProtocolError)


def test_ping_is_answered(raw: RawServer, conns: list[WorkerConnection]) -> None:
    """A WebSocket ping from the server is answered while the session is idle (§1)."""
    conn, peer = session(raw, conns)
    assert peer.ws.ping().wait(WAIT)
    assert conn.err is None


# --------------------------------------------------------------------------- the Worker (§7)


class Responder:
    """Answers every request of one connection as a conforming server would, on a daemon
    thread, and records them; ``drop`` decides which request is left unanswered and the
    connection cut instead (an ambiguous failure)."""

    def __init__(
        self,
        peer: Peer,
        *,
        after: Callable[[dict[str, Any]], None] | None = None,
        drop: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.peer = peer
        self.frames: queue.Queue[dict[str, Any]] = queue.Queue()
        self._after = after
        self._drop = drop
        threading.Thread(target=self._run, name="conformance-responder", daemon=True).start()

    def _run(self) -> None:
        peer = self.peer
        while True:
            try:
                f = peer.recv(timeout=30)
            except Exception:
                return
            if self._drop is not None and self._drop(f):
                self.frames.put(f)
                peer.close()
                return
            kind = f["type"]
            if kind == "worker.capacity":
                peer.reply(f, welcome_body(peer.session_id or "", peer.epoch))
            elif kind == "worker.resume":
                peer.reply(f, lease_body())
            elif kind == "task.finish":
                done = lease_body(active=False, state="SUCCEEDED")
                body = command_body(
                    "finish", task_state="SUCCEEDED", attempt_state="SUCCEEDED", lease=done
                )
                body["deduplicated"] = True
                peer.reply(f, body)
            else:
                peer.reply(f, command_body(kind.removeprefix("task.")))
            self.frames.put(f)
            if self._after is not None:
                self._after(f)

    def next(self, kind: str, timeout: float = WAIT) -> dict[str, Any]:
        """The next recorded request of *kind* (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            f = self.frames.get(timeout=max(0.0, deadline - time.monotonic()))
            if f["type"] == kind:
                return f


def test_worker_resends_an_ambiguous_finish_with_its_message_id(raw: RawServer) -> None:
    """A finish lost with its connection is resumed and re-sent with its message_id, once (§7)."""
    runs: list[Any] = []
    worker = Worker(
        Client(raw.url, TOKEN),
        queue_id=QID,
        capacity=2,
        reconnect_backoff=Backoff(initial=0.01, maximum=0.05),
        cancellation_notifications=False,
        handle_signals=False,
        dial_timeout=2.0,
    )

    @worker.handler("resize")
    def resize(ctx: Any, payload: Any) -> Any:
        runs.append(payload)
        return {"resized": payload}

    a = assignment_body(QID, payload={"w": 3})
    worker.start()
    try:
        first = raw.accept()
        hello1 = first.handshake()
        pushed = threading.Event()

        def assign_once(f: dict[str, Any]) -> None:
            if f["type"] == "worker.capacity" and not pushed.is_set():
                pushed.set()
                first.push("task.assign", a)

        r1 = Responder(first, after=assign_once, drop=lambda f: f["type"] == "task.finish")
        lost = r1.next("task.finish")
        second = raw.accept()
        hello2 = second.recv()
        for key in ("instance_id", "instance_secret", "queue_id", "capabilities", "capacity"):
            assert hello2["body"][key] == hello1["body"][key]
        second.welcome(hello2, 2)
        r2 = Responder(second)
        resumed = r2.next("worker.resume")
        assert resumed["body"] == ref_of(a)
        again = r2.next("task.finish")
        assert again["message_id"] == lost["message_id"]
        assert again["session_id"] == second.session_id != first.session_id
        assert again["body"] == lost["body"]
        assert again["body"]["result"] == {"resized": {"w": 3}}
    finally:
        worker.stop(drain=True, timeout=1.0)
    assert runs == [{"w": 3}]


@pytest.mark.parametrize(
    "garbage", [b"\xff", b"\xed\xa0\x80", b"\xc0\xaf"], ids=["ff", "cesu-surrogate", "overlong"]
)
def test_invalid_utf8_text_frame_is_a_protocol_error(
    raw: RawServer, conns: list[WorkerConnection], garbage: bytes
) -> None:
    """A text frame that is not UTF-8 is a protocol error (§2)."""
    conn, peer = session(raw, conns, session_id=SID)
    call = Background(conn.start, REF)
    body = command_body("start")
    body["note"] = "@"
    text = dumps(frame("ack", session_id=SID, reply_to=peer.recv()["message_id"], body=body))
    peer.ws.send(text.encode().replace(b"@", garbage), text=True)
    assert isinstance(call.error(), WorkerProtocolError)
    ended(conn, peer, WorkerProtocolError)
