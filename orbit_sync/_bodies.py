"""Wire bodies of ``pulse.worker.v1``: each body declared once, its decoder and encoder
generated from the declaration.

Each field is checked once, while it is read, by the rules of :mod:`orbit_sync._rules` (the same
functions the models' constructors run), and the model is then built by a trusted constructor
that sets its slots without running the validators again. A body that breaks a rule raises
:class:`Fault`, which names the field's path and the rule's reason (never the value: it may be a
secret); the codec turns it into the frame error.

Trusted construction is per call (nothing process-wide is switched off), so models built from
user input in other threads keep validating.

Server bodies tolerate unknown fields (a newer server may add some); client bodies, decoded on
the mock server's side, are held to the closed schema (PROTOCOL §12).
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
        return exc.under(name) if name else exc
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


def _instant(value: Any) -> _dt.datetime:
    """A wire time where no window needs its nanoseconds."""
    if type(value) is not str:
        raise TypeError("must be an RFC 3339 string")
    return parse_time_ns(value)[0]


def _window(
    start: tuple[_dt.datetime, int],
    end: tuple[_dt.datetime, int],
    limit_s: int,
    start_name: str,
    end_name: str,
) -> _dt.datetime:
    """Check the window ``end - start`` on the wire's nanoseconds (the model's microseconds would
    let 120 s + 1 ns pass and read 1 ns as zero); return the end to keep, or Fault at *end_name*.

    A valid window under one microsecond is rounded up to one, so the model's microsecond times
    keep it positive.
    """
    delta_ns = _rules.timedelta_ns(end[0] - start[0]) + (end[1] - start[1])
    try:
        _rules.window(delta_ns, limit_s, start_name, end_name)
    except ValueError as exc:
        raise Fault(end_name, str(exc)) from None
    if end[0] <= start[0]:
        return start[0] + _US
    return end[0]


def _checked(name: str, rule: Callable[..., None], *args: Any) -> None:
    """Apply a rule across fields; its reason is reported at field *name*."""
    try:
        rule(*args)
    except ValueError as exc:
        raise Fault(name, str(exc)) from None


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


# --------------------------------------------------------------------------- the schema
# Each body is declared once: its wire fields in the model's order, each with its rule (a nested
# body's decoder for a nested body) and, for a field the wire may omit, the value its absence
# means; then the rule across fields, if any. Its decoder and its encoder are generated from the
# declaration as specialised functions (as attrs generates __init__). The decoder reads and
# checks every field once, keeping the field being read in ``f`` so that a rule's exception, or
# the KeyError of a missing field, becomes a Fault at that field (a try costs nothing until
# something raises). The encoder writes the fields in the declared order, each in its wire form
# (counters as decimal strings, times as RFC 3339, enums as their values), and leaves out an
# optional field holding the value its absence means.

_REQUIRED: Any = attrs.NOTHING


def _decoder(
    cls: type[T],
    fields: list[tuple[str, Callable[[Any], Any], Any]],
    *,
    closed: bool = False,
    across: Callable[..., tuple[Any, ...]] | None = None,
) -> Callable[[Any], T]:
    """The decoder of body *cls*, generated from its declaration.

    *closed*: no field beyond the declared ones (a client's body, PROTOCOL §12). *across*: the
    rule across fields; it takes the decoded values and returns those to build the model with.
    Model fields that never travel (``Lease.deadline``) get their defaults.
    """
    model = attrs.fields(cls)  # type: ignore[arg-type]
    names = [name for name, _, _ in fields]
    if names != [a.name for a in model[: len(names)]]:
        raise TypeError(f"{cls.__name__}: fields must be declared in the model's order")
    local = [a.default for a in model[len(names) :]]
    ns: dict[str, Any] = {
        "_Fault": Fault,
        "_at": _at,
        "_new": trusted_constructor(cls),
        "_across": across,
        "_allowed": frozenset(names),
        "_local": tuple(local),
    }
    lines = [
        "def decode(o):",
        "    if type(o) is not dict:",
        "        raise _Fault('', 'must be a JSON object')",
    ]
    if closed:
        # The unknown names are the sender's text: not repeated.
        lines += [
            "    if not _allowed.issuperset(o):",
            "        raise _Fault('', 'has a field the schema does not define')",
        ]
    lines += [f"    f = {names[0]!r}", "    try:"]
    values = []
    for i, (name, rule, absent) in enumerate(fields):
        ns[f"_r{i}"] = rule
        if i:
            lines.append(f"        f = {name!r}")
        if absent is _REQUIRED:
            lines.append(f"        v{i} = _r{i}(o[{name!r}])")
        else:
            ns[f"_d{i}"] = absent
            lines.append(f"        v{i} = _r{i}(o[{name!r}]) if {name!r} in o else _d{i}")
        values.append(f"v{i}")
    args = ", ".join(values)
    if across is not None:
        lines += ["        f = ''", f"        {args}, = _across({args})"]
    lines += [
        "    except (TypeError, ValueError, KeyError) as exc:",
        "        raise _at(f, exc) from None",
        f"    return _new({args}, *_local)" if local else f"    return _new({args})",
    ]
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<decoder {cls.__qualname__}>", "exec"), ns)
    decode: Callable[[Any], T] = ns["decode"]
    WIRE_FORMS[cls] = _encoder(cls, fields)
    _WIRE_OF[decode] = WIRE_FORMS[cls]
    return decode


def _enum_value(member: Any) -> Any:
    return member.value


#: The wire dict of each model (filled in as each body is declared).
WIRE_FORMS: dict[type[Any], Callable[[Any], dict[str, Any]]] = {}
#: How a field checked by a rule is written: a counter as text, a time as RFC 3339, an enum as
#: its value, a nested body by its own encoder (added as each is declared); the rest as is.
_WIRE_OF: dict[Callable[[Any], Any], Callable[[Any], Any]] = {
    _counter: str,
    _time: format_time,
    _instant: format_time,
    **dict.fromkeys((_OPERATION, _TASK_STATE, _ATTEMPT_STATE, _DISPOSITION, _OUTCOME), _enum_value),
}


def _encoder(
    cls: type[Any], fields: list[tuple[str, Callable[[Any], Any], Any]]
) -> Callable[[Any], dict[str, Any]]:
    """The encoder of body *cls*, generated from its declaration (see above)."""
    ns: dict[str, Any] = {}
    lines = ["def encode(m):", "    out = {}"]
    for i, (name, rule, absent) in enumerate(fields):
        value = f"m.{name}"
        write = _WIRE_OF.get(rule)
        if write is not None:
            ns[f"_w{i}"] = write
            value = f"_w{i}({value})"
        if absent is _REQUIRED:
            lines.append(f"    out[{name!r}] = {value}")
        else:
            ns[f"_d{i}"] = absent
            lines += [f"    if m.{name} is not _d{i}:", f"        out[{name!r}] = {value}"]
    lines.append("    return out")
    exec(compile("\n".join(lines) + "\n", f"<encoder {cls.__qualname__}>", "exec"), ns)
    encode: Callable[[Any], dict[str, Any]] = ns["encode"]
    return encode


# --------------------------------------------------------------------------- server → client
# Server bodies tolerate unknown fields (a newer server may add some).

receipt = _decoder(
    Receipt,
    [
        ("operation", _OPERATION, _REQUIRED),
        ("task_state", _TASK_STATE, _REQUIRED),
        ("attempt_state", _ATTEMPT_STATE, _REQUIRED),
        ("task_revision", _counter, _REQUIRED),
        ("lease_until", _instant, _REQUIRED),
        ("disposition", _DISPOSITION, _REQUIRED),
    ],
)


def _lease_across(
    active: bool,
    state: AttemptState,
    until: tuple[_dt.datetime, int],
    now: tuple[_dt.datetime, int],
    cancel: _dt.datetime | None,
) -> tuple[Any, ...]:
    lease_until = until[0]
    if active:
        _checked("state", _rules.active_lease_state, True, state in RUNNABLE)
        lease_until = _window(now, until, _rules.MAX_LEASE_WINDOW, "server_time", "lease_until")
    return active, state, lease_until, now[0], cancel


#: A Lease (no local deadline yet).
lease = _decoder(
    Lease,
    [
        ("active", _bool, _REQUIRED),
        ("state", _ATTEMPT_STATE, _REQUIRED),
        ("lease_until", _time, _REQUIRED),
        ("server_time", _time, _REQUIRED),
        ("cancel_requested_at", _instant, None),
    ],
    across=_lease_across,
)

#: The ack body of start/renew/finish.
command_result = _decoder(
    CommandResult,
    [
        ("receipt", receipt, _REQUIRED),
        ("lease", lease, _REQUIRED),
        ("deduplicated", _bool, _REQUIRED),
    ],
)


def _welcome_across(
    session_id: str,
    epoch: int,
    now: tuple[_dt.datetime, int],
    expires: tuple[_dt.datetime, int],
    lease_ms: int,
    draining: bool,
) -> tuple[Any, ...]:
    expires_at = _window(now, expires, _rules.MAX_SESSION_WINDOW, "server_time", "expires_at")
    return session_id, epoch, now[0], expires_at, lease_ms, draining


#: A Welcome (the answer to hello and to capacity).
welcome = _decoder(
    Welcome,
    [
        ("session_id", _id, _REQUIRED),
        ("epoch", _counter, _REQUIRED),
        ("server_time", _time, _REQUIRED),
        ("expires_at", _time, _REQUIRED),
        ("lease_duration_ms", _rules.LEASE_DURATION_MS, _REQUIRED),
        ("draining", _bool, _REQUIRED),
    ],
    across=_welcome_across,
)


def _task_across(*values: Any) -> tuple[Any, ...]:
    _checked("attempt", _rules.attempts, values[9], values[10])
    return values


#: A Task as an assignment describes it.
task = _decoder(
    Task,
    [
        ("task_id", _id, _REQUIRED),
        ("queue_id", _id, _REQUIRED),
        ("namespace_id", _id, _REQUIRED),
        ("handler", _rules.handler, _REQUIRED),
        ("handler_version", _version, _REQUIRED),
        ("payload_version", _version, _REQUIRED),
        ("payload", _rules.json_value, _REQUIRED),
        ("state", _TASK_STATE, _REQUIRED),
        ("revision", _counter, _REQUIRED),
        ("attempt", _counter, _REQUIRED),
        ("max_attempts", _counter, _REQUIRED),
    ],
    across=_task_across,
)

#: A ``task.assign`` body.
assignment = _decoder(
    Assignment,
    [
        ("task", task, _REQUIRED),
        ("attempt_id", _id, _REQUIRED),
        ("epoch", _counter, _REQUIRED),
        ("lease_secret", _secret, _REQUIRED),
        ("lease_until", _instant, _REQUIRED),
        ("server_time", _instant, _REQUIRED),
    ],
)

#: A ``task.cancel`` body.
cancel_notice = _decoder(
    CancelNotice,
    [
        ("task_id", _id, _REQUIRED),
        ("attempt_id", _id, _REQUIRED),
        ("epoch", _counter, _REQUIRED),
        ("cancel_requested_at", _instant, _REQUIRED),
    ],
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
# What the server accepts (the mock server's side): the same rules, and no field beyond the
# model's (a client is held to the closed schema, PROTOCOL §12).

#: One registered capability.
capability = _decoder(
    Capability,
    [
        ("handler", _rules.handler, _REQUIRED),
        ("handler_version", _version, _REQUIRED),
        ("payload_version", _version, _REQUIRED),
    ],
    closed=True,
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


_WIRE_OF[_capabilities] = lambda listed: [WIRE_FORMS[Capability](c) for c in listed]

#: A ``worker.hello`` body.
registration = _decoder(
    Registration,
    [
        ("queue_id", _id, _REQUIRED),
        ("capabilities", _capabilities, _REQUIRED),
        ("capacity", _rules.CAPACITY, _REQUIRED),
        ("instance_id", _id, _REQUIRED),
        ("instance_secret", _secret, _REQUIRED),
        ("cancellation_notifications", _bool, False),
    ],
    closed=True,
)

#: A ``worker.capacity`` body.
capacity_report = _decoder(
    CapacityReport,
    [
        ("sequence", _counter, _REQUIRED),
        ("capacity", _rules.REPORTED_CAPACITY, _REQUIRED),
        ("drain", _bool, _REQUIRED),
    ],
    closed=True,
)

#: The body of ``worker.resume``, ``task.start`` and ``task.renew``.
attempt_ref = _decoder(
    AttemptRef,
    [
        ("task_id", _id, _REQUIRED),
        ("attempt_id", _id, _REQUIRED),
        ("epoch", _counter, _REQUIRED),
        ("lease_secret", _secret, _REQUIRED),
    ],
    closed=True,
)


def _finish_across(
    ref: AttemptRef, outcome: Outcome, result: Any, code: str | None, retryable: bool | None
) -> tuple[Any, ...]:
    _checked(
        "outcome",
        _rules.finish_outcome,
        outcome is Outcome.SUCCEEDED,
        outcome.value,
        outcome is Outcome.FAILED,
        code,
        retryable,
    )
    return ref, outcome, result, code, retryable


#: A ``task.finish`` body (its result's size is the codec's to check). An error_code that is
#: present is a code: null too (absent is the only "none", PROTOCOL §12).
finish = _decoder(
    Finish,
    [
        ("ref", attempt_ref, _REQUIRED),
        ("outcome", _OUTCOME, _REQUIRED),
        ("result", _rules.json_value, _REQUIRED),
        ("error_code", _rules.code, None),
        ("retryable", _bool, None),
    ],
    closed=True,
    across=_finish_across,
)

#: The decoder of each client → server body model.
CLIENT_DECODERS: dict[type[Any], Callable[[Any], Any]] = {
    Registration: registration,
    CapacityReport: capacity_report,
    AttemptRef: attempt_ref,
    Finish: finish,
}
