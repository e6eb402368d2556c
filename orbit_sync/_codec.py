"""The wire mapping of ``pulse.worker.v1``: one strict cattrs converter per direction, the frame
envelope, and context-bound decoding of server frames (client side) and client frames (server
side).

Both our client and our mock server decode through this module, so they agree on every vector in
``tests/vectors/frames.json`` by construction. cattrs' default hooks coerce (``"007"`` → 7,
``True`` → 1); every hook here checks exact types instead.

The converters are the reference: bodies are decoded and encoded on the hot path by the
hand-written functions of :mod:`orbit_sync._bodies` (each field checked once, models built
without re-running their validators), and a body those reject is handed to the converter,
which names the fault and its path.
"""

from __future__ import annotations

import datetime as _dt
import enum
import functools
import re
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from . import _bodies, _json
from ._bodies import format_time as format_time  # re-exported: the one formatter of wire times
from .errors import FrameError, WorkerError, WorkerProtocolError
from .models import (
    CODE_RE,
    DECIMAL_RE,
    ID_RE,
    MAX_LEASE_WINDOW,
    MAX_SESSION_WINDOW,
    Assignment,
    AttemptRef,
    AttemptState,
    CancelNotice,
    Capability,
    CapacityReport,
    CommandResult,
    Disposition,
    Finish,
    Lease,
    Operation,
    Outcome,
    Receipt,
    Registration,
    Task,
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

# Fields that may be absent on the wire (absent means the default; null is never allowed).
_OPTIONAL_ON_WIRE = {
    (Registration, "cancellation_notifications"),
    (Lease, "cancel_requested_at"),
    (Finish, "error_code"),
    (Finish, "retryable"),
}

# --------------------------------------------------------------------------- times and counters


def parse_time(value: Any) -> _dt.datetime:
    """RFC 3339 in UTC with ``Z``; at most 9 fraction digits (kept to the microsecond)."""
    if type(value) is not str:
        raise TypeError("time must be an RFC 3339 string")
    return _bodies.parse_time_ns(value)[0]


_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
_MICROSECOND = _dt.timedelta(microseconds=1)
_NS = 1_000_000_000


def time_ns(value: Any) -> int:
    """POSIX nanoseconds of a wire time, every fraction digit kept (``parse_time`` keeps
    microseconds only, so windows are checked with this: PROTOCOL §12 allows 9 digits)."""
    if type(value) is not str:
        raise TypeError("time must be an RFC 3339 string")
    return _time_ns(value)


@functools.lru_cache(maxsize=512)
def _time_ns(value: str) -> int:
    whole, sub_micro = _bodies.parse_time_ns(value)
    return (whole - _EPOCH) // _MICROSECOND * 1000 + sub_micro


def parse_counter(value: Any) -> int:
    """A canonical decimal string: ``"1"``, ``"42"``; never ``"01"``, ``"+1"``, ``1``."""
    if type(value) is not str:
        raise TypeError("counter must be a decimal string")
    if not DECIMAL_RE.fullmatch(value):
        raise ValueError("counter must be a canonical decimal string")
    return int(value)


# --------------------------------------------------------------------------- converters


def _strict(kind: type[Any]) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _: Any) -> Any:
        if type(value) is not kind:
            raise TypeError(f"expected {kind.__name__}")
        return value

    return hook


def _strict_enum(value: Any, cls: type[enum.Enum]) -> Any:
    if type(value) is not str:
        raise TypeError(f"expected a {cls.__name__} string")
    return cls(value)


_MODELS: tuple[type[Any], ...] = (
    Capability,
    Registration,
    CapacityReport,
    AttemptRef,
    Task,
    Assignment,
    Lease,
    Receipt,
    CommandResult,
    Finish,
    Welcome,
    CancelNotice,
)


