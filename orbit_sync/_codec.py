"""The wire mapping of ``pulse.worker.v1``: the frame envelope, and context-bound decoding of
server frames (client side) and client frames (server side).

Both our client and our mock server decode through this module, so they agree on every vector in
``tests/vectors/frames.json`` by construction. Bodies are structured and unstructured by the one
wire converter of :mod:`orbit_sync._bodies` (cattrs), which builds each model through its
validating constructor and names the field a fault is in.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import attrs

from . import _bodies, _json, _rules
from ._bodies import format_time as format_time  # re-exported: the one formatter of wire times
from .errors import FrameError, WorkerError, WorkerProtocolError
from .models import (
    Assignment,
    AttemptRef,
    CancelNotice,
    CapacityReport,
    CommandResult,
    Finish,
    Lease,
    Operation,
    Registration,
    TaskState,
    Welcome,
)

T = TypeVar("T")

PROTOCOL_VERSION = "1"
SUBPROTOCOL = "pulse.worker.v1"

# Client → server request types and the model of each body.
CLIENT_BODIES: dict[str, type[Any]] = {
    "worker.hello": Registration,
    "worker.capacity": CapacityReport,
    "worker.resume": AttemptRef,
    "task.start": AttemptRef,
    "task.renew": AttemptRef,
    "task.finish": Finish,
}
SERVER_TYPES = frozenset({"worker.welcome", "ack", "error", "task.assign", "task.cancel"})

_CLIENT_ENVELOPE = frozenset({"protocol_version", "type", "message_id", "session_id", "body"})
_SERVER_ENVELOPE = _CLIENT_ENVELOPE | {"reply_to", "error"}

# --------------------------------------------------------------------------- times and counters


def parse_time(value: Any) -> _dt.datetime:
    """RFC 3339 in UTC with ``Z``; at most 9 fraction digits (kept to the microsecond)."""
    try:
        return _bodies.parse_time(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"time {exc}") from None


def parse_counter(value: Any) -> int:
    """A canonical decimal string: ``"1"``, ``"42"``; never ``"01"``, ``"+1"``, ``1``."""
    try:
        return _rules.wire_counter(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"counter {exc}") from None


def decode_body(value: Any, cls: type[T]) -> T:
    """*value* as *cls* by the wire converter, or FrameError naming the field and the rule
    broken (never the value: it may be a secret)."""
    try:
        return _bodies.structure(value, cls)
    except _bodies.Fault as exc:
        raise FrameError(_invalid(cls, exc)) from None


def _invalid(cls: type[Any], fault: _bodies.Fault) -> str:
    return f"invalid {cls.__name__}: {fault.describe(cls.__name__)}"


#: The wire form of a model (counters as strings, times as RFC 3339, optionals omitted).
unstructure = _bodies.unstructure


# --------------------------------------------------------------------------- encoding


def check_result(result: Any) -> None:
    """Raise FrameError unless *result* is strict JSON, not null, at most 256 KiB serialized."""
    if result is None:
        raise FrameError("result must be JSON other than null")
    _checked_result_size(_json.dumps(result))


def _checked_result_size(text: str) -> None:
    size = len(text.encode("utf-8"))
    if size > _json.MAX_RESULT_BYTES:
        raise FrameError(f"result is {size} bytes, over the {_json.MAX_RESULT_BYTES}-byte limit")
    # Python serializes int keys as strings and very large ints as digits; a strict peer rejects
    # the duplicates and non-doubles that can produce, so check what will actually be sent.
    _json.loads(text, limit=_json.MAX_FRAME_BYTES)


#: The body model of each request type a session sends (the handshake's hello is not one).
REQUEST_BODIES: dict[str, type[Any]] = {
    k: v for k, v in CLIENT_BODIES.items() if k != "worker.hello"
}


def check_request(request_type: str, body: Any) -> None:
    """Raise unless *request_type* is a session's request and *body* its model."""
    if type(request_type) is not str or request_type not in REQUEST_BODIES:
        raise ValueError("unknown request type")
    if not isinstance(body, REQUEST_BODIES[request_type]):
        raise TypeError(f"{request_type} needs a {REQUEST_BODIES[request_type].__name__} body")
    if request_type == "task.finish":
        check_ref(body.ref)


