"""The Worker's options, each checked once when built (before anything is sent), defaults filled
in, so every reader of an option reads the value in force."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import cattrs

from .._protocol import MAX_IN_FLIGHT, call_timeout
from .._seconds import seconds
from ..clock import Clock, SystemClock
from ..models import ID_RE, MAX_CAPACITY
from .core._machine import MAX_RETRY_DELAY, MIN_RETRY_DELAY
from .core._redial import Backoff

__all__ = ["RESERVED_SLOTS", "WorkerOptions"]

#: Request slots of the connection kept free of starts and finishes (renewals, reports, resumes).
RESERVED_SLOTS = 8

#: Real time, the clock of a worker given none (stateless: one serves every worker).
_REAL_TIME = SystemClock()
_LOG = logging.getLogger("orbit_sync.worker")


def _named(check: Callable[..., object], **rules: bool) -> Callable[[Any, Any, Any], None]:
    """A validator calling *check(value, the option's name, **rules)*, which raises if wrong."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        check(value, attribute.name, **rules)

    return validate


_optional_positive = attrs.validators.optional(_named(seconds, positive=True))


def _queue_id(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not str or not ID_RE.fullmatch(value):
        raise ValueError("queue_id must be 32 lowercase hex characters")


def _capacity(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or not 1 <= value <= MAX_CAPACITY:
        raise ValueError(f"capacity must be an int between 1 and {MAX_CAPACITY}")


def _max_in_flight(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (type(value) is not int or not 3 <= value <= MAX_IN_FLIGHT):
        raise ValueError(f"max_in_flight must be an int between 3 and {MAX_IN_FLIGHT}")


def _retry_delay(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    # The watchdog's own bounds: the one place they are written.
    if not MIN_RETRY_DELAY <= seconds(value, attribute.name, positive=True) <= MAX_RETRY_DELAY:
        raise ValueError(
            f"renew_retry_delay must be between {MIN_RETRY_DELAY:g} and {MAX_RETRY_DELAY:g} seconds"
        )


def _clock(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, Clock):  # after the converter: None is real time
        raise TypeError("clock must be an orbit_sync.Clock (now, wait, park, unpark)")


def _positive_int(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{attribute.name} must be a positive int")


def _outbox(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, str | os.PathLike):
        raise TypeError("outbox must be a file path")


def _real_time_if_none(value: Clock | None) -> Clock:
    return _REAL_TIME if value is None else value


def _default_logger_if_none(value: logging.Logger | None) -> logging.Logger:
    return _LOG if value is None else value


def _default_backoff_if_none(value: Backoff | None) -> Backoff:
    return Backoff() if value is None else value


def _as_tuple(value: Iterable[object]) -> tuple[object, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class WorkerOptions:
    """Every option of a :class:`~orbit_sync.worker.Worker` but its client, validated once (see
    the Worker for what each one means); ``Worker.options`` returns the worker's.

    Frozen: derive another with ``attrs.evolve(worker.options, capacity=4)`` and build a worker
    from it with ``Worker.from_options(client, options)`` (or use :meth:`Worker.with_options`,
    which also copies the handlers). Options left out, or ``None``, read as their default:
    ``clock`` is real time (:class:`orbit_sync.SystemClock`), ``logger`` is
    ``orbit_sync.worker``'s, ``reconnect_backoff`` is ``Backoff()``.
    """

    queue_id: str = attrs.field(validator=_queue_id)
    capacity: int = attrs.field(default=8, validator=_capacity)
    drain_timeout: float = attrs.field(default=30.0, validator=_named(seconds))
    cancel_grace: float = attrs.field(default=5.0, validator=_named(seconds))
    flush_timeout: float = attrs.field(default=10.0, validator=_named(seconds))
    reconnect_backoff: Backoff = attrs.field(default=None, converter=_default_backoff_if_none)
    renew_retry_delay: float = attrs.field(default=1.0, validator=_retry_delay)
    cancellation_notifications: bool = attrs.field(default=True, converter=bool)
    dial_timeout: float = attrs.field(default=8.0, validator=_named(seconds, positive=True))
    call_timeout: float | None = attrs.field(default=10.0, validator=_named(call_timeout))
    max_in_flight: int | None = attrs.field(default=None, validator=_max_in_flight)
    handle_signals: bool = True
    logger: logging.Logger = attrs.field(default=None, converter=_default_logger_if_none)
    result_converter: cattrs.BaseConverter | None = None
    listeners: tuple[object, ...] = attrs.field(default=(), converter=_as_tuple)
    clock: Clock = attrs.field(default=None, converter=_real_time_if_none, validator=_clock)
    process_pool: int | None = attrs.field(default=None, validator=_positive_int)
    process_max_tasks_per_child: int | None = attrs.field(default=None, validator=_positive_int)
    process_max_memory_per_child: int | None = attrs.field(default=None, validator=_positive_int)
    outbox: str | os.PathLike[str] | None = attrs.field(default=None, validator=_outbox)
    time_limit: float | None = attrs.field(default=None, validator=_optional_positive)
    first_connect_timeout: float | None = attrs.field(default=None, validator=_optional_positive)
    batch_scheduling: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )

    @property
    def request_timeout(self) -> float:
        """Past this a request's connection is closed and the operation re-sent on the next
        one (never longer than the protocol's bound)."""
        return call_timeout(self.call_timeout, "call_timeout")

    @property
    def handler_slots(self) -> int:
        """Starts, finishes and resumes get the connection's request budget but a reserve:
        renewals and capacity reports never wait behind them for a slot. A quarter of the
        budget, 2 to 8 slots: a small explicit bound keeps its old split."""
        budget = MAX_IN_FLIGHT if self.max_in_flight is None else self.max_in_flight
        return budget - min(RESERVED_SLOTS, max(2, budget // 4))

    def __getitem__(self, name: str) -> Any:
        """Deprecated until the next release: read ``options.name`` (``Worker.options`` was a
        dict of the constructor's arguments)."""
        return _read_as_dict(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        """Deprecated until the next release: read ``options.name``."""
        return _read_as_dict(self, name, default)


_NOTHING = object()


def _read_as_dict(options: WorkerOptions, name: str, default: Any = _NOTHING) -> Any:
    """The old dict's reads, warning at the caller's line."""
    if name == "client":
        raise KeyError("the client is not an option: read Worker.client")
    warnings.warn(
        f"Worker.options is a WorkerOptions: options[{name!r}] is deprecated and goes in the next"
        f" release; read options.{name}",
        DeprecationWarning,
        stacklevel=3,
    )
    if name in attrs.fields_dict(WorkerOptions):
        return getattr(options, name)
    if default is _NOTHING:
        raise KeyError(name)
    return default