def _make_converter(*, forbid_extra_keys: bool) -> cattrs.Converter:
    """One strict converter; client frames forbid extra keys, server bodies tolerate them."""
    conv = cattrs.Converter(detailed_validation=True)
    # Strict scalar hooks first: functions generated later pick these up.
    for kind in (str, int, bool):
        conv.register_structure_hook(kind, _strict(kind))
    conv.register_structure_hook(_dt.datetime, lambda v, _: parse_time(v))
    conv.register_unstructure_hook(_dt.datetime, format_time)
    # A predicate, not a singledispatch registration: typing.Any is not a class before 3.11.
    conv.register_structure_hook_func(lambda t: t is Any, lambda v, _: v)
    for enum_cls in (TaskState, AttemptState, Outcome, Disposition, Operation):
        conv.register_structure_hook(enum_cls, _strict_enum)
        conv.register_unstructure_hook(enum_cls, lambda e: e.value)

    def caps(value: Any, _: Any) -> tuple[Capability, ...]:
        if type(value) is not list:
            raise TypeError("capabilities must be a list")
        return tuple(conv.structure(v, Capability) for v in value)

    for cls in _MODELS:
        s_over: dict[str, Any] = {}
        u_over: dict[str, Any] = {}
        required: list[str] = []
        for f in attrs.fields(cls):
            kind = f.metadata.get("wire")
            if kind == "local":
                s_over[f.name] = override(omit=True)
                u_over[f.name] = override(omit=True)
                continue
            optional = (cls, f.name) in _OPTIONAL_ON_WIRE
            if not optional:
                required.append(f.name)
            if f.name == "capabilities":
                s_over[f.name] = override(struct_hook=caps)
            elif kind == "counter":
                s_over[f.name] = override(struct_hook=lambda v, _: parse_counter(v))
                u_over[f.name] = override(unstruct_hook=str)
            elif kind == "time":
                # parse_time rejects None: an optional field is absent or valid, never null.
                s_over[f.name] = override(struct_hook=lambda v, _: parse_time(v))
                u_over[f.name] = override(unstruct_hook=format_time, omit_if_default=optional)
            elif optional:
                u_over[f.name] = override(omit_if_default=True)
                if f.name == "retryable":
                    s_over[f.name] = override(struct_hook=_strict(bool))
                elif f.name == "error_code":
                    s_over[f.name] = override(struct_hook=_strict(str))
        generated: Callable[[Any, Any], Any] = make_dict_structure_fn(
            cls, conv, _cattrs_forbid_extra_keys=forbid_extra_keys, **s_over
        )
        if cls in _WINDOWS:
            generated = _exact_window(cls, generated)
        conv.register_structure_hook(cls, _require(cls, tuple(required), generated))
        conv.register_unstructure_hook(cls, make_dict_unstructure_fn(cls, conv, **u_over))
    return conv


# Windows bounded by PROTOCOL §5.2 (a Welcome) and §6.6 (an active Lease): (start, end, limit).
_WINDOWS: dict[type[Any], tuple[str, str, int]] = {
    Welcome: ("server_time", "expires_at", MAX_SESSION_WINDOW * _NS),
    Lease: ("server_time", "lease_until", MAX_LEASE_WINDOW * _NS),
}


def _exact_window(
    cls: type[Any], generated: Callable[[Any, Any], Any]
) -> Callable[[Any, Any], Any]:
    """Check a window in (0, limit] on the wire's nanoseconds, before the model sees times cut
    to microseconds: cut, 120 s + 1 ns would pass and a 1 ns window would read as zero."""
    start, end, limit = _WINDOWS[cls]

    def hook(value: dict[str, Any], typ: Any) -> Any:
        if cls is Welcome or value.get("active") is True:
            try:
                window = time_ns(value[end]) - time_ns(value[start])
            except (TypeError, ValueError):
                window = None  # malformed: the field's own hook reports it
            if window is not None:
                if not 0 < window <= limit:
                    raise ValueError(f"{end} must be after {start}, by at most {limit // _NS} s")
                if parse_time(value[end]) <= parse_time(value[start]):
                    # A valid window under one microsecond: the end is rounded up, not cut, so
                    # the model (microseconds) sees it positive as it is.
                    later = parse_time(value[start]) + _dt.timedelta(microseconds=1)
                    value = {**value, end: format_time(later)}
        return generated(value, typ)

    return hook


def _require(
    cls: type[Any], required: tuple[str, ...], generated: Callable[[Any, Any], Any]
) -> Callable[[Any, Any], Any]:
    # cattrs raises AttributeError on non-dict input and fills defaults for missing keys; the
    # wire wants an object with every control field explicit.
    def hook(value: Any, typ: Any) -> Any:
        if type(value) is not dict:
            raise TypeError(f"{cls.__name__} must be a JSON object")
        missing = [name for name in required if name not in value]
        if missing:
            raise ValueError(f"{cls.__name__} is missing {', '.join(missing)}")
        return generated(value, typ)

    return hook


