"""The high-level worker: handlers, leases, reconnects, drain and bounded shutdown.

::

    from orbit_sync.worker import Fail, TaskContext, UnknownEffect, Worker
"""

from __future__ import annotations

from ._backoff import Backoff
from ._clock import FakeClock, WorkerClock
from ._context import TaskContext
from ._encoding import result_converter
from ._environment import HandlerEnvironment
from ._hooks import (
    AttemptEvent,
    AttemptFinished,
    DisconnectEvent,
    DrainEvent,
    LeaseEvent,
    SessionEvent,
    WorkerListener,
)
from ._outbox import OutboxError
from ._outcomes import Fail, TaskCancelled, UnknownEffect, Verdict
from ._report import AttemptInfo, ShutdownReport, WorkerStats
from ._runner import Handler, Worker

__all__ = [
    "AttemptEvent",
    "AttemptFinished",
    "AttemptInfo",
    "Backoff",
    "DisconnectEvent",
    "DrainEvent",
    "Fail",
    "FakeClock",
    "Handler",
    "HandlerEnvironment",
    "LeaseEvent",
    "OutboxError",
    "SessionEvent",
    "ShutdownReport",
    "TaskCancelled",
    "TaskContext",
    "UnknownEffect",
    "Verdict",
    "Worker",
    "WorkerClock",
    "WorkerListener",
    "WorkerStats",
    "result_converter",
]
