"""Wire bodies of ``pulse.worker.v1``: one ``cattrs`` converter for every body, both ways.

The attrs models of :mod:`orbit_sync.models` are the schema. The converter adds only how a value
travels where that differs from Python: counters (fields marked ``COUNTER``) as canonical
decimal strings, times as RFC 3339 ``Z`` strings, enums as their values, optional fields
(``OPTIONAL``) left out when they hold their default, local fields (``LOCAL``) never sent. Every
body is structured and unstructured by functions cattrs generates for it once, at import
(``make_dict_structure_fn`` / ``make_dict_unstructure_fn``); the hooks for plain strings, bools
and ints pass the value through, so each value rule is applied once, by the model's own
validators when cattrs calls its constructor.

Server bodies tolerate unknown fields (a newer server may add some); client bodies, structured on
the mock server's side, are held to the closed schema (PROTOCOL §12: ``forbid_extra_keys``).

A body that breaks a rule raises :class:`Fault`, naming the field's path and the rule's reason,
never the value (it may be a secret). The fast functions carry no bookkeeping for that; a refused
body is structured again by the same converter's detailed functions (cattrs' detailed
validation), which say where it failed.
"""

from __future__ import annotations

import datetime as _dt
import functools
import operator
import re
import sys
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.fns import identity
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from . import _rules
from .models import (
    COUNTER,
    LOCAL,
    OPTIONAL,
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

    def __init__(self, path: str, reason: str, *, across: bool = False) -> None:
        super().__init__(path, reason)
        self.path = path
        self.reason = reason
        #: A rule across fields (``an active lease must be LEASED or RUNNING``), named by none.
        self.across = across

    def describe(self, what: str) -> str:
        """``path reason`` (``lease.active must be a bool``), ``what reason`` for the body
        itself (``CommandResult is missing lease``), ``path: reason`` for a rule across the
        fields of a nested body."""
        if self.across:
            return f"{self.path}: {self.reason}" if self.path else self.reason
        return f"{self.path or what} {self.reason}"


# --------------------------------------------------------------------------- times

_UTC = _dt.timezone.utc
_US = _dt.timedelta(microseconds=1)
_NS = 1_000_000_000

_time_match = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?Z"
).fullmatch


def parse_time_ns(value: str) -> tuple[_dt.datetime, int]:
    """A wire time as an aware UTC datetime (microseconds) and the nanoseconds below it.

    The caller has checked ``type(value) is str``. Raises ValueError unless the text is RFC 3339
    in UTC with ``Z`` and at most 9 fraction digits, and a real date and time.
    """
    if _time_match(value) is None:
        raise ValueError("must be RFC 3339 UTC with Z, e.g. 2026-09-17T08:00:30Z")
    if len(value) <= _MICROSECOND_TEXT:
        return _datetime_of(value), 0
    # The pattern fixed every position: digits 7 to 9 of the fraction lie before the 'Z'.
    return _datetime_of(value), int(value[26:-1].ljust(3, "0"))


#: The longest wire time with no digit below the microsecond.
_MICROSECOND_TEXT = 27

if sys.version_info >= (3, 11):

    def _datetime_of(value: str) -> _dt.datetime:
        # The pattern fixed the form. Since 3.11, fromisoformat (C) reads it as it is: 'Z' as
        # UTC (the timezone.utc singleton), a fraction of any length cut to the microsecond.
        try:
            return _dt.datetime.fromisoformat(value)
        except ValueError:
            raise ValueError("is not a real date and time") from None

else:  # 3.10's fromisoformat reads neither 'Z' nor a fraction of other than 3 or 6 digits

    def _datetime_of(value: str) -> _dt.datetime:
        whole = _whole_second(value[:19])
        if len(value) == 20:
            return whole
        # The fraction lies between the '.' and the 'Z'; its first 6 digits are microseconds.
        return whole.replace(microsecond=int(value[20:-1][:6].ljust(6, "0")))

    @functools.lru_cache(maxsize=256)
    def _whole_second(text: str) -> _dt.datetime:
        # Times of one session share their seconds, so the calendar is checked once per second.
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


def parse_time(value: Any, _: Any = None) -> _dt.datetime:
    """A wire time (RFC 3339 UTC with ``Z``) as an aware UTC datetime, kept to the microsecond.

    Also the converter's hook for times (cattrs passes the field's type second, ignored here).
    """
    if type(value) is not str:
        raise TypeError("must be an RFC 3339 string")
    return parse_time_ns(value)[0]


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


