"""An independent ``pulse.worker.v1`` peer, written from ``docs/protocol.md`` alone.

The SDK's client and its mock server decode frames through one shared module
(``orbit_sync._codec`` with ``models`` and ``_json``), so a bug there is invisible to tests that
pit them against each other. This module deliberately imports none of them: it is a second,
small implementation of the contract, used by ``tests/test_conformance_*.py``:

* a strict JSON reader (§2: duplicate keys, NaN/Infinity, non-finite numbers, lone surrogates,
  512 KiB);
* validators for server → client frames (what a conforming client must accept, under the
  client's context) and client → server frames (what a conforming server must accept);
* :class:`RawClient`, a raw client connection to a server (``websockets.sync.client``);
* :class:`RawServer`, a raw server that hands each accepted connection to the test thread
  (``websockets.sync.server``), so a test can script exactly what our client sees.

Section numbers (§) refer to docs/protocol.md.
"""

from __future__ import annotations

import base64
import calendar
import collections
import contextlib
import dataclasses
import datetime as _dt
import inspect
import json
import math
import queue
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.sync.client import ClientConnection, connect
from websockets.sync.server import Server, ServerConnection, serve

SUBPROTOCOL = "pulse.worker.v1"
CONNECT_PATH = "/v1/worker/connect"
MAX_FRAME = 524_288  # §2
MAX_RESULT = 262_144  # §2

#: websockets 17 warns unless connect() is a context manager or ``legacy=True`` is passed;
#: websockets 16 (the last release for Python 3.10) has no such argument.
LEGACY: dict[str, Any] = (
    {"legacy": True} if "legacy" in inspect.signature(connect).parameters else {}
)

ID_RE = re.compile(r"[0-9a-f]{32}")
DECIMAL_RE = re.compile(r"0|[1-9][0-9]*")
TIME_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?Z"
)
CODE_RE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
HANDLER_RE = re.compile(r"[a-z][a-z0-9._-]{0,63}")
SECRET_RE = re.compile(r"[A-Za-z0-9_-]{43}")

SERVER_TYPES = frozenset({"worker.welcome", "ack", "error", "task.assign", "task.cancel"})
CLIENT_TYPES = frozenset(
    {"worker.hello", "worker.capacity", "worker.resume", "task.start", "task.renew", "task.finish"}
)
SERVER_ENVELOPE = frozenset(
    {"protocol_version", "type", "message_id", "reply_to", "session_id", "body", "error"}
)
CLIENT_ENVELOPE = frozenset({"protocol_version", "type", "message_id", "session_id", "body"})
TASK_STATES = frozenset(
    {"WAITING", "LEASED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
)
ATTEMPT_STATES = frozenset(
    {"LEASED", "RUNNING", "SUCCEEDED", "FAILED", "UNKNOWN", "EXPIRED", "CANCELLED"}
)
OUTCOMES = frozenset({"SUCCEEDED", "FAILED", "UNKNOWN", "CANCELLED"})
DISPOSITIONS = frozenset({"APPLIED", "EVIDENCE_ONLY"})
FATAL_CODES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "STALE_SESSION"})
NS = 1_000_000_000
MAX_LEASE_WINDOW_NS = 120 * NS  # §6.6
MAX_SESSION_WINDOW_NS = 300 * NS  # §5.2


class Violation(AssertionError):
    """A frame breaks the protocol (docs/protocol.md)."""


def new_id() -> str:
    """A fresh 32-lowercase-hex id (§3)."""
    return secrets.token_hex(16)