def check_ref(ref: object) -> None:
    """Raise TypeError unless *ref* is an AttemptRef."""
    if not isinstance(ref, AttemptRef):
        raise TypeError("ref must be an AttemptRef (assignment.attempt)")


def encode_frame(
    type_: str,
    message_id: str,
    *,
    session_id: str | None = None,
    body: Mapping[str, Any] | None = None,
    reply_to: str | None = None,
    error: tuple[str, str] | None = None,
) -> str:
    """Serialize one frame; refuses frames over 512 KiB with FrameError."""
    frame: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "type": type_,
        "message_id": message_id,
    }
    if reply_to is not None:
        frame["reply_to"] = reply_to
    if session_id is not None:
        frame["session_id"] = session_id
    if body is not None:
        frame["body"] = body
    if error is not None:
        frame["error"] = {"code": error[0], "message": error[1]}
    text = _json.dumps(frame)
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    if size > _json.MAX_FRAME_BYTES:
        raise FrameError(f"frame is {size} bytes, over the {_json.MAX_FRAME_BYTES}-byte limit")
    return text


def encode_request(type_: str, message_id: str, session_id: str | None, body: Any) -> str:
    """Encode a client request whose body is a model (a finish's result checked as
    :func:`check_result` does)."""
    if isinstance(body, Finish):
        check_result(body.result)
    return encode_frame(type_, message_id, session_id=session_id, body=unstructure(body))


# --------------------------------------------------------------------------- server → client


# The decoded server frames are tuples: one is built per frame on the reader, before the call it
# answers is woken, and a NamedTuple is built several times faster than a frozen attrs class.


class Reply(NamedTuple):
    """An ``ack``/``worker.welcome`` (value) or ``error`` (error) answering ``reply_to``."""

    reply_to: str
    value: Any = None
    error: WorkerError | None = None


class AssignPush(NamedTuple):
    """A validated ``task.assign``."""

    assignment: Assignment


class CancelPush(NamedTuple):
    """A validated ``task.cancel``."""

    notice: CancelNotice


class ServerAbort(NamedTuple):
    """An ``error`` without ``reply_to``: fatal for the connection."""

    error: WorkerError


ServerEvent = Reply | AssignPush | CancelPush | ServerAbort


@attrs.frozen
class SessionContext:
    """What the client knows when it decodes a server frame."""

    session_id: str
    epoch: int
    registration: Registration


def _bad(reason: str) -> WorkerProtocolError:
    return WorkerProtocolError(f"invalid server frame: {reason}")


_id_match = _rules.ID_RE.fullmatch


def _is_id(value: Any) -> bool:
    return type(value) is str and _id_match(value) is not None


def _parse_envelope(raw: bytes | str, session_id: str | None = None) -> dict[str, Any]:
    """The envelope of one server frame, checked; *session_id*: the session's own, known to be
    32 lowercase hex (a frame naming it needs no pattern match: most frames do)."""
    try:
        frame = _json.loads(raw)
    except FrameError as exc:
        raise _bad(str(exc)) from None
    if type(frame) is not dict:
        raise _bad("not a JSON object")
    if not _SERVER_ENVELOPE.issuperset(frame):  # no set built per frame
        raise _bad("unknown envelope field")
    if frame.get("protocol_version") != PROTOCOL_VERSION:
        raise _bad("protocol_version must be '1'")
    kind = frame.get("type")
    if type(kind) is not str or kind not in SERVER_TYPES:
        raise _bad("unknown frame type")
    if not _is_id(frame.get("message_id")):
        raise _bad("message_id must be 32 lowercase hex")
    if "reply_to" in frame and not _is_id(frame["reply_to"]):
        raise _bad("reply_to must be 32 lowercase hex")
    sid = frame.get("session_id", session_id)
    if sid != session_id and not _is_id(sid):
        raise _bad("session_id must be 32 lowercase hex")
    if kind == "error":
        if "body" in frame:
            raise _bad("error frame carries a body")
        if "error" not in frame:
            raise _bad("error frame without error")
    else:
        if "error" in frame:
            raise _bad(f"{kind} carries an error field")
        if type(frame.get("body")) is not dict:
            raise _bad(f"{kind} needs an object body")
    return frame


