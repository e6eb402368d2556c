"""Wire bodies decoded and encoded by hand: each field is checked once, while it is read.

The strict cattrs converter in :mod:`orbit_sync._codec` structures a body and then the model's
constructor validates the same values again. Here every field gets exactly the checks the pair
of them applies (exact JSON types, canonical counters, RFC 3339 times, the id/secret/handler
patterns, the window and state rules of the constructors), and the model is built by a trusted
constructor that sets its slots without re-running validators or converters.

A decoder either returns the same model the converter would, or raises :class:`Rejected` (or
whatever a check raises on the way): it never names the fault. The codec then asks the
converter, which is the reference for every error message, so messages and paths stay as they
were. ``tests/test_wire_bodies.py`` compares both paths on the shared vectors and on mutated
bodies.

Trusted construction is per call (nothing process-wide is switched off), so models built from
user input in other threads keep validating.

Server bodies tolerate unknown fields (a newer server may add some); client bodies, decoded on
the mock server's side, are held to the closed schema. The encoders at the end write each
model's wire dict out, as the converter's generated unstructure functions would.
"""

from __future__ import annotations

import datetime as _dt
import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from .models import (
    CODE_RE,
    DECIMAL_RE,
    HANDLER_RE,
    ID_RE,
    MAX_CAPABILITIES,
    MAX_CAPACITY,
    MAX_LEASE_WINDOW,
    MAX_SESSION_WINDOW,
    SECRET_RE,
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


class Rejected(ValueError):
    """A body the fast path does not accept; the reference converter says why."""


_REJECTED = Rejected()
_UTC = _dt.timezone.utc
_NS = 1_000_000_000
_US = _dt.timedelta(microseconds=1)


def trusted_constructor(cls: type[T]) -> Callable[..., T]:
    """A function building *cls* from every attrs field, positionally, without running its
    ``__init__`` (validators, converters, ``__attrs_post_init__``).

    Only for values already checked as strictly as the constructor would: the decoders below.
    Generated once per class (as attrs generates ``__init__``), so a model costs one allocation
    and one slot store per field.
    """
    names = [a.name for a in attrs.fields(cls)]  # type: ignore[arg-type]
    args = ", ".join(names)
    stores = "".join(f"    _set(self, {name!r}, {name})\n" for name in names)
    source = f"def build({args}):\n    self = _new(_cls)\n{stores}    return self\n"
    namespace: dict[str, Any] = {"_new": object.__new__, "_set": object.__setattr__, "_cls": cls}
    exec(compile(source, f"<trusted constructor {cls.__qualname__}>", "exec"), namespace)
    build: Callable[..., T] = namespace["build"]
    return build


_new_receipt = trusted_constructor(Receipt)
_new_lease = trusted_constructor(Lease)
_new_command_result = trusted_constructor(CommandResult)
_new_welcome = trusted_constructor(Welcome)
_new_task = trusted_constructor(Task)
_new_assignment = trusted_constructor(Assignment)
_new_cancel_notice = trusted_constructor(CancelNotice)

# --------------------------------------------------------------------------- scalars

_id_match = ID_RE.fullmatch
_secret_match = SECRET_RE.fullmatch
_handler_match = HANDLER_RE.fullmatch
_decimal_match = DECIMAL_RE.fullmatch
_time_match = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?Z"
).fullmatch


def _id(value: Any) -> str:
    if type(value) is not str or _id_match(value) is None:
        raise _REJECTED
    return value


def _counter(value: Any) -> int:
    """A counter >= 1: a canonical decimal string other than ``"0"``."""
    if type(value) is not str or _decimal_match(value) is None or value == "0":
        raise _REJECTED
    return int(value)


def _version(value: Any) -> str:
    if type(value) is not str or _decimal_match(value) is None or value == "0":
        raise _REJECTED
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise _REJECTED
    return value