#: Decodes server → client bodies: unknown fields tolerated (a newer server may add some).
SERVER_BODY = _make_converter(forbid_extra_keys=False)
#: Decodes client → server bodies: unknown fields rejected (the server's rule).
CLIENT_BODY = _make_converter(forbid_extra_keys=True)


def _describe(exc: BaseException) -> str:
    """A short, value-free description of a structuring failure (never echoes secrets)."""
    try:
        lines = cattrs.transform_error(exc)
    except Exception:
        lines = [f"{type(exc).__name__}: {exc}"]
    text = "; ".join(lines)
    return text if len(text) <= 300 else text[:297] + "..."


def structure(conv: cattrs.Converter, value: Any, cls: type[T]) -> T:
    """Structure *value* as *cls* or raise FrameError with a readable, secret-free path."""
    try:
        return conv.structure(value, cls)
    except Exception as exc:
        raise FrameError(f"invalid {cls.__name__}: {_describe(exc)}") from None


def unstructure(model: Any) -> dict[str, Any]:
    """The wire form of a model (counters as strings, times as RFC 3339, optionals omitted)."""
    wire_form = _bodies.WIRE_FORMS.get(type(model))
    if wire_form is not None:
        return wire_form(model)
    value: dict[str, Any] = SERVER_BODY.unstructure(model)
    return value


# --------------------------------------------------------------------------- encoding


def check_result(result: Any) -> None:
    """Raise FrameError unless *result* is strict JSON, not null, at most 256 KiB serialized."""
    result_json(result)


def result_json(result: Any) -> tuple[str, int]:
    """*result* serialized (and its size in UTF-8 bytes), once it is known to be strict JSON,
    not null and at most 256 KiB; FrameError otherwise."""
    if result is None:
        raise FrameError("result must be JSON other than null")
    text = _json.dumps(result)
    size = len(text.encode("utf-8"))
    if size > _json.MAX_RESULT_BYTES:
        raise FrameError(f"result is {size} bytes, over the {_json.MAX_RESULT_BYTES}-byte limit")
    # Python serializes int keys as strings and very large ints as digits; a strict peer rejects
    # the duplicates and non-doubles that can produce, so check what will actually be sent.
    _json.loads(text, limit=_json.MAX_FRAME_BYTES)
    return text, size


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
    size = len(text.encode("utf-8"))
    if size > _json.MAX_FRAME_BYTES:
        raise FrameError(f"frame is {size} bytes, over the {_json.MAX_FRAME_BYTES}-byte limit")
    return text


def encode_request(type_: str, message_id: str, session_id: str | None, body: Any) -> str:
    """Encode a client request whose body is a model."""
    if type(body) is AttemptRef and session_id is not None:
        # The hot path (start, renew, resume): the same few refs again and again. Every part is
        # already validated (hex ids, a known type), so the frame is the same text encode_frame
        # builds, without re-serializing the body each time.
        return f"{_request_head(type_, message_id, session_id)}{_ref_json(body)}}}"
    if type(body) is Finish and session_id is not None:
        return _finish_frame(type_, message_id, session_id, body)
    if isinstance(body, Finish):
        check_result(body.result)
    return encode_frame(type_, message_id, session_id=session_id, body=unstructure(body))


# Results whose serialization is already checked, by the Finish carrying them: the Worker's result
# encoder serialized each result when it made its snapshot (a finish is re-sent after a reconnect
# as the same object). Keyed by id and guarded by a weak reference (a Finish holding a dict is
# not hashable); an entry goes with its Finish.
_RESULT_JSON: dict[int, tuple[weakref.ref[Finish], str, int]] = {}


def remember_result_json(finish: Finish, text: str, size: int) -> None:
    """Record *text* (*size* bytes of UTF-8) as *finish*'s result, serialized and checked as
    :func:`result_json` does. Only for a result that is a fresh snapshot parsed from *text*
    (nobody else holds it to mutate it), as the Worker's result encoder makes."""
    key = id(finish)
    _RESULT_JSON[key] = (weakref.ref(finish, lambda _: _RESULT_JSON.pop(key, None)), text, size)


def _finish_result_json(finish: Finish) -> tuple[str, int]:
    known = _RESULT_JSON.get(id(finish))
    if known is not None and known[0]() is finish:
        return known[1], known[2]
    return result_json(finish.result)


