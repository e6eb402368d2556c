"""The value rules of ``pulse.worker.v1`` bodies, each written once (PROTOCOL §4, §12).

The models' validators apply them, to what a user builds (checked before anything is sent) and
to what a peer sends (the wire converter of :mod:`orbit_sync._bodies` builds every body through
its model's constructor); the converter adds only the wire's forms (:func:`wire_decimal`,
:func:`member_of`). A rule takes a value, returns what to keep and raises ``TypeError`` (wrong
kind) or ``ValueError`` (wrong value) with a reason that never repeats the value (it may be a
secret). The caller puts the field's name or path in front of the reason.
"""

from __future__ import annotations

import datetime as _dt
import enum
import re
from collections.abc import Callable
from typing import Any, TypeVar

ID_RE = re.compile(r"[0-9a-f]{32}")
# 32 bytes in base64url without padding: 43 characters, the last one carrying 4 data bits.
SECRET_RE = re.compile(r"[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]")
HANDLER_RE = re.compile(r"[a-z][a-z0-9._-]{0,63}")
CODE_RE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
DECIMAL_RE = re.compile(r"0|[1-9][0-9]*")

MAX_CAPACITY = 256
MAX_CAPABILITIES = 32
#: An active lease's window, ``lease_until - server_time``, is in (0, 120 s] (§6.6).
MAX_LEASE_WINDOW = 120
#: A session's window, ``expires_at - server_time``, is in (0, 300 s] (§5.2).
MAX_SESSION_WINDOW = 300

_NS = 1_000_000_000
_decimal_match = DECIMAL_RE.fullmatch


def _matching(pattern: re.Pattern[str], reason: str) -> Callable[[Any], str]:
    """A string matching *pattern* in full."""
    match = pattern.fullmatch

    def check(value: Any) -> str:
        if type(value) is not str or match(value) is None:
            raise ValueError(reason)
        return value

    return check


#: A 32-hex id.
id_ = _matching(ID_RE, "must be 32 lowercase hex characters")
#: An instance or lease secret.
secret = _matching(SECRET_RE, "must be 32 bytes in unpadded base64url (43 characters)")
#: A handler name.
handler = _matching(HANDLER_RE, "must be 1-64 characters of [a-z][a-z0-9._-]*")
#: An error code.
code = _matching(CODE_RE, "must be 1-64 characters of [A-Z][A-Z0-9_]*")


def version(value: Any) -> str:
    """A handler or payload version: a canonical decimal string >= 1, kept as text."""
    if type(value) is not str or _decimal_match(value) is None or value == "0":
        raise ValueError("must be a canonical decimal string >= 1, e.g. '1'")
    return value


def counter(value: Any) -> int:
    """A counter (epoch, sequence, revision, attempt) as Python holds it: an int >= 1."""
    if type(value) is not int:
        raise TypeError("must be an int")
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def wire_decimal(value: Any, _: Any = None) -> int:
    """An int as a counter travels: a canonical decimal string (``"7"``, never ``"07"`` or
    ``7``). The counter's own rule (:func:`counter`) is the model's to apply. Also the wire
    converter's structure hook for counters, as it is (the second argument is cattrs')."""
    if type(value) is not str:
        raise TypeError("must be a decimal string")
    if _decimal_match(value) is None:
        raise ValueError("must be a canonical decimal string")
    return int(value)


def wire_counter(value: Any) -> int:
    """A counter as it travels (:func:`wire_decimal`), and a counter."""
    return counter(wire_decimal(value))


def boolean(value: Any) -> bool:
    """A JSON/Python bool, never 0 or 1."""
    if type(value) is not bool:
        raise TypeError("must be a bool")
    return value


def json_value(value: Any) -> Any:
    """A payload or result: any JSON other than null."""
    if value is None:
        raise ValueError("must be JSON other than null")
    return value


def int_range(low: int, high: int) -> Callable[[Any], int]:
    """An int (never a bool) in [low, high]."""

    def check(value: Any) -> int:
        if type(value) is not int:
            raise TypeError("must be an int")
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}")
        return value

    return check


#: Capacity of a registration, and of a capacity report (which may be 0 to pause).
CAPACITY = int_range(1, MAX_CAPACITY)
REPORTED_CAPACITY = int_range(0, MAX_CAPACITY)
#: The lease duration a welcome announces (§5.2).
LEASE_DURATION_MS = int_range(1_000, 120_000)

E = TypeVar("E", bound=enum.Enum)


def member_of(cls: type[E]) -> Callable[..., E]:
    """The member of *cls* whose value is the given string (a table lookup, no Enum call).

    The rule is also the wire converter's structure hook for *cls* as it is: cattrs passes the
    field's type second, ignored here (a wrapper would cost a call per field on every frame).
    """
    table = {m.value: m for m in cls}
    reason = f"must be one of {', '.join(table)}"

    def check(value: Any, _: Any = None) -> E:
        member = table.get(value) if type(value) is str else None
        if member is None:
            raise ValueError(reason)
        return member

    return check


def timedelta_ns(delta: _dt.timedelta) -> int:
    """A timedelta in whole nanoseconds (exact: no float on the way)."""
    return ((delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds) * 1000


def window(delta_ns: int, limit_s: int, start: str, end: str) -> None:
    """``end - start`` (nanoseconds, as the wire spells it) must be in (0, limit_s]."""
    if not 0 < delta_ns <= limit_s * _NS:
        raise ValueError(f"{end} must be after {start}, by at most {limit_s} s")


def active_lease_state(active: bool, runnable: bool) -> None:
    """An active lease is LEASED or RUNNING (§6.6)."""
    if active and not runnable:
        raise ValueError("an active lease must be LEASED or RUNNING")


def attempts(attempt: int, max_attempts: int) -> None:
    """An attempt number never exceeds the task's max_attempts."""
    if attempt > max_attempts:
        raise ValueError("attempt must not exceed max_attempts")


def capabilities_count(count: int) -> None:
    """A registration lists 1 to 32 capabilities."""
    if not 1 <= count <= MAX_CAPABILITIES:
        raise ValueError(f"must hold 1 to {MAX_CAPABILITIES} entries")


def distinct(items: tuple[Any, ...]) -> None:
    """No capability is listed twice."""
    if len(set(items)) != len(items):
        raise ValueError("must be distinct")


def finish_outcome(
    succeeded: bool, outcome: str, failed: bool, error_code: Any, retryable: Any
) -> None:
    """A SUCCEEDED finish has no error_code, any other outcome needs one; only FAILED may be
    retryable (§6.4)."""
    if succeeded:
        if error_code is not None:
            raise ValueError("a SUCCEEDED finish carries no error_code")
    elif error_code is None:
        raise ValueError(f"a {outcome} finish needs an error_code")
    if retryable is True and not failed:
        raise ValueError("retryable=True is only valid with FAILED")