def _exact_window(
    structure: Callable[[Any, Any], T], start: str, end: str, limit_s: int, active_only: bool
) -> Callable[[Any, Any], T]:
    """*structure* for a body whose window ``end - start`` the model checks, with the window
    judged on the wire's nanoseconds.

    The model holds microseconds: a time written with 7 to 9 fraction digits could make a window
    of 120 s + 1 ns pass and one of 1 ns read as zero. For such a body the verdict is taken on
    the nanoseconds and handed to the model's own rule: a refused window's end is moved onto its
    start (the model refuses it, with its reason), and an accepted one under a microsecond has its
    end moved one microsecond after its start (the model's times keep it positive).
    """

    def structure_exactly(o: Any, cls: Any) -> T:
        if type(o) is dict and (not active_only or o.get("active") is True):
            first, last = o.get(start), o.get(end)
            if (
                type(first) is str
                and type(last) is str
                and (len(first) > _MICROSECOND_TEXT or len(last) > _MICROSECOND_TEXT)
            ):
                o = _judged(o, first, last, end, limit_s)
        return structure(o, cls)

    return structure_exactly


def _judged(o: dict[str, Any], first: str, last: str, end: str, limit_s: int) -> dict[str, Any]:
    """Body *o* with its window's end (*last*, after *first*) moved where the model's rule, on
    microseconds, gives the verdict of the nanoseconds (see :func:`_exact_window`)."""
    try:
        begins, ends = parse_time_ns(first), parse_time_ns(last)
    except ValueError:
        return o  # the field's own hook refuses it
    delta_us = _rules.timedelta_ns(ends[0] - begins[0])
    delta_ns = delta_us + ends[1] - begins[1]
    if not 0 < delta_ns <= limit_s * _NS:
        return {**o, end: first}
    if delta_us <= 0:
        return {**o, end: format_time(begins[0] + _US)}
    return o


# --------------------------------------------------------------------------- the converter


def _as_is(value: Any, _: Any) -> Any:
    # A string, bool or int is checked by the model's validator, not converted: "1" is no int.
    return value


def _text(value: Any, _: Any) -> str:
    # Text where the model's own converter takes a Python convenience (a version given as 1)
    # that the wire does not.
    if type(value) is not str:
        raise TypeError("must be a string")
    return value


#: An enum member's value on the wire: ``_value_`` (the attribute Enum documents) read in C,
#: where ``.value`` is a Python-level property called on every frame that carries an enum.
_unstructure_enum: Callable[[Any], Any] = operator.attrgetter("_value_")


#: How a value of each field type travels: its structure and unstructure hooks.
_TYPES: dict[Any, tuple[Callable[[Any, Any], Any], Callable[[Any], Any]]] = {
    str: (_as_is, identity),
    bool: (_as_is, identity),
    int: (_as_is, identity),
    _dt.datetime: (parse_time, format_time),
    **{
        enum: (_rules.member_of(enum), _unstructure_enum)
        for enum in (TaskState, AttemptState, Outcome, Disposition, Operation)
    },
}

#: The converter of every wire body (configured here, once).
converter = cattrs.Converter()
for _type, (_structure, _unstructure) in _TYPES.items():
    converter.register_structure_hook(_type, _structure)
    converter.register_unstructure_hook(_type, _unstructure)