def _worker_error(frame: dict[str, Any]) -> WorkerError:
    err = frame["error"]
    if type(err) is not dict or err.keys() != {"code", "message"}:
        raise _bad("error must be {code, message}")
    code, message = err["code"], err["message"]
    if type(code) is not str or not _rules.CODE_RE.fullmatch(code):
        raise _bad("error code must be 1-64 characters of [A-Z][A-Z0-9_]*")
    if type(message) is not str:
        raise _bad("error message must be a string")
    return WorkerError(code, message, message_id=frame.get("reply_to"))


def _body(frame: dict[str, Any], cls: type[T]) -> T:
    try:
        return _bodies.structure(frame["body"], cls)
    except _bodies.Fault as exc:
        raise _bad(_invalid(cls, exc)) from None


def decode_welcome(raw: bytes | str, hello_id: str) -> Welcome:
    """Decode the answer to ``worker.hello`` (PROTOCOL §5.1 and §5.2).

    Returns the Welcome, raises WorkerError for an ``error`` answer and WorkerProtocolError for
    anything else.
    """
    frame = _parse_envelope(raw)
    if frame.get("reply_to") != hello_id:
        raise _bad("the first frame must answer worker.hello")
    if frame["type"] == "error":
        # No session exists yet: an error answering hello may come without session_id (§12).
        raise _worker_error(frame)
    if frame["type"] != "worker.welcome":
        raise _bad("worker.hello must be answered by worker.welcome")
    welcome = _body(frame, Welcome)
    if frame.get("session_id") != welcome.session_id:
        raise _bad("welcome session_id differs from the frame's")
    return welcome


#: The body each pending request type is answered with.
ACK_BODIES: dict[str, type[Any]] = {
    "worker.capacity": Welcome,
    "worker.resume": Lease,
    "task.start": CommandResult,
    "task.renew": CommandResult,
    "task.finish": CommandResult,
}


#: The operation the receipt of each command's ack must record: ``task.<operation>``.
_OPERATIONS = {f"task.{op.value}": op for op in Operation}


class Addressed(NamedTuple):
    """An ``ack`` or ``error`` frame answering ``reply_to``, its body not yet read: which body
    it must be depends on the request in flight under that id (see :func:`answer_of`)."""

    reply_to: str
    frame: dict[str, Any]


def decode_server_frame(
    raw: bytes | str, ctx: SessionContext, pending: Callable[[str], str | None]
) -> ServerEvent:
    """Decode and check one server frame against the session's context.

    *pending* maps a ``message_id`` in flight to its request type (``None`` when unknown).
    Raises WorkerProtocolError on anything a conforming server cannot send. The two steps,
    :func:`read_server_frame` then :func:`answer_of` for an answer, for a caller that looks the
    request up itself.
    """
    event = read_server_frame(raw, ctx)
    if isinstance(event, Addressed):
        return answer_of(event, pending(event.reply_to), ctx)
    return event


