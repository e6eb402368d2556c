"""Wire bodies of ``pulse.worker.v1``, decoded and encoded by hand: the one decoder of each body.

Each field is checked once, while it is read, by the rules of :mod:`orbit_sync._rules` (the same
functions the models' constructors run), and the model is then built by a trusted constructor
that sets its slots without running the validators again. A body that breaks a rule raises
:class:`Fault`, which names the field's path and the rule's reason (never the value: it may be a
secret); the codec turns it into the frame error.

Trusted construction is per call (nothing process-wide is switched off), so models built from
user input in other threads keep validating.

Server bodies tolerate unknown fields (a newer server may add some); client bodies, decoded on
the mock server's side, are held to the closed schema (PROTOCOL §12). The encoders at the end
write each model's wire dict out.
"""

from __future__ import annotations

import datetime as _dt
import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from . import _rules
from .models import (
    RUNNABLE,
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


class Fault(ValueError):
    """A body breaking a rule: where (a dotted path, empty for the body itself) and why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path
        self.reason = reason

    def under(self, name: str) -> Fault:
        """This fault seen from the object holding *name*."""
        return Fault(f"{name}.{self.path}" if self.path else name, self.reason)

    def describe(self, what: str) -> str:
        """``path reason`` (``lease.active must be a bool``), or ``what reason`` for the body
        itself (``CommandResult is missing lease``)."""
        return f"{self.path or what} {self.reason}"


def _at(name: str, exc: Exception) -> Fault:
    """The fault of field *name*: a nested body's fault moves under it, a KeyError is the field
    missing, a rule's reason is the field's."""
    if isinstance(exc, Fault):
        return exc.under(name)
    if isinstance(exc, KeyError):
        return Fault(name, "is missing")
    return Fault(name, str(exc))


_UTC = _dt.timezone.utc
_US = _dt.timedelta(microseconds=1)


def trusted_constructor(cls: type[T]) -> Callable[..., T]:
    """A function building *cls* from every attrs field, positionally, without running its
    ``__init__`` (validators, converters, ``__attrs_post_init__``).

    Only for values already checked by the rules the constructor applies: the decoders below.
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

_id = _rules.id_
_secret = _rules.secret
_counter = _rules.wire_counter
_version = _rules.version
_bool = _rules.boolean
_OPERATION = _rules.member_of(Operation)
_TASK_STATE = _rules.member_of(TaskState)
_ATTEMPT_STATE = _rules.member_of(AttemptState)
_DISPOSITION = _rules.member_of(Disposition)
_OUTCOME = _rules.member_of(Outcome)

_time_match = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?Z"
).fullmatch


@functools.lru_cache(maxsize=512)
def parse_time_ns(value: str) -> tuple[_dt.datetime, int]:
    """A wire time as an aware UTC datetime (microseconds) and the nanoseconds below it.

    The caller has checked ``type(value) is str``. Raises ValueError unless the text is RFC 3339
    in UTC with ``Z`` and at most 9 fraction digits, and a real date and time. Cached: a frame
    repeats its times (the receipt's and the lease's ``lease_until``).
    """
    if _time_match(value) is None:
        raise ValueError("must be RFC 3339 UTC with Z, e.g. 2026-09-17T08:00:30Z")
    whole = _whole_second(value[:19])
    size = len(value)
    if size == 20:
        return whole, 0
    # The pattern fixed every position: the fraction is what lies between the '.' and the 'Z'.
    if size <= 27:  # at most 6 digits: microseconds only
        return whole.replace(microsecond=int(value[20:-1]) * _FRACTION_SCALE[size - 22]), 0
    digits = value[20:-1].ljust(9, "0")
    return whole.replace(microsecond=int(digits[:6])), int(digits[6:])


# Microseconds per unit of a fraction of 1 to 6 digits.
_FRACTION_SCALE = (100_000, 10_000, 1_000, 100, 10, 1)


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
        raise ValueError("is not a real date and time") from None


def _time(value: Any) -> tuple[_dt.datetime, int]:
    if type(value) is not str:
        raise TypeError("must be an RFC 3339 string")
    return parse_time_ns(value)


def _window(
    start: tuple[_dt.datetime, int],
    end: tuple[_dt.datetime, int],
    limit_s: int,
    names: tuple[str, str],
) -> _dt.datetime:
    """Check the window ``end - start`` on the wire's nanoseconds (the model's microseconds would
    let 120 s + 1 ns pass and read 1 ns as zero); return the end to keep.

    A valid window under one microsecond is rounded up to one, so the model's microsecond times
    keep it positive.
    """
    delta_ns = _rules.timedelta_ns(end[0] - start[0]) + (end[1] - start[1])
    _rules.window(delta_ns, limit_s, names[0], names[1])
    if end[0] <= start[0]:
        return start[0] + _US
    return end[0]


def _object(value: Any) -> dict[str, Any]:
    """*value* as a JSON object (a missing field is the KeyError of its read, see below)."""
    if type(value) is not dict:
        raise Fault("", "must be a JSON object")
    return value


