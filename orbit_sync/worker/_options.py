"""The Worker's options, each checked once, when the Worker is built (nothing is sent before).

:class:`WorkerOptions` holds every constructor argument but the client, validated and
normalized (seconds as floats, the call timeout capped at the protocol's bound, the handlers'
share of the request budget derived from *max_in_flight*). Wrong arguments raise ``TypeError``
or ``ValueError`` naming the option.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import attrs
import cattrs

from .._protocol import MAX_IN_FLIGHT, call_timeout
from .._seconds import seconds
from ..clock import Clock
from ..models import ID_RE, MAX_CAPACITY
from ._backoff import Backoff
from ._time_limits import check_time_limit

__all__ = ["RESERVED_SLOTS", "WorkerOptions", "check_seconds"]

#: Request slots of the connection kept free of starts and finishes (renewals, reports, resumes).
RESERVED_SLOTS = 8


def check_seconds(name: str, value: object, *, positive: bool = False) -> float:
    """*value* as a float number of seconds: finite, non-negative (or *positive*)."""
    return seconds(value, name, positive=positive)


def _call_timeout(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    call_timeout(value, attribute.name)


#: Field metadata: a number of seconds that must be above zero.
_POSITIVE = {"positive": True}


def _seconds(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_seconds(attribute.name, value, positive=bool(attribute.metadata.get("positive")))


def _optional_seconds(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        check_seconds(attribute.name, value, positive=True)


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
    if not 0.1 <= check_seconds("renew_retry_delay", value, positive=True) <= 5.0:
        raise ValueError("renew_retry_delay must be between 0.1 and 5 seconds")


def _clock(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, Clock):
        raise TypeError("clock must be an orbit_sync.Clock (now, wait, park, unpark)")


def _process_pool(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError("process_pool must be a positive int (child processes)")


def _time_limit(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_time_limit(value)


def _outbox(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, str | os.PathLike):
        raise TypeError("outbox must be a file path")


@attrs.frozen(kw_only=True)
class WorkerOptions:
    """Every Worker option but the client, validated (see :class:`~orbit_sync.worker.Worker`
    for what each means)."""

    queue_id: str = attrs.field(validator=_queue_id)
    capacity: int = attrs.field(default=8, validator=_capacity)
    drain_timeout: float = attrs.field(default=30.0, validator=_seconds)
    cancel_grace: float = attrs.field(default=5.0, validator=_seconds)
    flush_timeout: float = attrs.field(default=10.0, validator=_seconds)
    reconnect_backoff: Backoff | None = None
    renew_retry_delay: float = attrs.field(default=1.0, validator=_retry_delay)
    cancellation_notifications: bool = attrs.field(default=True, converter=bool)
    dial_timeout: float = attrs.field(default=8.0, validator=_seconds, metadata=_POSITIVE)
    call_timeout: float | None = attrs.field(default=10.0, validator=_call_timeout)
    max_in_flight: int | None = attrs.field(default=None, validator=_max_in_flight)
    handle_signals: bool = True
    logger: logging.Logger | None = None
    result_converter: cattrs.BaseConverter | None = None
    listeners: Iterable[object] = ()
    clock: Clock | None = attrs.field(default=None, validator=_clock)
    process_pool: int | None = attrs.field(default=None, validator=_process_pool)
    #: Checked where they are used, by ``ChildLimits`` (their one home), as the Worker is built.
    process_max_tasks_per_child: int | None = None
    process_max_memory_per_child: int | None = None
    outbox: str | os.PathLike[str] | None = attrs.field(default=None, validator=_outbox)
    time_limit: float | None = attrs.field(default=None, validator=_time_limit)
    first_connect_timeout: float | None = attrs.field(default=None, validator=_optional_seconds)

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
