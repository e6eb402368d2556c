"""orbit-sync: a synchronous, threaded Python SDK for Orbit workers (``pulse.worker.v1``)."""

from __future__ import annotations

from ._version import __version__
from .client import Client
from .connection import WorkerConnection
from .errors import (
    CallTimeout,
    FrameError,
    HTTPError,
    OrbitError,
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

__all__ = [
    "Assignment",
    "AttemptRef",
    "AttemptState",
    "CallTimeout",
    "CancelNotice",
    "Capability",
    "CapacityReport",
    "Client",
    "CommandResult",
    "Disposition",
    "Finish",
    "FrameError",
    "HTTPError",
    "Lease",
    "Operation",
    "OrbitError",
    "Outcome",
    "Receipt",
    "Registration",
    "Task",
    "TaskState",
    "Welcome",
    "WorkerBackpressure",
    "WorkerBusy",
    "WorkerClosed",
    "WorkerConnection",
    "WorkerDisconnected",
    "WorkerError",
    "WorkerProtocolError",
    "__version__",
    "new_message_id",
]