def _finish_frame(type_: str, message_id: str, session_id: str, finish: Finish) -> str:
    """The text encode_frame builds for a finish, with the result serialized once: checked as
    strict JSON (that serialization is then sent as is) instead of serialized again in the frame;
    not at all when the Worker's encoder already did.
    """
    result, result_size = _finish_result_json(finish)
    # Every other part is validated ASCII (hex ids, the code pattern, enum values), so it needs
    # no escaping and counts one byte a character.
    head = (
        f"{_request_head(type_, message_id, session_id)}"
        f'{{"ref":{_ref_json(finish.ref)},"outcome":"{finish.outcome.value}","result":'
    )
    tail = ""
    if finish.error_code is not None:
        tail += f',"error_code":"{finish.error_code}"'
    if finish.retryable is not None:
        tail += ',"retryable":true' if finish.retryable else ',"retryable":false'
    tail += "}}"
    size = len(head) + result_size + len(tail)
    if size > _json.MAX_FRAME_BYTES:
        raise FrameError(f"frame is {size} bytes, over the {_json.MAX_FRAME_BYTES}-byte limit")
    return head + result + tail


def _request_head(type_: str, message_id: str, session_id: str) -> str:
    """A request frame up to its body, as encode_frame writes it (validated ASCII parts only)."""
    return (
        f'{{"protocol_version":"{PROTOCOL_VERSION}","type":"{type_}",'
        f'"message_id":"{message_id}","session_id":"{session_id}","body":'
    )


@functools.lru_cache(maxsize=1024)
def _ref_json(ref: AttemptRef) -> str:
    return _json.dumps(unstructure(ref))


# --------------------------------------------------------------------------- server → client


@attrs.frozen
class Reply:
    """An ``ack``/``worker.welcome`` (value) or ``error`` (error) answering ``reply_to``."""

    reply_to: str
    value: Any = None
    error: WorkerError | None = None


@attrs.frozen
class AssignPush:
    """A validated ``task.assign``."""

    assignment: Assignment


@attrs.frozen
class CancelPush:
    """A validated ``task.cancel``."""

    notice: CancelNotice


@attrs.frozen
class ServerAbort:
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


_id_match = ID_RE.fullmatch


def _is_id(value: Any) -> bool:
    return type(value) is str and _id_match(value) is not None


def _parse_envelope(raw: bytes | str) -> dict[str, Any]:
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
    for key in ("reply_to", "session_id"):
        if key in frame and not _is_id(frame[key]):
            raise _bad(f"{key} must be 32 lowercase hex")
    if frame["type"] == "error":
        if "body" in frame:
            raise _bad("error frame carries a body")
        if "error" not in frame:
            raise _bad("error frame without error")
    else:
        if "error" in frame:
            raise _bad(f"{frame['type']} carries an error field")
        if type(frame.get("body")) is not dict:
            raise _bad(f"{frame['type']} needs an object body")
    return frame


def _worker_error(frame: dict[str, Any]) -> WorkerError:
    err = frame["error"]
    if type(err) is not dict or err.keys() != {"code", "message"}:
        raise _bad("error must be {code, message}")
    code, message = err["code"], err["message"]
    if type(code) is not str or not CODE_RE.fullmatch(code):
        raise _bad("error code must be 1-64 characters of [A-Z][A-Z0-9_]*")
    if type(message) is not str:
        raise _bad("error message must be a string")
    return WorkerError(code, message, message_id=frame.get("reply_to"))


def _decode_body(
    value: Any, cls: type[T], conv: cattrs.Converter, decoders: Mapping[type[Any], Any]
) -> T:
    """*value* as *cls*, or FrameError naming what is wrong and where."""
    try:
        # The hot path: every field checked once, the model built without re-validating.
        decoded: T = decoders[cls](value)
        return decoded
    except Exception:  # any fault at all: the reference converter names it below
        pass
    # A rejected body (rare): the converter is the reference for what is wrong and where, so
    # error messages and paths are those it always gave. Should it accept what the fast path
    # refused, its model is used (tests/test_wire_bodies.py makes sure that never happens).
    return structure(conv, value, cls)


def _body(frame: dict[str, Any], cls: type[T]) -> T:
    try:
        return _decode_body(frame["body"], cls, SERVER_BODY, _bodies.SERVER_DECODERS)
    except FrameError as exc:
        raise _bad(str(exc)) from None


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