def read_server_frame(raw: bytes | str, ctx: SessionContext) -> ServerEvent | Addressed:
    """Decode and check one server frame against the session's context, except the body of an
    answer (:class:`Addressed`), which :func:`answer_of` reads once its request is known."""
    frame = _parse_envelope(raw, ctx.session_id)
    kind = frame["type"]
    reply_to = frame.get("reply_to")
    if frame.get("session_id") != ctx.session_id:
        raise _bad("frame is not for this session")
    if kind == "error" and reply_to is None:
        return ServerAbort(_worker_error(frame))
    if kind in ("task.assign", "task.cancel"):
        if reply_to is not None:
            raise _bad(f"{kind} is a push and carries no reply_to")
        if kind == "task.assign":
            assignment = _body(frame, Assignment)
            _check_assignment(assignment, ctx.registration)
            return AssignPush(assignment)
        if not ctx.registration.cancellation_notifications:
            raise _bad("task.cancel sent to a session that did not ask for it")
        return CancelPush(_body(frame, CancelNotice))
    if kind == "worker.welcome":
        raise _bad("worker.welcome outside the handshake")
    if reply_to is None:
        raise _bad("ack must answer a request")
    return Addressed(reply_to, frame)


def answer_of(event: Addressed, request: str | None, ctx: SessionContext) -> Reply:
    """The :class:`Reply` of an answer to *request* (the type of the request in flight under its
    ``reply_to``; ``None`` when none is)."""
    if request is None:
        raise _bad("reply_to names no pending request")
    frame = event.frame
    if frame["type"] == "error":
        return Reply(event.reply_to, error=_worker_error(frame))
    value = _body(frame, ACK_BODIES[request])
    if isinstance(value, Welcome):
        if value.session_id != ctx.session_id or value.epoch != ctx.epoch:
            raise _bad("capacity ack names another session or epoch")
    elif isinstance(value, CommandResult) and value.receipt.operation is not _OPERATIONS[request]:
        raise _bad("receipt operation does not match the request")
    return Reply(event.reply_to, value=value)


def _check_assignment(a: Assignment, registration: Registration) -> None:
    task = a.task
    if task.queue_id != registration.queue_id:
        raise _bad("assignment for another queue")
    if task.state is not TaskState.LEASED:
        raise _bad("assigned task must be LEASED")
    if not registration.allows(task.handler, task.handler_version, task.payload_version):
        raise _bad("assignment for a capability this worker did not register")


# --------------------------------------------------------------------------- client → server


@attrs.frozen
class ClientFrame:
    """A validated client request, as the server sees it."""

    type: str
    message_id: str
    session_id: str | None
    body: Any
    #: The body exactly as received (for idempotency comparisons of "same content").
    raw_body: dict[str, Any] = attrs.field(eq=False, repr=False)


class InvalidClientFrame(FrameError):
    """A client frame the server must answer with ``INVALID_FRAME`` (then close)."""


def decode_client_frame(raw: bytes | str) -> ClientFrame:
    """Validate one client frame (the server's side). Raises InvalidClientFrame, carrying the
    frame's ``message_id`` when it could be read."""
    try:
        frame = _json.loads(raw)
    except FrameError as exc:
        raise InvalidClientFrame(str(exc)) from None
    if type(frame) is not dict:
        raise InvalidClientFrame("frame is not a JSON object")
    mid = frame.get("message_id")
    message_id = mid if _is_id(mid) else None

    def bad(reason: str) -> InvalidClientFrame:
        return InvalidClientFrame(reason, message_id=message_id)

    if message_id is None:
        raise bad("message_id must be 32 lowercase hex")
    if frame.keys() - _CLIENT_ENVELOPE:
        raise bad("unknown or response field in a request envelope")
    if frame.get("protocol_version") != PROTOCOL_VERSION:
        raise bad("protocol_version must be '1'")
    kind = frame.get("type")
    if type(kind) is not str or kind not in CLIENT_BODIES:
        raise bad("unknown request type")
    if kind == "worker.hello":
        if "session_id" in frame:
            raise bad("worker.hello carries no session_id")
    elif not _is_id(frame.get("session_id")):
        raise bad("session_id must be 32 lowercase hex")
    body = frame.get("body")
    try:
        model = decode_body(body, CLIENT_BODIES[kind])
        if isinstance(model, Finish):
            check_result(model.result)
    except FrameError as exc:
        raise bad(str(exc)) from None
    assert isinstance(body, dict)  # the converter accepted it as an object
    return ClientFrame(kind, message_id, frame.get("session_id"), model, body)
