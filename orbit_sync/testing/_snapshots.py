"""Frozen, plain snapshots of the mock server's state (what tests inspect).

Snapshots never carry a secret: no token, ``instance_secret`` or ``lease_secret``.
"""

from __future__ import annotations

import datetime as _dt
import enum
from collections.abc import Iterable
from typing import Any

import attrs

from ..models import AttemptState, Outcome, TaskState

__all__ = [
    "AttemptSnapshot",
    "EventLog",
    "EventRecord",
    "EvidenceSnapshot",
    "RetrySafety",
    "SessionSnapshot",
    "TaskPolicy",
    "TaskSnapshot",
]


class RetrySafety(str, enum.Enum):
    """A task's frozen retry policy for uncertain effects (PROTOCOL §6.4, §8)."""

    #: An ``UNKNOWN`` outcome (or a lost started attempt) may be retried while budget remains.
    IDEMPOTENT = "IDEMPOTENT"
    #: An uncertain effect goes to ``NEEDS_REVIEW``; never retried automatically.
    RECONCILE_ONLY = "RECONCILE_ONLY"

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class TaskPolicy:
    """The policy frozen on a task at enqueue."""

    max_attempts: int
    backoff_initial: float
    backoff_max: float
    retry_safety: RetrySafety
    #: Total deadline (absolute); ``None`` for none.
    deadline: _dt.datetime | None
    #: Latest moment a WAITING task may still be claimed (absolute); ``None`` for none.
    latest_start: _dt.datetime | None
    #: Per-attempt time limit in seconds, counted from the attempt's start.
    attempt_time_limit: float | None


@attrs.frozen
class EvidenceSnapshot:
    """A finish kept as ``EVIDENCE_ONLY``: late, for a never-started attempt, or conflicting."""

    attempt_id: str
    message_id: str
    outcome: Outcome
    result: Any
    error_code: str | None
    retryable: bool
    received_at: _dt.datetime
    #: ``"late"``, ``"not_started"`` or ``"conflict"``.
    reason: str


@attrs.frozen
class AttemptSnapshot:
    """One attempt of a task."""

    attempt_id: str
    number: int
    epoch: int
    state: AttemptState
    instance_id: str
    session_id: str
    assigned_at: _dt.datetime
    started_at: _dt.datetime | None
    lease_until: _dt.datetime
    finished_at: _dt.datetime | None
    outcome: Outcome | None
    error_code: str | None
    result: Any
    retryable: bool | None


@attrs.frozen
class TaskSnapshot:
    """A task with its attempts and evidence."""

    task_id: str
    queue_id: str
    namespace_id: str
    handler: str
    handler_version: str
    payload_version: str
    payload: Any
    state: TaskState
    revision: int
    epoch: int
    attempts: tuple[AttemptSnapshot, ...]
    outcome: Outcome | None
    result: Any
    error_code: str | None
    evidence: tuple[EvidenceSnapshot, ...]
    cancel_requested_at: _dt.datetime | None
    effect_uncertain: bool
    policy: TaskPolicy
    created_at: _dt.datetime
    #: When a WAITING task becomes eligible again (backoff); ``None`` when not waiting.
    next_run_at: _dt.datetime | None

    @property
    def max_attempts(self) -> int:
        """The policy's attempt budget."""
        return self.policy.max_attempts


@attrs.frozen
class SessionSnapshot:
    """One worker session (a connection after its welcome)."""

    session_id: str
    instance_id: str
    queue_id: str
    epoch: int
    opened_at: _dt.datetime
    expires_at: _dt.datetime
    #: The WebSocket is still open.
    connected: bool
    #: A newer session of the same instance exists.
    stale: bool
    #: The session window passed without a renewal.
    expired: bool
    #: The first capacity report was acknowledged: dispatch is enabled.
    dispatch_enabled: bool
    capacity: int | None
    sequence: int | None
    draining: bool
    cancellation_notifications: bool
    #: Attempts of this instance holding a slot (counted across all its sessions).
    held: int


@attrs.frozen
class EventRecord:
    """One recorded transition, stamped with server time."""

    at: _dt.datetime
    kind: str
    task_id: str | None = None
    attempt_id: str | None = None
    session_id: str | None = None
    old: str | None = None
    new: str | None = None
    detail: str = ""


class EventLog(tuple[EventRecord, ...]):
    """The recorded events still held, oldest first, and how many older ones were dropped.

    The mock server keeps its event log in a ring of bounded size: once it is full, each new
    event pushes the oldest out. ``dropped`` counts those, so event *i* of this tuple is the
    ``dropped + i``-th event ever recorded, and ``truncated`` says whether any are missing.
    """

    dropped: int

    def __new__(cls, events: Iterable[EventRecord] = (), dropped: int = 0) -> EventLog:
        log = super().__new__(cls, events)
        log.dropped = dropped
        return log

    @property
    def truncated(self) -> bool:
        """True when older events were dropped from the ring."""
        return self.dropped > 0