# Enum members by wire value: ``TABLE[value]``, not Enum.__call__. The keys are strs, so only a
# str equal to a value can hit; anything else raises KeyError (or TypeError when unhashable),
# which rejects the body like any other exception a decoder raises.
_OPERATIONS = {m.value: m for m in Operation}
_TASK_STATES = {m.value: m for m in TaskState}
_ATTEMPT_STATES = {m.value: m for m in AttemptState}
_DISPOSITIONS = {m.value: m for m in Disposition}


@functools.lru_cache(maxsize=512)
def parse_time_ns(value: str) -> tuple[_dt.datetime, int]:
    """A wire time as an aware UTC datetime (microseconds) and the nanoseconds below it.

    The caller has checked ``type(value) is str``. Raises ValueError unless the text is RFC 3339
    in UTC with ``Z`` and at most 9 fraction digits, and a real date and time. Cached: a frame
    repeats its times (the receipt's and the lease's ``lease_until``).
    """
    if _time_match(value) is None:
        raise ValueError("time must be RFC 3339 UTC with Z, e.g. 2026-09-17T08:00:30Z")
    whole = _whole_second(value[:19])
    if len(value) == 20:
        return whole, 0
    # The pattern fixed every position: the fraction is what lies between the '.' and the 'Z'.
    digits = value[20:-1].ljust(9, "0")
    return whole.replace(microsecond=int(digits[:6])), int(digits[6:])


@functools.lru_cache(maxsize=256)
def _whole_second(text: str) -> _dt.datetime:
    # Times of one session share their seconds (a lease's server_time and lease_until differ by
    # the fraction from frame to frame), so the calendar is checked once per second.
    try:
        return _dt.datetime(
            int(text[0:4]),
            int(text[5:7]),
            int(text[8:10]),
            int(text[11:13]),
            int(text[14:16]),
            int(text[17:19]),
            0,
            _UTC,
        )
    except ValueError:
        raise ValueError("time is not a real date and time") from None


def _time(value: Any) -> tuple[_dt.datetime, int]:
    if type(value) is not str:
        raise _REJECTED
    return parse_time_ns(value)