def _closed(value: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """*value* as :func:`_object` does, with no field beyond *allowed* (a client's body)."""
    o = _object(value)
    if not allowed.issuperset(o):
        # The unknown names are the sender's text: not repeated.
        raise Fault("", "has a field the schema does not define")
    return o


def _keys(*names: str) -> frozenset[str]:
    return frozenset(names)


# --------------------------------------------------------------------------- server → client
# Each decoder records the field it is reading in ``f``; a rule's exception, or the KeyError of a
# missing field, becomes a Fault at that field (try costs nothing until something raises).


def receipt(value: Any) -> Receipt:
    """A Receipt from its wire object."""
    o = _object(value)
    f = "operation"
    try:
        operation = _OPERATION(o[f])
        f = "task_state"
        task_state = _TASK_STATE(o[f])
        f = "attempt_state"
        attempt_state = _ATTEMPT_STATE(o[f])
        f = "task_revision"
        revision = _counter(o[f])
        f = "lease_until"
        until = _time(o[f])[0]
        f = "disposition"
        disposition = _DISPOSITION(o[f])
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_receipt(operation, task_state, attempt_state, revision, until, disposition)


_LEASE_WINDOW = ("server_time", "lease_until")


def lease(value: Any) -> Lease:
    """A Lease (no local deadline yet) from its wire object."""
    o = _object(value)
    f = "active"
    try:
        active = _bool(o[f])
        f = "state"
        state = _ATTEMPT_STATE(o[f])
        f = "lease_until"
        until = _time(o[f])
        f = "server_time"
        now = _time(o[f])
        cancel = None
        if "cancel_requested_at" in o:
            f = "cancel_requested_at"
            cancel = _time(o[f])[0]
        lease_until = until[0]
        if active:
            f = "state"
            _rules.active_lease_state(True, state in RUNNABLE)
            f = "lease_until"
            lease_until = _window(now, until, _rules.MAX_LEASE_WINDOW, _LEASE_WINDOW)
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_lease(active, state, lease_until, now[0], cancel, None)


def command_result(value: Any) -> CommandResult:
    """The ack body of start/renew/finish."""
    o = _object(value)
    f = "receipt"
    try:
        got = receipt(o[f])
        f = "lease"
        status = lease(o[f])
        f = "deduplicated"
        deduplicated = _bool(o[f])
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_command_result(got, status, deduplicated)


_SESSION_WINDOW = ("server_time", "expires_at")


def welcome(value: Any) -> Welcome:
    """A Welcome (the answer to hello and to capacity)."""
    o = _object(value)
    f = "session_id"
    try:
        session_id = _id(o[f])
        f = "epoch"
        epoch = _counter(o[f])
        f = "server_time"
        now = _time(o[f])
        f = "expires_at"
        expires_at = _window(now, _time(o[f]), _rules.MAX_SESSION_WINDOW, _SESSION_WINDOW)
        f = "lease_duration_ms"
        lease_ms = _rules.LEASE_DURATION_MS(o[f])
        f = "draining"
        draining = _bool(o[f])
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_welcome(session_id, epoch, now[0], expires_at, lease_ms, draining)


def task(value: Any) -> Task:
    """A Task as an assignment describes it."""
    o = _object(value)
    f = "task_id"
    try:
        task_id = _id(o[f])
        f = "queue_id"
        queue_id = _id(o[f])
        f = "namespace_id"
        namespace_id = _id(o[f])
        f = "handler"
        handler = _rules.handler(o[f])
        f = "handler_version"
        handler_version = _version(o[f])
        f = "payload_version"
        payload_version = _version(o[f])
        f = "payload"
        payload = _rules.json_value(o[f])
        f = "state"
        state = _TASK_STATE(o[f])
        f = "revision"
        revision = _counter(o[f])
        f = "attempt"
        attempt = _counter(o[f])
        f = "max_attempts"
        max_attempts = _counter(o[f])
        f = "attempt"
        _rules.attempts(attempt, max_attempts)
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_task(
        task_id,
        queue_id,
        namespace_id,
        handler,
        handler_version,
        payload_version,
        payload,
        state,
        revision,
        attempt,
        max_attempts,
    )


def assignment(value: Any) -> Assignment:
    """A ``task.assign`` body."""
    o = _object(value)
    f = "task"
    try:
        described = task(o[f])
        f = "attempt_id"
        attempt_id = _id(o[f])
        f = "epoch"
        epoch = _counter(o[f])
        f = "lease_secret"
        secret = _secret(o[f])
        f = "lease_until"
        until = _time(o[f])[0]
        f = "server_time"
        now = _time(o[f])[0]
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_assignment(described, attempt_id, epoch, secret, until, now)


def cancel_notice(value: Any) -> CancelNotice:
    """A ``task.cancel`` body."""
    o = _object(value)
    f = "task_id"
    try:
        task_id = _id(o[f])
        f = "attempt_id"
        attempt_id = _id(o[f])
        f = "epoch"
        epoch = _counter(o[f])
        f = "cancel_requested_at"
        at = _time(o[f])[0]
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_cancel_notice(task_id, attempt_id, epoch, at)


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
# What the server accepts (the mock server's side): the same rules, and no field beyond the
# model's (a client is held to the closed schema, PROTOCOL §12).

_new_capability = trusted_constructor(Capability)
_new_registration = trusted_constructor(Registration)
_new_capacity_report = trusted_constructor(CapacityReport)
_new_attempt_ref = trusted_constructor(AttemptRef)
_new_finish = trusted_constructor(Finish)

_CAPABILITY = _keys("handler", "handler_version", "payload_version")


def capability(value: Any) -> Capability:
    """One registered capability."""
    o = _closed(value, _CAPABILITY)
    f = "handler"
    try:
        handler = _rules.handler(o[f])
        f = "handler_version"
        handler_version = _version(o[f])
        f = "payload_version"
        payload_version = _version(o[f])
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_capability(handler, handler_version, payload_version)


_REGISTRATION = _keys(
    "queue_id",
    "capabilities",
    "capacity",
    "instance_id",
    "instance_secret",
    "cancellation_notifications",
)


def _capabilities(value: Any) -> tuple[Capability, ...]:
    if type(value) is not list:
        raise TypeError("must be a list")
    _rules.capabilities_count(len(value))
    listed = []
    for i, item in enumerate(value):
        try:
            listed.append(capability(item))
        except Fault as exc:
            raise exc.under(str(i)) from None
    capabilities = tuple(listed)
    _rules.distinct(capabilities)
    return capabilities


def registration(value: Any) -> Registration:
    """A ``worker.hello`` body."""
    o = _closed(value, _REGISTRATION)
    f = "queue_id"
    try:
        queue_id = _id(o[f])
        f = "capabilities"
        capabilities = _capabilities(o[f])
        f = "capacity"
        capacity = _rules.CAPACITY(o[f])
        f = "instance_id"
        instance_id = _id(o[f])
        f = "instance_secret"
        instance_secret = _secret(o[f])
        notifications = False
        if "cancellation_notifications" in o:
            f = "cancellation_notifications"
            notifications = _bool(o[f])
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_registration(
        queue_id, capabilities, capacity, instance_id, instance_secret, notifications
    )


_CAPACITY_REPORT = _keys("sequence", "capacity", "drain")


def capacity_report(value: Any) -> CapacityReport:
    """A ``worker.capacity`` body."""
    o = _closed(value, _CAPACITY_REPORT)
    f = "sequence"
    try:
        sequence = _counter(o[f])
        f = "capacity"
        capacity = _rules.REPORTED_CAPACITY(o[f])
        f = "drain"
        drain = _bool(o[f])
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_capacity_report(sequence, capacity, drain)


_ATTEMPT_REF = _keys("task_id", "attempt_id", "epoch", "lease_secret")


def attempt_ref(value: Any) -> AttemptRef:
    """The body of ``worker.resume``, ``task.start`` and ``task.renew``."""
    o = _closed(value, _ATTEMPT_REF)
    f = "task_id"
    try:
        task_id = _id(o[f])
        f = "attempt_id"
        attempt_id = _id(o[f])
        f = "epoch"
        epoch = _counter(o[f])
        f = "lease_secret"
        secret = _secret(o[f])
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_attempt_ref(task_id, attempt_id, epoch, secret)


_FINISH = _keys("ref", "outcome", "result", "error_code", "retryable")


def finish(value: Any) -> Finish:
    """A ``task.finish`` body (its result's size is the codec's to check)."""
    o = _closed(value, _FINISH)
    f = "ref"
    try:
        ref = attempt_ref(o[f])
        f = "outcome"
        outcome = _OUTCOME(o[f])
        f = "result"
        result = _rules.json_value(o[f])
        code = retryable = None
        if "error_code" in o:
            f = "error_code"
            code = _rules.code(o[f])  # null too: absent is the only "none" (PROTOCOL §12)
        if "retryable" in o:
            f = "retryable"
            retryable = _bool(o[f])
        f = "outcome"
        _rules.finish_outcome(
            outcome is Outcome.SUCCEEDED, outcome.value, outcome is Outcome.FAILED, code, retryable
        )
    except (TypeError, ValueError, KeyError) as exc:
        raise _at(f, exc) from None
    return _new_finish(ref, outcome, result, code, retryable)


#: The decoder of each client → server body model.
CLIENT_DECODERS: dict[type[Any], Callable[[Any], Any]] = {
    Registration: registration,
    CapacityReport: capacity_report,
    AttemptRef: attempt_ref,
    Finish: finish,
}

# --------------------------------------------------------------------------- encoding
# The wire form of each model, written out: counters as decimal strings, times as RFC 3339,
# optional fields omitted when they hold their default. tests/test_wire_bodies.py decodes every
# one back to an equal model.


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


#: The wire dict of each model.
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