# The usual answer to start/renew/finish, byte for byte in the field order PROTOCOL §6 lists,
# compact, every string free of escapes. A frame that matches is valid JSON with no duplicate key
# and a well-formed envelope, so one match replaces the strict parse and the envelope checks;
# the body still goes through the one body decoder. Anything else (another order, whitespace,
# escapes, an error) takes the general path, which is also what names a fault.
_PLAIN_STRING = r'"([^"\\\x00-\x1f\x7f-\U0010ffff]{1,64})"'  # nothing to unescape
_SHAPE_PARTS = {
    "S": _PLAIN_STRING,
    "H": r'"([0-9a-f]{32})"',
    "B": r"(true|false)",
    "?": r'(?:,"cancel_requested_at":' + _PLAIN_STRING + ")?",
}
_ACK_SHAPE = re.compile(
    "".join(
        _SHAPE_PARTS.get(c, re.escape(c))
        for c in (
            '{"protocol_version":"1","type":"ack","message_id":H,"reply_to":H,"session_id":H,'
            '"body":{"receipt":{"operation":S,"task_state":S,"attempt_state":S,'
            '"task_revision":S,"lease_until":S,"disposition":S},"lease":{"active":B,"state":S,'
            '"lease_until":S,"server_time":S?},"deduplicated":B}}'
        )
    )
)


def _command_ack(
    raw: bytes | str, ctx: SessionContext, pending: Callable[[str], str | None]
) -> Reply | None:
    """The Reply of an ack of the usual shape (see ``_ACK_SHAPE``), else None."""
    try:
        text = raw.decode("utf-8") if type(raw) is bytes else raw
    except UnicodeDecodeError:
        return None
    m = _ACK_SHAPE.fullmatch(text)  # type: ignore[arg-type]
    if m is None:
        return None
    (_, reply_to, session_id, op, task_state, attempt_state, revision, receipt_until,
     disposition, active, state, until, now, cancel, dedup) = m.groups()  # fmt: skip
    request = pending(reply_to)
    if session_id != ctx.session_id or request is None or ACK_BODIES[request] is not CommandResult:
        return None
    lease: dict[str, Any] = {
        "active": active == "true",
        "state": state,
        "lease_until": until,
        "server_time": now,
    }
    if cancel is not None:
        lease["cancel_requested_at"] = cancel
    body = {
        "receipt": {
            "operation": op,
            "task_state": task_state,
            "attempt_state": attempt_state,
            "task_revision": revision,
            "lease_until": receipt_until,
            "disposition": disposition,
        },
        "lease": lease,
        "deduplicated": dedup == "true",
    }
    try:
        value = _bodies.command_result(body)
    except Exception:
        return None  # the general path names the fault
    if value.receipt.operation.value != request.removeprefix("task."):
        return None
    return Reply(reply_to, value=value)


def decode_server_frame(
    raw: bytes | str, ctx: SessionContext, pending: Callable[[str], str | None]
) -> ServerEvent:
    """Decode and check one server frame against the session's context.

    *pending* maps a ``message_id`` in flight to its request type (``None`` when unknown).
    Raises WorkerProtocolError on anything a conforming server cannot send.
    """
    reply = _command_ack(raw, ctx, pending)
    return reply if reply is not None else _decode_frame(raw, ctx, pending)


def _decode_frame(
    raw: bytes | str, ctx: SessionContext, pending: Callable[[str], str | None]
) -> ServerEvent:
    """The general path of :func:`decode_server_frame`: any frame, every fault named."""
    frame = _parse_envelope(raw)
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
    request = pending(reply_to)
    if request is None:
        raise _bad("reply_to names no pending request")
    if kind == "error":
        return Reply(reply_to, error=_worker_error(frame))
    value = _body(frame, ACK_BODIES[request])
    if isinstance(value, Welcome):
        if value.session_id != ctx.session_id or value.epoch != ctx.epoch:
            raise _bad("capacity ack names another session or epoch")
    elif isinstance(value, CommandResult) and value.receipt.operation.value != request.removeprefix(
        "task."
    ):
        raise _bad("receipt operation does not match the request")
    return Reply(reply_to, value=value)


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
        model = _decode_body(body, CLIENT_BODIES[kind], CLIENT_BODY, _bodies.CLIENT_DECODERS)
        if isinstance(model, Finish):
            check_result(model.result)
    except FrameError as exc:
        raise bad(str(exc)) from None
    assert isinstance(body, dict)  # structure() accepted it as an object
    return ClientFrame(kind, message_id, frame.get("session_id"), model, body)