def _present(structure: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """An optional field's hook: when present, a value (absent is the only "none", §12)."""

    def structure_present(value: Any, cls: Any) -> Any:
        if value is None:
            raise TypeError("must not be null (leave it out)")
        return structure(value, cls)

    return structure_present


def _sequence(cls: type[T], detailed: bool) -> Callable[[Any, Any], tuple[T, ...]]:
    """The hook of a tuple of bodies *cls*: a list on the wire (a string or an object would
    iterate); the model checks its length and duplicates. The detailed hook notes each entry's
    index on its fault, as cattrs' own sequence hooks do."""
    structure = _DETAILED[cls] if detailed else _STRUCTURE[cls]

    def structure_sequence(value: Any, _: Any) -> tuple[T, ...]:
        if type(value) is not list:
            raise TypeError("must be a list")
        if not detailed:
            return tuple([structure(item, cls) for item in value])
        items = []
        for index, item in enumerate(value):
            try:
                items.append(structure(item, cls))
            except Exception as exc:
                note = IterableValidationNote(f"Structuring item {index}", index, cls)
                exc.__notes__ = [*getattr(exc, "__notes__", []), note]
                raise IterableValidationError("While structuring a list", [exc], tuple) from None
        return tuple(items)

    return structure_sequence


def _unstructure_sequence(cls: type[Any]) -> Callable[[tuple[Any, ...]], list[dict[str, Any]]]:
    unstructure = _UNSTRUCTURE[cls]

    def unstructure_sequence(value: tuple[Any, ...]) -> list[dict[str, Any]]:
        return [unstructure(item) for item in value]

    return unstructure_sequence


def _overrides(cls: type[Any], detailed: bool) -> dict[str, Any]:
    """The per-field overrides of body *cls*, from its fields' wire metadata and, for a nested
    body, the functions already generated for it."""
    overrides: dict[str, Any] = {}
    for field in attrs.fields(cls):
        wire = field.metadata.get("wire")
        kind = field.type
        if wire == LOCAL["wire"]:
            overrides[field.name] = override(omit=True)
        elif wire == COUNTER["wire"]:
            # Out as str(): an int's canonical decimal text.
            overrides[field.name] = override(struct_hook=_rules.wire_decimal, unstruct_hook=str)
        elif wire == OPTIONAL["wire"]:
            # The type beside None (error_code: str | None), or the type (a defaulted bool).
            present = [arg for arg in typing.get_args(kind) if arg is not type(None)] or [kind]
            structure, unstructure = _TYPES[present[0]]
            overrides[field.name] = override(
                omit_if_default=True, struct_hook=_present(structure), unstruct_hook=unstructure
            )
        elif kind is Any:  # a payload or a result: JSON as it is, both ways
            overrides[field.name] = override(struct_hook=_as_is, unstruct_hook=identity)
        elif kind is str and field.converter is not None:
            overrides[field.name] = override(struct_hook=_text)
        elif typing.get_origin(kind) is tuple:  # tuple[Body, ...]
            item = typing.get_args(kind)[0]
            overrides[field.name] = override(
                struct_hook=_sequence(item, detailed), unstruct_hook=_unstructure_sequence(item)
            )
        elif detailed and attrs.has(kind):
            overrides[field.name] = override(struct_hook=_DETAILED[kind])
    return overrides


_STRUCTURE: dict[type[Any], Callable[[Any, Any], Any]] = {}
_DETAILED: dict[type[Any], Callable[[Any, Any], Any]] = {}
_UNSTRUCTURE: dict[type[Any], Callable[[Any], dict[str, Any]]] = {}


def _declare(cls: type[Any], *, closed: bool = False) -> None:
    """Generate the functions of body *cls* (nested bodies are declared first).

    *closed*: a client's body, no field beyond the model's (PROTOCOL §12).
    """
    attrs.resolve_types(cls)  # the models' annotations are strings until resolved
    fast: Callable[[Any, Any], Any]
    detailed: Callable[[Any, Any], Any]
    fast, detailed = (
        make_dict_structure_fn(
            cls,
            converter,
            _cattrs_forbid_extra_keys=closed,
            _cattrs_detailed_validation=explain,
            **_overrides(cls, explain),
        )
        for explain in (False, True)
    )
    # Fields the model defaults but the wire requires (a registration's instance, a report's
    # drain): cattrs would take the default for a missing one.
    required = frozenset(
        f.name
        for f in attrs.fields(cls)
        if f.default is not attrs.NOTHING and not f.metadata.get("wire")
    )
    if required:
        fast, detailed = _requiring(fast, required), _requiring(detailed, required)
    window = _WINDOWS.get(cls)
    if window is not None:
        fast, detailed = _exact_window(fast, *window), _exact_window(detailed, *window)
    _STRUCTURE[cls] = fast
    _DETAILED[cls] = _object(detailed)
    converter.register_structure_hook(cls, fast)
    unstructure = make_dict_unstructure_fn(cls, converter, **_overrides(cls, False))
    _UNSTRUCTURE[cls] = unstructure
    converter.register_unstructure_hook(cls, unstructure)


#: The bodies holding a window ``end - start``: (start, end, limit in seconds, active only).
_WINDOWS: dict[type[Any], tuple[str, str, int, bool]] = {
    Lease: ("server_time", "lease_until", _rules.MAX_LEASE_WINDOW, True),
    Welcome: ("server_time", "expires_at", _rules.MAX_SESSION_WINDOW, False),
}


def _requiring(
    structure: Callable[[Any, Any], T], required: frozenset[str]
) -> Callable[[Any, Any], T]:
    """*structure*, refusing a body that lacks one of *required*."""

    def structure_required(o: Any, cls: Any) -> T:
        if type(o) is dict and not required.issubset(o):
            raise KeyError(min(name for name in required if name not in o))
        return structure(o, cls)

    return structure_required


class _NotAnObject(TypeError):
    """A body that is not a JSON object: the fault of the body itself, not of a field."""


def _object(structure: Callable[[Any, Any], T]) -> Callable[[Any, Any], T]:
    """*structure*, refusing anything but a JSON object first (so the fault is the body's)."""

    def structure_object(o: Any, cls: Any) -> T:
        if type(o) is not dict:
            raise _NotAnObject("must be a JSON object")
        return structure(o, cls)

    return structure_object


#: The server → client bodies (open), nested ones first.
SERVER_BODIES: tuple[type[Any], ...] = (
    Receipt,
    Lease,
    CommandResult,
    Welcome,
    Task,
    Assignment,
    CancelNotice,
)
#: The client → server bodies (closed); a capability travels in a registration.
CLIENT_BODIES: tuple[type[Any], ...] = (Registration, CapacityReport, AttemptRef, Finish)

_CLOSED: tuple[type[Any], ...] = (Capability, *CLIENT_BODIES)
for _body in SERVER_BODIES:
    _declare(_body)
for _body in _CLOSED:
    _declare(_body, closed=True)


# --------------------------------------------------------------------------- the API


def structure(value: Any, cls: type[T]) -> T:
    """*value* (a JSON body) as model *cls*, or :class:`Fault` naming the field and the rule."""
    structure_body = _STRUCTURE[cls]  # a KeyError here is a caller's mistake, not a fault
    try:
        structured: T = structure_body(value, cls)
    except Exception:
        raise _explained(value, cls) from None
    return structured


def unstructure(model: Any) -> dict[str, Any]:
    """The wire form of a model (counters as strings, times as RFC 3339, optionals omitted)."""
    unstructure_model = _UNSTRUCTURE.get(type(model))
    if unstructure_model is None:
        for cls in type(model).__mro__:  # a subclass of a model travels as the model
            unstructure_model = _UNSTRUCTURE.get(cls)
            if unstructure_model is not None:
                break
        else:
            raise TypeError(f"{type(model).__name__} is not a wire model")
    return unstructure_model(model)


def _explained(value: Any, cls: type[Any]) -> Fault:
    """The fault of a body the fast function refused, by the detailed one: the first field (in
    the model's order) whose hook refused it, else the model's own rule."""
    try:
        _DETAILED[cls](value, cls)
    except Exception as exc:
        return _located(exc, "", cls)
    return Fault("", "is not valid")  # both passes apply the same hooks: not reached


def _located(exc: BaseException, path: str, cls: type[Any]) -> Fault:
    """The fault *exc* (raised by a detailed function of *cls*) stands for: down the first
    error of each level, the path its notes give (a field's name, a list entry's index)."""
    noted = False
    while isinstance(exc, BaseValidationError):
        if isinstance(exc, cattrs.ClassValidationError):
            cls = exc.cl
        inner = exc.exceptions[0]
        noted = False
        for note in getattr(inner, "__notes__", ()):
            if isinstance(note, AttributeValidationNote):
                path, noted = _join(path, note.name), True
            elif isinstance(note, IterableValidationNote):
                path, noted = _join(path, str(note.index)), True
        exc = inner
    if isinstance(exc, ForbiddenExtraKeysError):
        # The unknown names are the sender's text: not repeated.
        return Fault(path, "has a field the schema does not define")
    if isinstance(exc, KeyError):
        return Fault(path if noted else _join(path, str(exc.args[0])), "is missing")
    reason = str(exc) if isinstance(exc, TypeError | ValueError) else "is not valid"
    if noted or isinstance(exc, _NotAnObject):
        return Fault(path, reason)
    # The model's constructor refused it: a validator's reason starts with its field's name.
    name, _, rest = reason.partition(" ")
    if rest and name in attrs.fields_dict(cls):
        return Fault(_join(path, name), rest)
    return Fault(path, reason, across=True)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
