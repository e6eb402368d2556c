"""The high-level worker: handlers, leases, reconnects, drain and bounded shutdown.

::

    from orbit_sync.worker import Fail, TaskContext, UnknownEffect, Worker
"""

from __future__ import annotations

from typing import Any

from .._deprecated import deprecated, moved
from ._context import TaskContext
from ._listeners import (
    AttemptEvent,
    AttemptFinished,
    AttemptInfo,
    DisconnectEvent,
    DrainEvent,
    LeaseEvent,
    SessionEvent,
    ShutdownReport,
    StuckEvent,
    WorkerListener,
    WorkerStats,
)
from ._options import WorkerOptions
from ._runner import Handler, Worker
from .core._outcomes import (
    Fail,
    TaskCancelled,
    TimeLimitExceeded,
    UnknownEffect,
    Verdict,
    result_converter,
)
from .core._redial import Backoff
from .runtime._link import Dialer

__all__ = [
    "AttemptEvent",
    "AttemptFinished",
    "AttemptInfo",
    "Backoff",
    "Dialer",
    "DisconnectEvent",
    "DrainEvent",
    "Fail",
    "Handler",
    "LeaseEvent",
    "SessionEvent",
    "ShutdownReport",
    "StuckEvent",
    "TaskCancelled",
    "TaskContext",
    "TimeLimitExceeded",
    "UnknownEffect",
    "Verdict",
    "Worker",
    "WorkerListener",
    "WorkerOptions",
    "WorkerStats",
    "result_converter",
]

#: Moved names: their new home (and name, if renamed); the old path warns until the next release.
_MOVED = {
    "HandlerEnvironment": ("orbit_sync.testing",),
    "OutboxError": ("orbit_sync",),
    "WorkerClock": ("orbit_sync", "SystemClock"),
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return moved(__name__, name, *_MOVED[name])
    if name == "FakeClock":
        from ..testing._clock import FakeClock

        return deprecated(__name__, name, FakeClock.INSTEAD, FakeClock)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