def _window(
    start: tuple[_dt.datetime, int], end: tuple[_dt.datetime, int], limit_s: int
) -> _dt.datetime:
    """Check ``end - start`` in (0, limit] on the wire's nanoseconds; return the end to keep.

    A valid window under one microsecond is rounded up to one (as the converter path does), so
    the model's microsecond times keep it positive.
    """
    delta = end[0] - start[0]
    window = ((delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds) * 1000 + (
        end[1] - start[1]
    )
    if not 0 < window <= limit_s * _NS:
        raise _REJECTED
    if end[0] <= start[0]:
        return start[0] + _US
    return end[0]


def _object(value: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise _REJECTED
    return value


# --------------------------------------------------------------------------- bodies


def receipt(value: Any) -> Receipt:
    """A Receipt from its wire object."""
    o = _object(value)
    return _new_receipt(
        _OPERATIONS[o["operation"]],
        _TASK_STATES[o["task_state"]],
        _ATTEMPT_STATES[o["attempt_state"]],
        _counter(o["task_revision"]),
        _time(o["lease_until"])[0],
        _DISPOSITIONS[o["disposition"]],
    )


_RUNNABLE = (AttemptState.LEASED, AttemptState.RUNNING)


def lease(value: Any) -> Lease:
    """A Lease (no local deadline yet) from its wire object."""
    o = _object(value)
    active = _bool(o["active"])
    state = _ATTEMPT_STATES[o["state"]]
    until = _time(o["lease_until"])
    now = _time(o["server_time"])
    cancel = _time(o["cancel_requested_at"])[0] if "cancel_requested_at" in o else None
    lease_until = until[0]
    if active:
        if state not in _RUNNABLE:
            raise _REJECTED
        lease_until = _window(now, until, MAX_LEASE_WINDOW)
    return _new_lease(active, state, lease_until, now[0], cancel, None)


def command_result(value: Any) -> CommandResult:
    """The ack body of start/renew/finish."""
    o = _object(value)
    return _new_command_result(receipt(o["receipt"]), lease(o["lease"]), _bool(o["deduplicated"]))


def welcome(value: Any) -> Welcome:
    """A Welcome (the answer to hello and to capacity)."""
    o = _object(value)
    now = _time(o["server_time"])
    expires_at = _window(now, _time(o["expires_at"]), MAX_SESSION_WINDOW)
    lease_ms = o["lease_duration_ms"]
    if type(lease_ms) is not int or not 1_000 <= lease_ms <= 120_000:
        raise _REJECTED
    return _new_welcome(
        _id(o["session_id"]),
        _counter(o["epoch"]),
        now[0],
        expires_at,
        lease_ms,
        _bool(o["draining"]),
    )


def task(value: Any) -> Task:
    """A Task as an assignment describes it."""
    o = _object(value)
    handler = o["handler"]
    if type(handler) is not str or _handler_match(handler) is None:
        raise _REJECTED
    payload = o["payload"]
    if payload is None:
        raise _REJECTED
    attempt = _counter(o["attempt"])
    max_attempts = _counter(o["max_attempts"])
    if attempt > max_attempts:
        raise _REJECTED
    return _new_task(
        _id(o["task_id"]),
        _id(o["queue_id"]),
        _id(o["namespace_id"]),
        handler,
        _version(o["handler_version"]),
        _version(o["payload_version"]),
        payload,
        _TASK_STATES[o["state"]],
        _counter(o["revision"]),
        attempt,
        max_attempts,
    )


def assignment(value: Any) -> Assignment:
    """A ``task.assign`` body."""
    o = _object(value)
    secret = o["lease_secret"]
    if type(secret) is not str or _secret_match(secret) is None:
        raise _REJECTED
    return _new_assignment(
        task(o["task"]),
        _id(o["attempt_id"]),
        _counter(o["epoch"]),
        secret,
        _time(o["lease_until"])[0],
        _time(o["server_time"])[0],
    )


def cancel_notice(value: Any) -> CancelNotice:
    """A ``task.cancel`` body."""
    o = _object(value)
    return _new_cancel_notice(
        _id(o["task_id"]),
        _id(o["attempt_id"]),
        _counter(o["epoch"]),
        _time(o["cancel_requested_at"])[0],
    )


#: The decoder of each server → client body model.
SERVER_DECODERS: dict[type[Any], Callable[[Any], Any]] = {
    Receipt: receipt,
    Lease: lease,
    CommandResult: command_result,
    Welcome: welcome,
    Task: task,
    Assignment: assignment,
    CancelNotice: cancel_notice,
}


# --------------------------------------------------------------------------- client → server
# What the server accepts (the mock server's side): the same checks, and no field beyond the
# model's (a client is held to the closed schema, PROTOCOL §12).

_new_capability = trusted_constructor(Capability)
_new_registration = trusted_constructor(Registration)
_new_capacity_report = trusted_constructor(CapacityReport)
_new_attempt_ref = trusted_constructor(AttemptRef)
_new_finish = trusted_constructor(Finish)

_code_match = CODE_RE.fullmatch
_OUTCOMES = {m.value: m for m in Outcome}
_CAPABILITY_KEYS = frozenset({"handler", "handler_version", "payload_version"})
_REGISTRATION_KEYS = frozenset(
    {
        "queue_id",
        "capabilities",
        "capacity",
        "instance_id",
        "instance_secret",
        "cancellation_notifications",
    }
)
_CAPACITY_KEYS = frozenset({"sequence", "capacity", "drain"})
_REF_KEYS = frozenset({"task_id", "attempt_id", "epoch", "lease_secret"})
_FINISH_KEYS = frozenset({"ref", "outcome", "result", "error_code", "retryable"})


def _closed(value: Any, keys: frozenset[str]) -> dict[str, Any]:
    if type(value) is not dict or not keys.issuperset(value):
        raise _REJECTED
    return value


def _secret(value: Any) -> str:
    if type(value) is not str or _secret_match(value) is None:
        raise _REJECTED
    return value


def capability(value: Any) -> Capability:
    """One registered capability."""
    o = _closed(value, _CAPABILITY_KEYS)
    handler = o["handler"]
    if type(handler) is not str or _handler_match(handler) is None:
        raise _REJECTED
    return _new_capability(handler, _version(o["handler_version"]), _version(o["payload_version"]))


def registration(value: Any) -> Registration:
    """A ``worker.hello`` body."""
    o = _closed(value, _REGISTRATION_KEYS)
    listed = o["capabilities"]
    if type(listed) is not list or not 1 <= len(listed) <= MAX_CAPABILITIES:
        raise _REJECTED
    capabilities = tuple(capability(c) for c in listed)
    if len(set(capabilities)) != len(capabilities):
        raise _REJECTED
    capacity = o["capacity"]
    if type(capacity) is not int or not 1 <= capacity <= MAX_CAPACITY:
        raise _REJECTED
    notifications = False
    if "cancellation_notifications" in o:
        notifications = _bool(o["cancellation_notifications"])
    return _new_registration(
        _id(o["queue_id"]),
        capabilities,
        capacity,
        _id(o["instance_id"]),
        _secret(o["instance_secret"]),
        notifications,
    )


def capacity_report(value: Any) -> CapacityReport:
    """A ``worker.capacity`` body."""
    o = _closed(value, _CAPACITY_KEYS)
    capacity = o["capacity"]
    if type(capacity) is not int or not 0 <= capacity <= MAX_CAPACITY:
        raise _REJECTED
    return _new_capacity_report(_counter(o["sequence"]), capacity, _bool(o["drain"]))


def attempt_ref(value: Any) -> AttemptRef:
    """The body of ``worker.resume``, ``task.start`` and ``task.renew``."""
    o = _closed(value, _REF_KEYS)
    return _new_attempt_ref(
        _id(o["task_id"]), _id(o["attempt_id"]), _counter(o["epoch"]), _secret(o["lease_secret"])
    )


def finish(value: Any) -> Finish:
    """A ``task.finish`` body (its result's size is the codec's to check)."""
    o = _closed(value, _FINISH_KEYS)
    outcome = _OUTCOMES[o["outcome"]]
    result = o["result"]
    if result is None:
        raise _REJECTED
    code = None
    if "error_code" in o:
        code = o["error_code"]
        if type(code) is not str or _code_match(code) is None:  # null too (PROTOCOL §12)
            raise _REJECTED
    retryable = _bool(o["retryable"]) if "retryable" in o else None
    # The outcome rules of Finish.__attrs_post_init__.
    if (code is None) != (outcome is Outcome.SUCCEEDED):
        raise _REJECTED
    if retryable is True and outcome is not Outcome.FAILED:
        raise _REJECTED
    return _new_finish(attempt_ref(o["ref"]), outcome, result, code, retryable)


#: The decoder of each client → server body model.
CLIENT_DECODERS: dict[type[Any], Callable[[Any], Any]] = {
    Registration: registration,
    CapacityReport: capacity_report,
    AttemptRef: attempt_ref,
    Finish: finish,
}

# --------------------------------------------------------------------------- encoding
# The wire form of each model, written out: the same dicts the converter's generated
# unstructure functions give (same keys, same order, optionals omitted alike), without its
# per-call dispatch. tests/test_wire_bodies.py compares both for every model.


def format_time(value: _dt.datetime) -> str:
    """Format an aware datetime as RFC 3339 UTC with ``Z`` (fraction only when non-zero)."""
    if value.tzinfo is not _UTC:
        value = value.astimezone(_UTC)
    # isoformat() (C) always gives four year digits and ends in "+00:00" here; a fraction, when
    # there is one, has six digits, of which RFC 3339 needs only the significant ones.
    text = value.isoformat()[:-6]
    if value.microsecond:
        text = text.rstrip("0")
    return text + "Z"


def _capability_wire(c: Capability) -> dict[str, Any]:
    return {
        "handler": c.handler,
        "handler_version": c.handler_version,
        "payload_version": c.payload_version,
    }


def _registration_wire(r: Registration) -> dict[str, Any]:
    out: dict[str, Any] = {
        "queue_id": r.queue_id,
        "capabilities": [_capability_wire(c) for c in r.capabilities],
        "capacity": r.capacity,
        "instance_id": r.instance_id,
        "instance_secret": r.instance_secret,
    }
    if r.cancellation_notifications:
        out["cancellation_notifications"] = True
    return out


def _capacity_wire(c: CapacityReport) -> dict[str, Any]:
    return {"sequence": str(c.sequence), "capacity": c.capacity, "drain": c.drain}


def _ref_wire(r: AttemptRef) -> dict[str, Any]:
    return {
        "task_id": r.task_id,
        "attempt_id": r.attempt_id,
        "epoch": str(r.epoch),
        "lease_secret": r.lease_secret,
    }


def _task_wire(t: Task) -> dict[str, Any]:
    return {
        "task_id": t.task_id,
        "queue_id": t.queue_id,
        "namespace_id": t.namespace_id,
        "handler": t.handler,
        "handler_version": t.handler_version,
        "payload_version": t.payload_version,
        "payload": t.payload,
        "state": t.state.value,
        "revision": str(t.revision),
        "attempt": str(t.attempt),
        "max_attempts": str(t.max_attempts),
    }


def _assignment_wire(a: Assignment) -> dict[str, Any]:
    return {
        "task": _task_wire(a.task),
        "attempt_id": a.attempt_id,
        "epoch": str(a.epoch),
        "lease_secret": a.lease_secret,
        "lease_until": format_time(a.lease_until),
        "server_time": format_time(a.server_time),
    }


def _lease_wire(x: Lease) -> dict[str, Any]:
    out: dict[str, Any] = {
        "active": x.active,
        "state": x.state.value,
        "lease_until": format_time(x.lease_until),
        "server_time": format_time(x.server_time),
    }
    if x.cancel_requested_at is not None:
        out["cancel_requested_at"] = format_time(x.cancel_requested_at)
    return out


def _receipt_wire(r: Receipt) -> dict[str, Any]:
    return {
        "operation": r.operation.value,
        "task_state": r.task_state.value,
        "attempt_state": r.attempt_state.value,
        "task_revision": str(r.task_revision),
        "lease_until": format_time(r.lease_until),
        "disposition": r.disposition.value,
    }


def _command_result_wire(c: CommandResult) -> dict[str, Any]:
    return {
        "receipt": _receipt_wire(c.receipt),
        "lease": _lease_wire(c.lease),
        "deduplicated": c.deduplicated,
    }


def _finish_wire(f: Finish) -> dict[str, Any]:
    out: dict[str, Any] = {"ref": _ref_wire(f.ref), "outcome": f.outcome.value, "result": f.result}
    if f.error_code is not None:
        out["error_code"] = f.error_code
    if f.retryable is not None:
        out["retryable"] = f.retryable
    return out


def _welcome_wire(w: Welcome) -> dict[str, Any]:
    return {
        "session_id": w.session_id,
        "epoch": str(w.epoch),
        "server_time": format_time(w.server_time),
        "expires_at": format_time(w.expires_at),
        "lease_duration_ms": w.lease_duration_ms,
        "draining": w.draining,
    }


def _cancel_notice_wire(c: CancelNotice) -> dict[str, Any]:
    return {
        "task_id": c.task_id,
        "attempt_id": c.attempt_id,
        "epoch": str(c.epoch),
        "cancel_requested_at": format_time(c.cancel_requested_at),
    }


#: The wire dict of each model, by exact type (a subclass goes through the converter).
WIRE_FORMS: dict[type[Any], Callable[[Any], dict[str, Any]]] = {
    Capability: _capability_wire,
    Registration: _registration_wire,
    CapacityReport: _capacity_wire,
    AttemptRef: _ref_wire,
    Task: _task_wire,
    Assignment: _assignment_wire,
    Lease: _lease_wire,
    Receipt: _receipt_wire,
    CommandResult: _command_result_wire,
    Finish: _finish_wire,
    Welcome: _welcome_wire,
    CancelNotice: _cancel_notice_wire,
}