def new_secret() -> str:
    """32 random bytes, base64url without padding (§3)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode("ascii")


# --------------------------------------------------------------------------- strict JSON (§2)


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise Violation("duplicate key in a JSON object")
    return dict(pairs)


def _constant(name: str) -> Any:
    raise Violation(f"{name} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Violation("number is not a finite double")
    return value


def _int(text: str) -> int:
    if len(text) > 400:
        raise Violation("number is not a finite double")
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise Violation("number is not a finite double") from None
    return value


def _walk_strings(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for key, sub in item.items():
                yield key
                stack.append(sub)
        elif isinstance(item, list):
            stack.extend(item)


def strict_loads(data: str | bytes) -> Any:
    """Parse one frame under §2's rules, or raise Violation."""
    if isinstance(data, bytes):
        raw = data
    else:
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError:
            raise Violation("lone surrogate in the frame text") from None
    if len(raw) > MAX_FRAME:
        raise Violation(f"frame is {len(raw)} bytes, over {MAX_FRAME}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Violation("frame is not UTF-8") from None
    try:
        value = json.loads(
            text,
            object_pairs_hook=_pairs,
            parse_constant=_constant,
            parse_float=_float,
            parse_int=_int,
        )
    except Violation:
        raise
    except (ValueError, RecursionError) as exc:
        raise Violation(f"not JSON: {type(exc).__name__}") from None
    for s in _walk_strings(value):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise Violation("lone surrogate in a JSON string") from None
    return value


def dumps(value: Any) -> str:
    """Compact JSON text (what a peer sends)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# --------------------------------------------------------------------------- field rules


def check_object(value: Any, where: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise Violation(f"{where} must be a JSON object")
    return value


def member(obj: dict[str, Any], name: str, where: str) -> Any:
    if name not in obj:
        raise Violation(f"{where}.{name} is missing")
    return obj[name]


def check_closed(obj: dict[str, Any], allowed: set[str] | frozenset[str], where: str) -> None:
    extra = set(obj) - set(allowed)
    if extra:
        raise Violation(f"{where} has unknown fields {sorted(extra)}")


def check_id(value: Any, where: str) -> str:
    if type(value) is not str or not ID_RE.fullmatch(value):
        raise Violation(f"{where} must be 32 lowercase hex")
    return value


def check_counter(value: Any, where: str, minimum: int = 1) -> int:
    if type(value) is not str or not DECIMAL_RE.fullmatch(value):
        raise Violation(f"{where} must be a canonical decimal string")
    number = int(value)
    if number < minimum:
        raise Violation(f"{where} must be >= {minimum}")
    return number


def check_time(value: Any, where: str) -> int:
    """RFC 3339 UTC with Z; returns POSIX nanoseconds."""
    if type(value) is not str:
        raise Violation(f"{where} must be an RFC 3339 string")
    m = TIME_RE.fullmatch(value)
    if not m:
        raise Violation(f"{where} must be RFC 3339 UTC with Z")
    parts = [int(g) for g in m.groups()[:6]]
    try:
        _dt.datetime(*parts)
    except ValueError:
        raise Violation(f"{where} is not a real date and time") from None
    fraction = int((m.group(7) or "").ljust(9, "0"))
    return calendar.timegm((*parts, 0, 0, 0)) * NS + fraction


def parse_time(value: Any) -> _dt.datetime:
    """An RFC 3339 UTC time (checked by :func:`check_time`) as an aware datetime, to the
    microsecond."""
    ns = check_time(value, "time")
    return _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(
        microseconds=ns // 1000
    )


def check_int(value: Any, where: str, low: int, high: int) -> int:
    if type(value) is not int:
        raise Violation(f"{where} must be a plain integer")
    if not low <= value <= high:
        raise Violation(f"{where} must be in [{low}, {high}]")
    return value


def check_bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise Violation(f"{where} must be a bool")
    return value


def check_enum(value: Any, allowed: frozenset[str], where: str) -> str:
    if type(value) is not str or value not in allowed:
        raise Violation(f"{where} must be one of {sorted(allowed)}")
    return value


def check_secret(value: Any, where: str) -> str:
    if type(value) is not str or not SECRET_RE.fullmatch(value):
        raise Violation(f"{where} must be 43 characters of base64url")
    decoded = base64.urlsafe_b64decode(value + "=")
    if len(decoded) != 32 or base64.urlsafe_b64encode(decoded).rstrip(b"=").decode() != value:
        raise Violation(f"{where} must encode exactly 32 bytes")
    return value


def check_code(value: Any, where: str) -> str:
    if type(value) is not str or not CODE_RE.fullmatch(value):
        raise Violation(f"{where} must be 1-64 characters of [A-Z][A-Z0-9_]*")
    return value


def check_version(value: Any, where: str) -> str:
    check_counter(value, where, 1)
    return str(value)


def check_capability(value: Any, where: str, *, closed: bool) -> tuple[str, str, str]:
    cap = check_object(value, where)
    if closed:
        check_closed(cap, {"handler", "handler_version", "payload_version"}, where)
    handler = member(cap, "handler", where)
    if type(handler) is not str or not HANDLER_RE.fullmatch(handler):
        raise Violation(f"{where}.handler must be 1-64 characters of [a-z][a-z0-9._-]*")
    hv = check_version(member(cap, "handler_version", where), f"{where}.handler_version")
    pv = check_version(member(cap, "payload_version", where), f"{where}.payload_version")
    return handler, hv, pv


# --------------------------------------------------------------------------- server bodies


def check_welcome(body: Any, where: str = "welcome") -> dict[str, Any]:
    """§4 Welcome, checked as §5.2 says. Unknown fields are tolerated (§2 [decided])."""
    w = check_object(body, where)
    check_id(member(w, "session_id", where), f"{where}.session_id")
    check_counter(member(w, "epoch", where), f"{where}.epoch", 1)
    t0 = check_time(member(w, "server_time", where), f"{where}.server_time")
    t1 = check_time(member(w, "expires_at", where), f"{where}.expires_at")
    if not 0 < t1 - t0 <= MAX_SESSION_WINDOW_NS:
        raise Violation(f"{where}.expires_at must be after server_time, at most 5 minutes")
    check_int(member(w, "lease_duration_ms", where), f"{where}.lease_duration_ms", 1_000, 120_000)
    check_bool(member(w, "draining", where), f"{where}.draining")
    return w


def check_lease(body: Any, where: str = "lease") -> dict[str, Any]:
    """§4 Lease with §6.6's rule for active leases; cancel_requested_at absent or valid (§12)."""
    lease = check_object(body, where)
    active = check_bool(member(lease, "active", where), f"{where}.active")
    state = check_enum(member(lease, "state", where), ATTEMPT_STATES, f"{where}.state")
    until = check_time(member(lease, "lease_until", where), f"{where}.lease_until")
    now = check_time(member(lease, "server_time", where), f"{where}.server_time")
    if "cancel_requested_at" in lease:
        check_time(lease["cancel_requested_at"], f"{where}.cancel_requested_at")
    if active:
        if state not in ("LEASED", "RUNNING"):
            raise Violation(f"{where}: an active lease must be LEASED or RUNNING")
        if not 0 < until - now <= MAX_LEASE_WINDOW_NS:
            raise Violation(f"{where}: an active lease's window must be in (0, 2 min]")
    return lease


def check_receipt(body: Any, operation: str, where: str = "receipt") -> dict[str, Any]:
    """§4 Receipt, checked as §6.8 says."""
    r = check_object(body, where)
    op = check_enum(member(r, "operation", where), frozenset({"start", "renew", "finish"}), where)
    if op != operation:
        raise Violation(f"{where}.operation {op!r} does not match the request ({operation})")
    check_enum(member(r, "task_state", where), TASK_STATES, f"{where}.task_state")
    check_enum(member(r, "attempt_state", where), ATTEMPT_STATES, f"{where}.attempt_state")
    check_counter(member(r, "task_revision", where), f"{where}.task_revision", 1)
    check_time(member(r, "lease_until", where), f"{where}.lease_until")
    check_enum(member(r, "disposition", where), DISPOSITIONS, f"{where}.disposition")
    return r


def check_command_result(body: Any, operation: str) -> dict[str, Any]:
    res = check_object(body, "CommandResult")
    check_receipt(member(res, "receipt", "CommandResult"), operation)
    check_lease(member(res, "lease", "CommandResult"))
    check_bool(member(res, "deduplicated", "CommandResult"), "CommandResult.deduplicated")
    return res


def check_task(body: Any, where: str = "task") -> dict[str, Any]:
    t = check_object(body, where)
    for name in ("task_id", "queue_id", "namespace_id"):
        check_id(member(t, name, where), f"{where}.{name}")
    check_capability(
        {k: member(t, k, where) for k in ("handler", "handler_version", "payload_version")},
        where,
        closed=True,
    )
    if member(t, "payload", where) is None:
        raise Violation(f"{where}.payload must not be null")
    check_enum(member(t, "state", where), TASK_STATES, f"{where}.state")
    check_counter(member(t, "revision", where), f"{where}.revision", 1)
    attempt = check_counter(member(t, "attempt", where), f"{where}.attempt", 1)
    maximum = check_counter(member(t, "max_attempts", where), f"{where}.max_attempts", 1)
    if attempt > maximum:
        raise Violation(f"{where}.attempt exceeds max_attempts")
    return t


def check_assignment(body: Any, ctx: ClientContext) -> dict[str, Any]:
    """§4 Assignment, checked as §6.1 and §12 say under the client's context."""
    a = check_object(body, "assignment")
    task = check_task(member(a, "task", "assignment"))
    check_id(member(a, "attempt_id", "assignment"), "assignment.attempt_id")
    check_counter(member(a, "epoch", "assignment"), "assignment.epoch", 1)
    check_secret(member(a, "lease_secret", "assignment"), "assignment.lease_secret")
    check_time(member(a, "lease_until", "assignment"), "assignment.lease_until")
    check_time(member(a, "server_time", "assignment"), "assignment.server_time")
    if task["queue_id"] != ctx.queue_id:
        raise Violation("assignment for another queue")
    if task["state"] != "LEASED":
        raise Violation("assigned task must be LEASED")
    if (task["handler"], task["handler_version"], task["payload_version"]) not in ctx.capabilities:
        raise Violation("assignment for a capability the worker did not register")
    return a


def check_cancel(body: Any) -> dict[str, Any]:
    c = check_object(body, "task.cancel")
    check_id(member(c, "task_id", "task.cancel"), "task.cancel.task_id")
    check_id(member(c, "attempt_id", "task.cancel"), "task.cancel.attempt_id")
    check_counter(member(c, "epoch", "task.cancel"), "task.cancel.epoch", 1)
    check_time(member(c, "cancel_requested_at", "task.cancel"), "task.cancel.cancel_requested_at")
    return c


def check_error(value: Any) -> dict[str, Any]:
    err = check_object(value, "error")
    if set(err) != {"code", "message"}:
        raise Violation("error must be exactly {code, message}")
    check_code(err["code"], "error.code")
    if type(err["message"]) is not str:
        raise Violation("error.message must be a string")
    return err


# --------------------------------------------------------------------------- server frames


@dataclasses.dataclass
class ClientContext:
    """What a conforming client knows when it reads a server frame."""

    queue_id: str
    capabilities: set[tuple[str, str, str]]
    notifications: bool = False
    session_id: str | None = None
    epoch: int | None = None
    #: message_id in flight → request type.
    pending: dict[str, str] = dataclasses.field(default_factory=dict)


_ACK_FOR = {
    "worker.capacity": "welcome",
    "worker.resume": "lease",
    "task.start": "start",
    "task.renew": "renew",
    "task.finish": "finish",
}


def check_server_frame(raw: str | bytes, ctx: ClientContext) -> dict[str, Any]:
    """Check one server → client frame as a conforming client must (§2, §4, §5, §6, §11, §12).

    Before the welcome (``ctx.session_id is None``) the frame must answer the pending hello.
    Returns the parsed frame; raises Violation otherwise.
    """
    f = check_object(strict_loads(raw), "frame")
    check_closed(f, SERVER_ENVELOPE, "envelope")  # §12: the envelope is closed
    if f.get("protocol_version") != "1" or type(f.get("protocol_version")) is not str:
        raise Violation('protocol_version must be "1"')
    kind = f.get("type")
    if type(kind) is not str or kind not in SERVER_TYPES:
        raise Violation(f"unknown server frame type {kind!r}")
    check_id(f.get("message_id"), "message_id")
    for key in ("reply_to", "session_id"):
        if key in f:
            check_id(f[key], key)
    if kind == "error":
        if "body" in f:
            raise Violation("an error frame carries no body")
        check_error(member(f, "error", "frame"))
    else:
        if "error" in f:
            raise Violation(f"{kind} carries an error field")
        check_object(member(f, "body", "frame"), "body")
    reply_to = f.get("reply_to")
    if ctx.session_id is None:
        if kind == "error" and reply_to is None:
            return f  # fatal for the connection (§11); no session exists yet (§12)
        # §5.1: the only other frame before the session is the answer to the hello.
        if reply_to is None or ctx.pending.get(reply_to) != "worker.hello":
            raise Violation("the first server frame must answer worker.hello")
        if kind == "error":
            return f  # §12: may come with or without session_id
        if kind != "worker.welcome":
            raise Violation("worker.hello must be answered by worker.welcome")
        welcome = check_welcome(f["body"])
        if f.get("session_id") != welcome["session_id"]:
            raise Violation("welcome frame session_id differs from the body's")
        return f
    if f.get("session_id") != ctx.session_id:
        raise Violation("frame does not carry this session's session_id")  # §5.3
    if kind == "error" and reply_to is None:
        return f  # fatal for the connection, but a valid frame (§11)
    if kind in ("task.assign", "task.cancel"):
        if reply_to is not None:
            raise Violation(f"{kind} is a push and carries no reply_to")
        if kind == "task.assign":
            check_assignment(f["body"], ctx)
        else:
            if not ctx.notifications:
                raise Violation("task.cancel sent to a session that did not ask for it")
            check_cancel(f["body"])
        return f
    if kind == "worker.welcome":
        raise Violation("worker.welcome outside the handshake")
    if reply_to is None:
        raise Violation(f"{kind} must answer a request")
    request = ctx.pending.get(reply_to)
    if request is None:
        raise Violation("reply_to names no pending request")
    if kind == "error":
        return f
    expected = _ACK_FOR[request]
    if expected == "welcome":
        w = check_welcome(f["body"], "capacity ack")
        if w["session_id"] != ctx.session_id or int(w["epoch"]) != ctx.epoch:
            raise Violation("capacity ack must carry the session's own session_id and epoch")
    elif expected == "lease":
        check_lease(f["body"])
    else:
        check_command_result(f["body"], expected)
    return f


# --------------------------------------------------------------------------- client frames


def check_ref(value: Any, where: str) -> dict[str, Any]:
    ref = check_object(value, where)
    check_closed(ref, {"task_id", "attempt_id", "epoch", "lease_secret"}, where)
    check_id(member(ref, "task_id", where), f"{where}.task_id")
    check_id(member(ref, "attempt_id", where), f"{where}.attempt_id")
    check_counter(member(ref, "epoch", where), f"{where}.epoch", 1)
    check_secret(member(ref, "lease_secret", where), f"{where}.lease_secret")
    return ref


def check_hello(body: dict[str, Any]) -> None:
    allowed = {
        "instance_id",
        "instance_secret",
        "queue_id",
        "capabilities",
        "capacity",
        "cancellation_notifications",
    }
    check_closed(body, allowed, "hello")
    check_id(member(body, "instance_id", "hello"), "hello.instance_id")
    check_secret(member(body, "instance_secret", "hello"), "hello.instance_secret")
    check_id(member(body, "queue_id", "hello"), "hello.queue_id")
    caps = member(body, "capabilities", "hello")
    if type(caps) is not list or not 1 <= len(caps) <= 32:
        raise Violation("hello.capabilities must hold 1-32 entries")
    seen = [check_capability(c, "hello.capabilities[]", closed=True) for c in caps]
    if len(set(seen)) != len(seen):
        raise Violation("hello.capabilities must be distinct")
    check_int(member(body, "capacity", "hello"), "hello.capacity", 1, 256)
    if "cancellation_notifications" in body:
        check_bool(body["cancellation_notifications"], "hello.cancellation_notifications")


def check_finish(body: dict[str, Any]) -> None:
    check_closed(body, {"ref", "outcome", "result", "error_code", "retryable"}, "finish")
    check_ref(member(body, "ref", "finish"), "finish.ref")
    outcome = check_enum(member(body, "outcome", "finish"), OUTCOMES, "finish.outcome")
    result = member(body, "result", "finish")
    if result is None:
        raise Violation("finish.result must not be null")
    if len(dumps(result).encode("utf-8")) > MAX_RESULT:
        raise Violation("finish.result is over 256 KiB")
    if outcome == "SUCCEEDED":
        if "error_code" in body:
            raise Violation("a SUCCEEDED finish has no error_code")
    else:
        check_code(member(body, "error_code", "finish"), "finish.error_code")
    if "retryable" in body:
        retryable = check_bool(body["retryable"], "finish.retryable")
        if retryable and outcome != "FAILED":
            raise Violation("retryable: true only with FAILED")


def check_client_frame(raw: str | bytes, session_id: str | None) -> dict[str, Any]:
    """Check one client → server frame as a conforming server must (§2, §4, §5).

    *session_id* is the connection's session (``None`` before the welcome: only a hello is
    acceptable then). Returns the parsed frame; raises Violation otherwise.
    """
    f = check_object(strict_loads(raw), "frame")
    for key in ("reply_to", "error"):
        if key in f:
            raise Violation(f"a request must not carry {key}")  # §2, not even null
    check_closed(f, CLIENT_ENVELOPE, "envelope")
    if f.get("protocol_version") != "1" or type(f.get("protocol_version")) is not str:
        raise Violation('protocol_version must be "1"')
    kind = f.get("type")
    if type(kind) is not str or kind not in CLIENT_TYPES:
        raise Violation(f"unknown request type {kind!r}")
    check_id(f.get("message_id"), "message_id")
    if kind == "worker.hello":
        if "session_id" in f:
            raise Violation("worker.hello carries no session_id")
    else:
        if session_id is None:
            raise Violation(f"{kind} before the welcome")
        if f.get("session_id") != session_id:
            raise Violation("request does not carry the session's session_id")
    body = check_object(member(f, "body", "frame"), "body")
    if kind == "worker.hello":
        check_hello(body)
    elif kind == "worker.capacity":
        check_closed(body, {"sequence", "capacity", "drain"}, "capacity")
        check_counter(member(body, "sequence", "capacity"), "capacity.sequence", 1)
        check_int(member(body, "capacity", "capacity"), "capacity.capacity", 0, 256)
        check_bool(member(body, "drain", "capacity"), "capacity.drain")
    elif kind == "task.finish":
        check_finish(body)
    else:
        check_ref(body, kind)
    return f


# --------------------------------------------------------------------------- builders


def frame(
    kind: str,
    *,
    message_id: str | None = None,
    session_id: str | None = None,
    reply_to: str | None = None,
    body: dict[str, Any] | None = None,
    error: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """One frame as a dict (absent fields omitted)."""
    f: dict[str, Any] = {
        "protocol_version": "1",
        "type": kind,
        "message_id": message_id or new_id(),
    }
    if session_id is not None:
        f["session_id"] = session_id
    if reply_to is not None:
        f["reply_to"] = reply_to
    if body is not None:
        f["body"] = body
    if error is not None:
        f["error"] = {"code": error[0], "message": error[1]}
    return f


def fmt_time(ns: int) -> str:
    """POSIX nanoseconds → RFC 3339 UTC with Z (fraction only when non-zero)."""
    seconds, frac = divmod(ns, NS)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if frac:
        text += "." + f"{frac:09d}".rstrip("0")
    return text + "Z"


T0 = check_time("2026-09-17T08:00:00Z", "T0")  # a fixed server time, far from the local clock


def hello_body(
    queue_id: str,
    *,
    capabilities: list[tuple[str, str, str]] | None = None,
    capacity: int = 4,
    notifications: bool | None = None,
    instance_id: str | None = None,
    instance_secret: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "instance_id": instance_id or new_id(),
        "instance_secret": instance_secret or new_secret(),
        "queue_id": queue_id,
        "capabilities": [
            {"handler": h, "handler_version": hv, "payload_version": pv}
            for h, hv, pv in (capabilities or [("resize", "1", "1")])
        ],
        "capacity": capacity,
    }
    if notifications is not None:
        body["cancellation_notifications"] = notifications
    return body


def welcome_body(
    session_id: str,
    epoch: int = 1,
    *,
    now: int = T0,
    window: float = 45.0,
    lease_ms: int = 30_000,
    draining: bool = False,
) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "epoch": str(epoch),
        "server_time": fmt_time(now),
        "expires_at": fmt_time(now + round(window * NS)),
        "lease_duration_ms": lease_ms,
        "draining": draining,
    }


def lease_body(
    *,
    active: bool = True,
    state: str = "RUNNING",
    now: int = T0,
    window: float = 30.0,
    cancel_requested_at: int | None = None,
) -> dict[str, Any]:
    lease: dict[str, Any] = {
        "active": active,
        "state": state,
        "lease_until": fmt_time(now + round(window * NS)),
        "server_time": fmt_time(now),
    }
    if cancel_requested_at is not None:
        lease["cancel_requested_at"] = fmt_time(cancel_requested_at)
    return lease


def command_body(
    operation: str,
    *,
    task_state: str = "RUNNING",
    attempt_state: str = "RUNNING",
    revision: int = 3,
    disposition: str = "APPLIED",
    deduplicated: bool = False,
    lease: dict[str, Any] | None = None,
) -> dict[str, Any]:
    lease = lease or lease_body()
    return {
        "receipt": {
            "operation": operation,
            "task_state": task_state,
            "attempt_state": attempt_state,
            "task_revision": str(revision),
            "lease_until": lease["lease_until"],
            "disposition": disposition,
        },
        "lease": lease,
        "deduplicated": deduplicated,
    }


def assignment_body(
    queue_id: str,
    *,
    task_id: str | None = None,
    capability: tuple[str, str, str] = ("resize", "1", "1"),
    payload: Any = None,
    attempt: int = 1,
    max_attempts: int = 3,
    epoch: int = 1,
    now: int = T0,
    window: float = 30.0,
) -> dict[str, Any]:
    return {
        "task": {
            "task_id": task_id or new_id(),
            "queue_id": queue_id,
            "namespace_id": new_id(),
            "handler": capability[0],
            "handler_version": capability[1],
            "payload_version": capability[2],
            "payload": {"w": 640} if payload is None else payload,
            "state": "LEASED",
            "revision": "2",
            "attempt": str(attempt),
            "max_attempts": str(max_attempts),
        },
        "attempt_id": new_id(),
        "epoch": str(epoch),
        "lease_secret": new_secret(),
        "lease_until": fmt_time(now + round(window * NS)),
        "server_time": fmt_time(now),
    }


def ref_of(assignment: dict[str, Any]) -> dict[str, Any]:
    """The AttemptRef of an assignment body (§4)."""
    return {
        "task_id": assignment["task"]["task_id"],
        "attempt_id": assignment["attempt_id"],
        "epoch": assignment["epoch"],
        "lease_secret": assignment["lease_secret"],
    }


# --------------------------------------------------------------------------- raw client


class Closed(Exception):
    """The peer closed the connection."""


class RawClient:
    """A raw ``pulse.worker.v1`` client connection. Every server frame is checked with
    :func:`check_server_frame`; error messages are checked for the secrets this client sent."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        queue_id: str,
        capabilities: list[tuple[str, str, str]] | None = None,
        capacity: int = 4,
        notifications: bool | None = None,
        instance_id: str | None = None,
        instance_secret: str | None = None,
        subprotocols: list[str] | None = None,
        compression: str | None = None,
        path: str = CONNECT_PATH,
    ) -> None:
        self.token = token
        self.hello = hello_body(
            queue_id,
            capabilities=capabilities,
            capacity=capacity,
            notifications=notifications,
            instance_id=instance_id,
            instance_secret=instance_secret,
        )
        self.ctx = ClientContext(
            queue_id=queue_id,
            capabilities={
                (c["handler"], c["handler_version"], c["payload_version"])
                for c in self.hello["capabilities"]
            },
            notifications=bool(notifications),
        )
        #: Never to be echoed by the server (§2, §3).
        self.secrets = {token, self.hello["instance_secret"]}
        self.pushes: collections.deque[dict[str, Any]] = collections.deque()
        self.ws: ClientConnection = connect(
            url + path,
            subprotocols=[SUBPROTOCOL] if subprotocols is None else subprotocols,  # type: ignore[list-item]
            additional_headers={"Authorization": f"Bearer {token}"},
            compression=compression,
            proxy=None,
            open_timeout=5,
            close_timeout=1,
            ping_interval=None,
            max_size=4 * MAX_FRAME,
            **LEGACY,
        )

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.ws.close()

    @property
    def session_id(self) -> str:
        assert self.ctx.session_id is not None
        return self.ctx.session_id

    def send_text(self, data: str | bytes) -> None:
        self.ws.send(data)

    def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        """The next server frame, checked under the current context."""
        try:
            raw = self.ws.recv(timeout=timeout)
        except ConnectionClosed:
            raise Closed() from None
        if isinstance(raw, bytes):
            raise Violation("the server sent a binary frame")
        f = check_server_frame(raw, self.ctx)
        if f["type"] == "error":
            message = f["error"]["message"]
            leaked = [s for s in self.secrets if s and s in message]
            assert not leaked, "an error message echoes a secret (§2)"
        if "reply_to" in f:
            self.ctx.pending.pop(f["reply_to"], None)
        if "lease_secret" in f.get("body", {}):
            self.secrets.add(f["body"]["lease_secret"])
        return f

    def send(
        self,
        kind: str,
        body: Any,
        *,
        message_id: str | None = None,
        session_id: str | bool | None = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Send one request; ``session_id=True`` means the current session (none for hello)."""
        mid = message_id or new_id()
        if session_id is True:
            sid = None if kind == "worker.hello" else self.ctx.session_id
        else:
            sid = session_id or None
        f = frame(kind, message_id=mid, session_id=sid, body=body)
        f.update(extra or {})
        self.ctx.pending[mid] = kind
        self.ws.send(dumps(f))
        return mid

    def answer(self, message_id: str, timeout: float = 5.0) -> dict[str, Any]:
        """Read until the frame answering *message_id*; pushes are kept in order."""
        deadline = time.monotonic() + timeout
        while True:
            f = self.recv(max(0.0, deadline - time.monotonic()))
            if f.get("reply_to") == message_id:
                return f
            self.pushes.append(f)

    def request(self, kind: str, body: Any, **kw: Any) -> dict[str, Any]:
        return self.answer(self.send(kind, body, **kw))

    def do_hello(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send the hello; on a welcome, enter the session (§5.1)."""
        f = self.request("worker.hello", self.hello if body is None else body)
        if f["type"] == "worker.welcome":
            self.ctx.session_id = f["body"]["session_id"]
            self.ctx.epoch = int(f["body"]["epoch"])
        return f

    def capacity(
        self, sequence: int, capacity: int, drain: bool = False, **kw: Any
    ) -> dict[str, Any]:
        body = {"sequence": str(sequence), "capacity": capacity, "drain": drain}
        return self.request("worker.capacity", body, **kw)

    def open(self, capacity: int | None = None, sequence: int = 1) -> RawClient:
        """hello + the first capacity report, both answered as they must be."""
        w = self.do_hello()
        assert w["type"] == "worker.welcome", w
        ack = self.capacity(sequence, self.hello["capacity"] if capacity is None else capacity)
        assert ack["type"] == "ack", ack
        return self

    def next_push(self, kind: str = "task.assign", timeout: float = 5.0) -> dict[str, Any]:
        """The next push of *kind*; earlier pushes of other kinds stay queued."""
        for f in list(self.pushes):
            if f["type"] == kind:
                self.pushes.remove(f)
                return f
        deadline = time.monotonic() + timeout
        while True:
            f = self.recv(max(0.0, deadline - time.monotonic()))
            if f["type"] == kind:
                return f
            self.pushes.append(f)

    def frames_until_closed(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Every frame read until the server closes the connection (raises on timeout)."""
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any]] = []
        while True:
            try:
                seen.append(self.recv(max(0.0, deadline - time.monotonic())))
            except Closed:
                return seen


