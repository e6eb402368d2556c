"""Wire models of ``pulse.worker.v1`` (PROTOCOL §4): frozen, slotted attrs classes and enums.

Python-side types are the natural ones: counters (``epoch``, ``sequence``, ``revision``,
``task_revision``, ``attempt``, ``max_attempts``) are ``int`` and travel as canonical decimal
strings; times are aware UTC ``datetime`` and travel as RFC 3339 ``Z`` strings. Validators run on
construction, so a wrong argument raises ``ValueError``/``TypeError`` before anything is sent.
Secrets (``instance_secret``, ``lease_secret``) never appear in ``repr()``/``str()``.

No I/O here. Each field's metadata says how it travels where that is not its type's usual
form (a counter as decimal text, a field the wire may leave out, a field that never travels);
the wire converter reads it.
"""

from __future__ import annotations

import base64
import datetime as _dt
import enum
import os
import random
import secrets
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs

from . import _rules
from .clock import Clock, now_reader

__all__ = [
    "Assignment",
    "AttemptRef",
    "AttemptState",
    "CancelNotice",
    "Capability",
    "CapacityReport",
    "CommandResult",
    "Disposition",
    "Finish",
    "Lease",
    "Operation",
    "Outcome",
    "Receipt",
    "Registration",
    "Task",
    "TaskState",
    "Welcome",
    "new_id",
    "new_message_id",
    "new_secret",
]

# --------------------------------------------------------------------------- enumerations


class TaskState(str, enum.Enum):
    """State of a task (PROTOCOL §4)."""

    WAITING = "WAITING"
    LEASED = "LEASED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    NEEDS_REVIEW = "NEEDS_REVIEW"

    def __str__(self) -> str:
        return self.value


class AttemptState(str, enum.Enum):
    """State of one attempt (PROTOCOL §4)."""

    LEASED = "LEASED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"
    EXPIRED = "EXPIRED"
    CANCELLED = "CANCELLED"

    def __str__(self) -> str:
        return self.value


class Outcome(str, enum.Enum):
    """Outcome a worker reports with ``task.finish``."""

    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"
    CANCELLED = "CANCELLED"

    def __str__(self) -> str:
        return self.value


class Disposition(str, enum.Enum):
    """Whether a command changed the task (``APPLIED``) or was kept as evidence only."""

    APPLIED = "APPLIED"
    EVIDENCE_ONLY = "EVIDENCE_ONLY"

    def __str__(self) -> str:
        return self.value


class Operation(str, enum.Enum):
    """The command a receipt records."""

    START = "start"
    RENEW = "renew"
    FINISH = "finish"

    def __str__(self) -> str:
        return self.value


# --------------------------------------------------------------------------- value rules

# The rules live in _rules (the wire converter builds bodies through these models); their names
# stay importable here.
ID_RE = _rules.ID_RE
SECRET_RE = _rules.SECRET_RE
HANDLER_RE = _rules.HANDLER_RE
CODE_RE = _rules.CODE_RE
DECIMAL_RE = _rules.DECIMAL_RE
MAX_CAPACITY = _rules.MAX_CAPACITY
MAX_CAPABILITIES = _rules.MAX_CAPABILITIES
MAX_LEASE_WINDOW = _rules.MAX_LEASE_WINDOW
MAX_SESSION_WINDOW = _rules.MAX_SESSION_WINDOW


def new_id() -> str:
    """A fresh 32-hex id (128 random bits)."""
    return secrets.token_hex(16)


# A message_id must be unique, not secret (it travels next to the session's real credentials):
# a generator seeded from the OS, reseeded in every forked child, takes no system call per id.
_MESSAGE_IDS = random.Random(os.urandom(32))


def _reseed_message_ids() -> None:
    _MESSAGE_IDS.seed(os.urandom(32))


if hasattr(os, "register_at_fork"):  # POSIX: a forked child must not repeat its parent's ids
    os.register_at_fork(after_in_child=_reseed_message_ids)


