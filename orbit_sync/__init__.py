"""orbit-sync: a synchronous, threaded Python SDK for Orbit workers (``pulse.worker.v1``)."""

from __future__ import annotations

from typing import Any

from ._deprecated import moved
from ._version import __version__
from .client import Client
from .clock import Clock, SystemClock
from .connection import WorkerConnection
from .errors import (
    CallTimeout,
    FrameError,
    HTTPError,
    OrbitError,
    ServerUnreachable,
    WorkerBackpressure,
    WorkerBusy,
    WorkerClosed,
    WorkerDisconnected,
    WorkerError,
    WorkerProtocolError,
)
from .models import (
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
    new_message_id,
)
from .worker import (
    AttemptInfo,
    Backoff,
    Fail,
    ShutdownReport,
    TaskCancelled,
    TaskContext,
    TimeLimitExceeded,
    UnknownEffect,
    Worker,
    WorkerOptions,
    WorkerStats,
)
from .worker.outbox._outbox import OutboxError

__all__ = [
    "Assignment",
    "AttemptInfo",
    "AttemptRef",
    "AttemptState",
    "Backoff",
    "CallTimeout",
    "CancelNotice",
    "Capability",
    "CapacityReport",
    "Client",
    "Clock",
    "CommandResult",
    "Disposition",
    "Fail",
    "Finish",
    "FrameError",
    "HTTPError",
    "Lease",
    "Operation",
    "OrbitError",
    "OutboxError",
    "Outcome",
    "Receipt",
    "Registration",
    "ServerUnreachable",
    "ShutdownReport",
    "SystemClock",
    "Task",
    "TaskCancelled",
    "TaskContext",
    "TaskState",
    "TimeLimitExceeded",
    "UnknownEffect",
    "Welcome",
    "Worker",
    "WorkerBackpressure",
    "WorkerBusy",
    "WorkerClosed",
    "WorkerConnection",
    "WorkerDisconnected",
    "WorkerError",
    "WorkerOptions",
    "WorkerProtocolError",
    "WorkerStats",
    "__version__",
    "new_message_id",
]

#: Names that moved, and their new home; the old path warns until the next release.
_MOVED = {"HandlerEnvironment": "orbit_sync.testing"}


def __getattr__(name: str) -> Any:
    new = _MOVED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return moved(__name__, name, new)