# --------------------------------------------------------------------------- raw server


class Peer:
    """One accepted connection, driven by the test thread. Every client frame is checked with
    :func:`check_client_frame`."""

    def __init__(self, ws: ServerConnection, request: Request | None) -> None:
        self.ws = ws
        self.request = request
        self.session_id: str | None = None
        self.epoch = 1
        self.released = threading.Event()

    def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        try:
            raw = self.ws.recv(timeout=timeout)
        except ConnectionClosed:
            raise Closed() from None
        if isinstance(raw, bytes):
            raise Violation("the client sent a binary frame")
        return check_client_frame(raw, self.session_id)

    def send(self, value: dict[str, Any] | str | bytes) -> bool:
        """Send one frame; False when the client closed the connection meanwhile (it may,
        e.g. on reading an oversized frame's header)."""
        try:
            self.ws.send(value if isinstance(value, str | bytes) else dumps(value))
        except ConnectionClosed:
            return False
        return True

    def welcome(
        self, hello: dict[str, Any], epoch: int = 1, *, session_id: str | None = None, **kw: Any
    ) -> dict[str, Any]:
        """Answer *hello* with a valid welcome and enter the session."""
        sid = session_id or new_id()
        body = welcome_body(sid, epoch, **kw)
        self.send(frame("worker.welcome", session_id=sid, reply_to=hello["message_id"], body=body))
        self.session_id, self.epoch = sid, epoch
        return body

    def handshake(self, epoch: int = 1, **kw: Any) -> dict[str, Any]:
        """Read the hello (due within 5 s, §5.1), answer a welcome; returns the hello frame."""
        hello = self.recv(timeout=5.0)
        assert hello["type"] == "worker.hello"
        self.welcome(hello, epoch, **kw)
        return hello

    def reply(self, request: dict[str, Any], body: dict[str, Any]) -> None:
        self.send(
            frame("ack", session_id=self.session_id, reply_to=request["message_id"], body=body)
        )

    def fail(self, request: dict[str, Any], code: str, message: str = "no") -> None:
        self.send(
            frame(
                "error",
                session_id=self.session_id,
                reply_to=request["message_id"],
                error=(code, message),
            )
        )

    def push(self, kind: str, body: dict[str, Any]) -> None:
        self.send(frame(kind, session_id=self.session_id, body=body))

    def closed(self, timeout: float = 5.0) -> bool:
        """True once the client closed the connection (frames read meanwhile are checked)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.recv(max(0.0, deadline - time.monotonic()))
            except Closed:
                return True
            except TimeoutError:
                return False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        self.released.set()


class RawServer:
    """A raw server: records each upgrade request and hands each connection to the test.

    ``select`` chooses the subprotocol (default: ``pulse.worker.v1`` when offered);
    ``refuse`` answers the upgrade with an HTTP response instead.
    """

    def __init__(
        self,
        *,
        select: Callable[[list[str]], str | None] | None = None,
        refuse: Callable[[ServerConnection, Request], Response | None] | None = None,
    ) -> None:
        self.requests: list[Request] = []
        self._select = select
        self._refuse = refuse
        self._accepted: queue.Queue[Peer] = queue.Queue()
        self._peers: list[Peer] = []
        self._lock = threading.Lock()
        #: Set by stop(): a connection whose handler starts after it is closed at once.
        self._stopping = False
        self._server: Server = serve(
            self._handle,
            "127.0.0.1",
            0,
            compression=None,
            select_subprotocol=self._choose,
            process_request=self._process,
            ping_interval=None,
            close_timeout=1,
            open_timeout=5,
            max_size=4 * MAX_FRAME,
            server_header=None,
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="independent-server", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"ws://127.0.0.1:{port}"

    def _choose(self, ws: ServerConnection, offered: Any) -> Any:
        offered = list(offered)
        if self._select is not None:
            return self._select(offered)
        return SUBPROTOCOL if SUBPROTOCOL in offered else None

    def _process(self, ws: ServerConnection, request: Request) -> Response | None:
        with self._lock:
            self.requests.append(request)
        if self._refuse is not None:
            return self._refuse(ws, request)
        return None

    def _handle(self, ws: ServerConnection) -> None:
        request = ws.request
        peer = Peer(ws, request)
        with self._lock:
            self._peers.append(peer)
            stopping = self._stopping
        if stopping:
            # stop() took its list of peers before this handler started: nobody would release
            # it, and the server's shutdown would wait for it forever.
            peer.close()
            return
        self._accepted.put(peer)
        peer.released.wait()

    def accept(self, timeout: float = 5.0) -> Peer:
        return self._accepted.get(timeout=timeout)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            peers = list(self._peers)
        for peer in peers:
            peer.close()
        self._server.shutdown()
        self._thread.join()

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