def new_message_id() -> str:
    """A fresh ``message_id``: name one operation, keep it when re-sending that operation."""
    return f"{_MESSAGE_IDS.getrandbits(128):032x}"


def new_secret() -> str:
    """A fresh secret: 32 random bytes, base64url without padding (43 characters)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode("ascii")


#: Field metadata for the wire converter: an ``int`` counter that travels as canonical decimal
#: text; a field the wire may leave out (its default then; ``null`` is not leaving it out); a
#: field that never travels.
COUNTER: dict[str, str] = {"wire": "counter"}
OPTIONAL: dict[str, str] = {"wire": "optional"}
LOCAL: dict[str, str] = {"wire": "local"}


def _redact(_: object) -> str:
    return "'<redacted>'"


def _field(rule: Callable[[Any], Any]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    """An attrs validator applying *rule*, its reason prefixed with the field's name."""

    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        try:
            rule(value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{attribute.name} {exc}") from None

    return check


_check_id = _field(_rules.id_)
_check_secret = _field(_rules.secret)  # the reason never echoes the value: it is a secret
_check_counter = _field(_rules.counter)
_check_bool = _field(_rules.boolean)
_check_handler = _field(_rules.handler)
_check_version = _field(_rules.version)
_check_code = _field(_rules.code)
_check_payload = _field(_rules.json_value)


def _check_optional_bool(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and type(value) is not bool:
        raise TypeError(f"{attribute.name} must be a bool or None")


_ZERO = _dt.timedelta(0)
_UTC = _dt.timezone.utc


def _check_time(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is _dt.datetime and value.tzinfo is _UTC:
        return  # what the wire converter builds: no offset to compute
    if not isinstance(value, _dt.datetime) or value.utcoffset() != _ZERO:
        raise ValueError(f"{attribute.name} must be an aware UTC datetime")


def _check_optional_time(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _check_time(_, attribute, value)


def _version(value: Any) -> Any:
    # Convenience for Python callers: Capability("resize", 1, 1). Bools are not versions.
    if type(value) is int and value >= 1:
        return str(value)
    return value


E = TypeVar("E", bound=enum.Enum)


def _enum_converter(cls: type[E]) -> Callable[[Any], E]:
    """Members pass; a string is looked up by the same rule the wire converter uses."""
    member = _rules.member_of(cls)
    name = cls.__name__

    def convert(value: Any) -> E:
        if isinstance(value, cls):
            return value
        if type(value) is not str:
            raise TypeError(f"expected a {name}")
        try:
            return member(value)
        except ValueError as exc:
            raise ValueError(f"unknown {name}: {exc}") from None

    return convert


# Named converters (one per enum) so attrs' mypy plugin can type the constructors; a member
# (what the wire converter hands over) passes without a second call.
_task_state_value = _enum_converter(TaskState)
_attempt_state_value = _enum_converter(AttemptState)
_outcome_value = _enum_converter(Outcome)
_disposition_value = _enum_converter(Disposition)
_operation_value = _enum_converter(Operation)


def _task_state(value: Any) -> TaskState:
    return value if type(value) is TaskState else _task_state_value(value)


def _attempt_state(value: Any) -> AttemptState:
    return value if type(value) is AttemptState else _attempt_state_value(value)


def _outcome(value: Any) -> Outcome:
    return value if type(value) is Outcome else _outcome_value(value)


def _disposition(value: Any) -> Disposition:
    return value if type(value) is Disposition else _disposition_value(value)


def _operation(value: Any) -> Operation:
    return value if type(value) is Operation else _operation_value(value)


# --------------------------------------------------------------------------- models


@attrs.frozen
class Capability:
    """One (handler, handler_version, payload_version) the worker can run."""

    handler: str = attrs.field(validator=_check_handler)
    handler_version: str = attrs.field(converter=_version, validator=_check_version)
    payload_version: str = attrs.field(converter=_version, validator=_check_version)


def _capabilities(value: Iterable[Capability]) -> tuple[Capability, ...]:
    if isinstance(value, str | bytes | dict):
        raise TypeError("capabilities must be a sequence of Capability")
    return tuple(value)


def _check_capabilities(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    for cap in value:
        if not isinstance(cap, Capability):
            raise TypeError("capabilities must contain Capability objects")
    try:
        _rules.capabilities_count(len(value))
        _rules.distinct(value)
    except ValueError as exc:
        raise ValueError(f"capabilities {exc}") from None


_PROCESS_INSTANCE: dict[str, str] = {}


def process_instance_id() -> str:
    """The ``instance_id`` of this process: new for every process start."""
    return _PROCESS_INSTANCE.setdefault("id", new_id())


def process_instance_secret() -> str:
    """The ``instance_secret`` of this process, kept across reconnects."""
    return _PROCESS_INSTANCE.setdefault("secret", new_secret())


@attrs.frozen
class Registration:
    """The ``worker.hello`` body: who this worker is and what it can run.

    ``instance_id``/``instance_secret`` default to per-process values, so every connection of one
    process (reconnects included) presents the same instance and the server can fence older
    sessions.
    """

    queue_id: str = attrs.field(validator=_check_id)
    capabilities: tuple[Capability, ...] = attrs.field(
        converter=_capabilities, validator=_check_capabilities
    )
    capacity: int = attrs.field(validator=_field(_rules.CAPACITY))
    instance_id: str = attrs.field(factory=process_instance_id, validator=_check_id)
    instance_secret: str = attrs.field(
        factory=process_instance_secret, validator=_check_secret, repr=_redact
    )
    cancellation_notifications: bool = attrs.field(
        default=False, validator=_check_bool, metadata=OPTIONAL
    )

    def allows(self, handler: str, handler_version: str, payload_version: str) -> bool:
        """True when (handler, versions) is one of the registered capabilities."""
        return any(
            c.handler == handler
            and c.handler_version == handler_version
            and c.payload_version == payload_version
            for c in self.capabilities
        )


@attrs.frozen
class CapacityReport:
    """The ``worker.capacity`` body: an absolute capacity under a strictly increasing sequence."""

    sequence: int = attrs.field(validator=_check_counter, metadata=COUNTER)
    capacity: int = attrs.field(validator=_field(_rules.REPORTED_CAPACITY))
    drain: bool = attrs.field(default=False, validator=_check_bool)


@attrs.frozen
class AttemptRef:
    """Proof of one attempt: the body of ``worker.resume``, ``task.start`` and ``task.renew``."""

    task_id: str = attrs.field(validator=_check_id)
    attempt_id: str = attrs.field(validator=_check_id)
    epoch: int = attrs.field(validator=_check_counter, metadata=COUNTER)
    lease_secret: str = attrs.field(validator=_check_secret, repr=_redact)


@attrs.frozen
class Task:
    """A task as the server describes it in an assignment."""

    task_id: str = attrs.field(validator=_check_id)
    queue_id: str = attrs.field(validator=_check_id)
    namespace_id: str = attrs.field(validator=_check_id)
    handler: str = attrs.field(validator=_check_handler)
    handler_version: str = attrs.field(validator=_check_version)
    payload_version: str = attrs.field(validator=_check_version)
    payload: Any = attrs.field(validator=_check_payload)
    state: TaskState = attrs.field(converter=_task_state)
    revision: int = attrs.field(validator=_check_counter, metadata=COUNTER)
    attempt: int = attrs.field(validator=_check_counter, metadata=COUNTER)
    max_attempts: int = attrs.field(validator=_check_counter, metadata=COUNTER)

    def __attrs_post_init__(self) -> None:
        _rules.attempts(self.attempt, self.max_attempts)


@attrs.frozen
class Assignment:
    """A ``task.assign`` push: a reservation. Only a ``start`` whose lease allows it grants work."""

    task: Task
    attempt_id: str = attrs.field(validator=_check_id)
    epoch: int = attrs.field(validator=_check_counter, metadata=COUNTER)
    lease_secret: str = attrs.field(validator=_check_secret, repr=_redact)
    lease_until: _dt.datetime = attrs.field(validator=_check_time)
    server_time: _dt.datetime = attrs.field(validator=_check_time)

    @property
    def attempt(self) -> AttemptRef:
        """The AttemptRef to pass to ``start``/``renew``/``finish``/``resume``."""
        return AttemptRef(
            task_id=self.task.task_id,
            attempt_id=self.attempt_id,
            epoch=self.epoch,
            lease_secret=self.lease_secret,
        )


#: Subtracted from every local deadline so work stops before the server's lease does (§6.6).
SAFETY_MARGIN = 0.250


#: The states an active lease may be in (§6.6).
RUNNABLE = (AttemptState.LEASED, AttemptState.RUNNING)


@attrs.frozen
class Lease:
    """The server's current authority over an attempt (a LeaseStatus).

    ``deadline`` is local: a reading of the connection's clock (``time.monotonic()`` unless
    ``dial_worker`` was given a :class:`~orbit_sync.Clock`) computed by the connection as
    ``t_sent + (lease_until - server_time) - 250 ms`` (PROTOCOL §6.6), or ``None`` when the lease
    grants nothing. It is never sent or compared with the server's wall clock.
    """

    active: bool = attrs.field(validator=_check_bool)
    state: AttemptState = attrs.field(converter=_attempt_state)
    lease_until: _dt.datetime = attrs.field(validator=_check_time)
    server_time: _dt.datetime = attrs.field(validator=_check_time)
    cancel_requested_at: _dt.datetime | None = attrs.field(
        default=None, validator=_check_optional_time, metadata=OPTIONAL
    )
    deadline: float | None = attrs.field(default=None, eq=False, metadata=LOCAL)

    def __attrs_post_init__(self) -> None:
        if self.active:
            _rules.active_lease_state(True, self.state in RUNNABLE)
            _rules.window(
                _rules.timedelta_ns(self.lease_until - self.server_time),
                MAX_LEASE_WINDOW,
                "server_time",
                "lease_until",
            )

    @property
    def window(self) -> float:
        """Seconds from ``server_time`` to ``lease_until``: the server's own difference."""
        return (self.lease_until - self.server_time).total_seconds()

    @property
    def cancel_requested(self) -> bool:
        """True when the server recorded a cancel request for this attempt."""
        return self.cancel_requested_at is not None

    def with_deadline(self, t_sent: float) -> Lease:
        """This lease with its local deadline anchored at *t_sent* (monotonic, before sending)."""
        return anchor_lease(self, t_sent)

    def may_run(self, clock: Clock | Callable[[], float] | None = None) -> bool:
        """May the handler run (or keep running) now? (PROTOCOL §6.5)

        Active, ``RUNNING``, no cancel request, and the local deadline not passed on *clock* (the
        :class:`~orbit_sync.Clock` the connection was dialled with; real time when left out; a
        plain function still works, with a ``DeprecationWarning``, until the next release). A
        ``LEASED`` active lease is only a reservation.
        """
        return may_run_at(self, now_reader(clock)())

    def remaining(self, clock: Clock | Callable[[], float] | None = None) -> float:
        """Seconds left before the local deadline on *clock* (0 when none or passed)."""
        if self.deadline is None:
            return 0.0
        return max(0.0, self.deadline - now_reader(clock)())


def may_run_at(lease: Lease, now: float) -> bool:
    """:meth:`Lease.may_run` at *now*, a reading of the clock the lease's deadline is on (for
    code that has already read it)."""
    return grants_run(lease) and lease.deadline is not None and now < lease.deadline


def grants_run(lease: Lease) -> bool:
    """The server's half of the "may run" rule (PROTOCOL §6.5): active, ``RUNNING``, no cancel
    request. :meth:`Lease.may_run` adds the local deadline."""
    return (
        lease.active and lease.state is AttemptState.RUNNING and lease.cancel_requested_at is None
    )


def anchor_lease(lease: Lease, t_sent: float) -> Lease:
    """*lease* with its local deadline anchored at *t_sent*: a new Lease (models never change).

    The one place of the deadline rule (PROTOCOL §6.6): ``t_sent + window - 250 ms`` for an active
    lease, ``None`` for one that grants nothing. *t_sent* is taken before the request was sent,
    so the local deadline never outlives the server's lease.
    """
    deadline = t_sent + lease.window - SAFETY_MARGIN if lease.active else None
    # Built anew by its constructor (positionally: attrs.evolve costs half again on every ack).
    return Lease(
        lease.active,
        lease.state,
        lease.lease_until,
        lease.server_time,
        lease.cancel_requested_at,
        deadline,
    )


@attrs.frozen
class Receipt:
    """Immutable record of the original operation (it never revives an inactive lease)."""

    operation: Operation = attrs.field(converter=_operation)
    task_state: TaskState = attrs.field(converter=_task_state)
    attempt_state: AttemptState = attrs.field(converter=_attempt_state)
    task_revision: int = attrs.field(validator=_check_counter, metadata=COUNTER)
    lease_until: _dt.datetime = attrs.field(validator=_check_time)
    disposition: Disposition = attrs.field(converter=_disposition)


@attrs.frozen
class CommandResult:
    """The ``ack`` body of ``task.start``/``renew``/``finish``."""

    receipt: Receipt
    lease: Lease
    deduplicated: bool = attrs.field(validator=_check_bool)

    def with_deadline(self, t_sent: float) -> CommandResult:
        """This result with its lease's local deadline anchored at *t_sent* (see
        :meth:`Lease.with_deadline`)."""
        return CommandResult(self.receipt, anchor_lease(self.lease, t_sent), self.deduplicated)


@attrs.frozen
class Finish:
    """The ``task.finish`` body: an outcome and a JSON result (not null, at most 256 KiB)."""

    ref: AttemptRef
    outcome: Outcome = attrs.field(converter=_outcome)
    result: Any = attrs.field(validator=_check_payload)
    error_code: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_check_code), metadata=OPTIONAL
    )
    retryable: bool | None = attrs.field(
        default=None, validator=_check_optional_bool, metadata=OPTIONAL
    )

    def __attrs_post_init__(self) -> None:
        outcome = self.outcome
        _rules.finish_outcome(
            outcome is Outcome.SUCCEEDED,
            outcome.value,
            outcome is Outcome.FAILED,
            self.error_code,
            self.retryable,
        )


@attrs.frozen
class Welcome:
    """The ``worker.welcome`` body (and the ``ack`` body of ``worker.capacity``)."""

    session_id: str = attrs.field(validator=_check_id)
    epoch: int = attrs.field(validator=_check_counter, metadata=COUNTER)
    server_time: _dt.datetime = attrs.field(validator=_check_time)
    expires_at: _dt.datetime = attrs.field(validator=_check_time)
    lease_duration_ms: int = attrs.field(validator=_field(_rules.LEASE_DURATION_MS))
    draining: bool = attrs.field(validator=_check_bool)

    def __attrs_post_init__(self) -> None:
        _rules.window(
            _rules.timedelta_ns(self.expires_at - self.server_time),
            MAX_SESSION_WINDOW,
            "server_time",
            "expires_at",
        )

    @property
    def session_window(self) -> float:
        """Seconds the session lives without a renewal, by the server's own clock."""
        return (self.expires_at - self.server_time).total_seconds()


@attrs.frozen
class CancelNotice:
    """A ``task.cancel`` push: a cancel was requested for this attempt."""

    task_id: str = attrs.field(validator=_check_id)
    attempt_id: str = attrs.field(validator=_check_id)
    epoch: int = attrs.field(validator=_check_counter, metadata=COUNTER)
    cancel_requested_at: _dt.datetime = attrs.field(validator=_check_time)
