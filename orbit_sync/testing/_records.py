"""The mock server state machine's records: what it stores, what it returns, and snapshots.

Internal records (``_Task``, ``_Attempt``, ``_Session``, ...) are mutable and private to the
state machine; :func:`snapshot_task` turns a task into the frozen, secret-free
:class:`~._snapshots.TaskSnapshot` tests inspect. Outputs (``Push``, ``CloseSession``,
``Answer``, ``Handled``) are what each state-machine call hands back to the WebSocket shell.

Times are integer microseconds of POSIX time, so that a lease window computed as
``lease_until - server_time`` is exact on the wire.
"""

from __future__ import annotations

import collections
import datetime as _dt
import hashlib
import json
import math
from typing import Any

import attrs

from ..models import (
    AttemptState,
    Capability,
    CapacityReport,
    Disposition,
    Operation,
    Outcome,
    Receipt,
    Registration,
    TaskState,
)
from ._options import ENQUEUE_OPTIONS
from ._snapshots import (
    AttemptSnapshot,
    EvidenceSnapshot,
    RetrySafety,
    TaskPolicy,
    TaskSnapshot,
)

__all__ = [
    "SCOPE_CONNECT",
    "SCOPE_CONSUME",
    "Action",
    "Answer",
    "CloseSession",
    "Handled",
    "InvariantError",
    "Push",
    "queue_scope",
    "snapshot_task",
    "to_datetime",
]

SCOPE_CONNECT = "workers:connect"
SCOPE_CONSUME = "workers:consume"

US = 1_000_000
EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
#: Recovery scan period and batch size (PROTOCOL §8).
SCAN_INTERVAL_US = 2 * US
SCAN_BATCH = 100
#: Room kept for the task payload's envelope when checking that an assignment fits a frame.
ASSIGN_OVERHEAD = 4096
#: The keywords ``enqueue`` (and each ``enqueue_many`` spec) accepts besides handler/payload.
ENQUEUE_KEYWORDS = frozenset(ENQUEUE_OPTIONS)

LIVE = (AttemptState.LEASED, AttemptState.RUNNING)
TERMINAL_TASK = (
    TaskState.SUCCEEDED,
    TaskState.FAILED,
    TaskState.CANCELLED,
    TaskState.NEEDS_REVIEW,
)
FINISH_STATE = {
    Outcome.SUCCEEDED: AttemptState.SUCCEEDED,
    Outcome.FAILED: AttemptState.FAILED,
    Outcome.UNKNOWN: AttemptState.UNKNOWN,
    Outcome.CANCELLED: AttemptState.CANCELLED,
}

# Public error messages: stable, and never carrying payloads or secrets (PROTOCOL §2).
MSG = {
    "STALE_SESSION": "the session is no longer current",
    "EXPIRED": "the session expired without a renewal",
    "LEASE_LOST": "attempt no longer grants execution authority",
    "IDEMPOTENCY_CONFLICT": "message_id was already used for a different operation",
    "UNAUTHENTICATED": "the token is not valid",
    "RATE_LIMITED": "too many requests; retry later",
    "PAUSED": "the queue is paused",
}


def queue_scope(queue_id: str) -> str:
    """The token scope that lets a worker consume *queue_id*."""
    return f"queue:{queue_id}"


def to_datetime(us: int) -> _dt.datetime:
    """Server microseconds to an aware UTC datetime."""
    return EPOCH + _dt.timedelta(microseconds=us)


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_key(kind: str, body: dict[str, Any]) -> str:
    # A digest, so a request's lease_secret is never kept as part of a lookup key.
    if kind == "task.finish":
        body = dict(body)
        body["retryable"] = body.get("retryable", False) is True
    return hashlib.sha256(f"{kind}\n{canonical(body)}".encode()).hexdigest()


def seconds_us(name: str, value: float | None, *, allow_none: bool = True) -> int | None:
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{name} is required")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0")
    return round(value * US)


def check_concurrency(value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError("max_concurrency must be an int >= 1 or None")


# --------------------------------------------------------------------------- outputs


@attrs.frozen
class Push:
    """A frame the server sends to a session on its own initiative (no ``reply_to``)."""

    session_id: str
    type: str
    body: dict[str, Any] | None = None
    error: tuple[str, str] | None = None
    task_id: str | None = None


@attrs.frozen
class CloseSession:
    """Close a session's connection once the frames queued before it are written."""

    session_id: str
    reason: str


Action = Push | CloseSession


@attrs.frozen
class Answer:
    """The answer to one request: ``worker.welcome``, ``ack`` or ``error``."""

    type: str
    body: dict[str, Any] | None = None
    error: tuple[str, str] | None = None
    #: Close the connection after this answer (fatal errors, INVALID_FRAME).
    close: bool = False


@attrs.frozen
class Handled:
    """What the shell must do after a request: answer, then run the actions in order."""

    answer: Answer
    actions: tuple[Action, ...] = ()
    #: The session the answer belongs to (the new one for a welcome).
    session_id: str | None = None


class Reject(Exception):
    """Internal: abort a request with an error answer."""

    def __init__(self, code: str, message: str, *, close: bool = False) -> None:
        super().__init__(code)
        self.code = code
        self.message = message
        self.close = close


class InvariantError(AssertionError):
    """A global invariant of the mock server does not hold (see ``check_invariants``)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


# --------------------------------------------------------------------------- internal records

#: A dispatch key: tasks with the same queue and capability wait in one ready heap.
ReadyKey = tuple[str, str, str, str]


@attrs.define
class Queue:
    queue_id: str
    max_concurrency: int | None
    paused: bool = False
    in_use: int = 0


@attrs.define
class Instance:
    instance_id: str
    secret_digest: bytes = attrs.field(repr=False)
    token_digest: bytes = attrs.field(repr=False)
    queue_id: str
    capabilities: frozenset[Capability]
    #: Creation order: dispatch breaks load ties by it (oldest process first).
    order: int = 0
    epoch: int = 0
    draining: bool = False
    sequence: int | None = None
    report: CapacityReport | None = None
    held: int = 0
    current_session: str | None = None
    #: The message_id of its latest capacity report: the only one whose receipt is kept.
    capacity_op: str | None = None
    #: Sessions of this instance still stored (it is forgotten after the last one).
    sessions: set[str] = attrs.field(factory=set)


@attrs.define
class Session:
    session_id: str
    instance_id: str
    epoch: int
    token: str = attrs.field(repr=False)
    registration: Registration
    opened_at: int
    expires_at: int
    #: This session's own request-rate window.
    requests: RateWindow = attrs.field(repr=False)
    #: The ready heaps this session can take from (its queue x its capabilities).
    keys: tuple[ReadyKey, ...] = ()
    connected: bool = True
    stale: bool = False
    expired: bool = False
    enabled: bool = False
    #: When it ended (stale or expired, and disconnected); it is forgotten a retention later.
    ended_at: int | None = None
    #: message_ids of its worker.resume requests: their receipts go when the session ends.
    resume_ops: list[str] = attrs.field(factory=list, repr=False)


@attrs.define
class FinishRecord:
    key: str
    receipt: Receipt


@attrs.define
class Attempt:
    attempt_id: str
    task_id: str
    number: int
    epoch: int
    lease_secret: str = attrs.field(repr=False)
    instance_id: str
    session_id: str
    queue_id: str
    state: AttemptState
    assigned_at: int
    lease_until: int
    started_at: int | None = None
    finished_at: int | None = None
    outcome: Outcome | None = None
    error_code: str | None = None
    result: str | None = None  # canonical JSON text
    retryable: bool | None = None
    holds_slot: bool = False
    releases: int = 0
    finish: FinishRecord | None = None
    evidence: dict[str, Receipt] = attrs.field(factory=dict)


@attrs.define
class Evidence:
    attempt_id: str
    message_id: str
    outcome: Outcome
    result: str
    error_code: str | None
    retryable: bool
    received_at: int
    reason: str


@attrs.define
class Policy:
    max_attempts: int
    backoff_initial_us: int
    backoff_max_us: int
    retry_safety: RetrySafety
    deadline: int | None
    latest_start: int | None
    attempt_time_limit_us: int | None

    def overdue_at(self) -> int | None:
        """The first moment a WAITING task is past its deadline or latest start (PROTOCOL §8)."""
        moments = []
        if self.deadline is not None:
            moments.append(self.deadline)
        if self.latest_start is not None:
            moments.append(self.latest_start + 1)  # "past" the latest start, not at it
        return min(moments) if moments else None


@attrs.define
class Task:
    task_id: str
    seq: int
    queue_id: str
    handler: str
    handler_version: str
    payload_version: str
    payload: str  # canonical JSON text; parsed afresh for every frame and snapshot
    policy: Policy
    created_at: int
    state: TaskState = TaskState.WAITING
    revision: int = 1
    epoch: int = 0
    attempts: list[Attempt] = attrs.field(factory=list)
    next_run_at: int | None = None
    outcome: Outcome | None = None
    result: str | None = None
    error_code: str | None = None
    evidence: list[Evidence] = attrs.field(factory=list)
    cancel_requested_at: int | None = None
    effect_uncertain: bool = False

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def key(self) -> ReadyKey:
        return (self.queue_id, self.handler, self.handler_version, self.payload_version)


@attrs.define
class Op:
    """What one ``message_id`` named, and (for start/renew/finish) its original receipt."""

    kind: str
    key: str
    receipt: Receipt | None = None
    attempt_id: str | None = None
    #: When it was recorded (server time, microseconds).
    at: int = 0


class RateWindow:
    """At most *count* events in any sliding *window_us* (``count=None``: unlimited).

    The one sliding-window counter of the state machine: assignments per node and requests per
    session both use it.
    """

    __slots__ = ("_times", "count", "window_us")

    def __init__(self, rate: float | None) -> None:
        # "at most *rate* per second": whole events per second, or one per 1/rate seconds.
        if rate is None or rate == float("inf"):
            self.window_us, self.count = US, None
        elif rate >= 1:
            self.window_us, self.count = US, int(rate)
        else:
            self.window_us, self.count = round(US / rate), 1
        self._times: collections.deque[int] = collections.deque()

    @property
    def limited(self) -> bool:
        return self.count is not None

    def prune(self, now: int) -> None:
        """Drop the events that left the window by *now*."""
        times = self._times
        while times and times[0] <= now - self.window_us:
            times.popleft()

    def allows(self, now: int) -> bool:
        """True when one more event fits the window at *now*."""
        if self.count is None:
            return True
        self.prune(now)
        return len(self._times) < self.count

    def add(self, now: int) -> None:
        if self.count is not None:
            self._times.append(now)

    def frees_at(self, now: int) -> int | None:
        """When a full window next has room (``None``: it has room now, or no limit)."""
        if self.count is None:
            return None
        self.prune(now)
        if len(self._times) < self.count:
            return None
        return self._times[0] + self.window_us


def receipt_of(operation: Operation, task: Task, att: Attempt, disposition: Disposition) -> Receipt:
    """The receipt of *operation* as the task and attempt stand now."""
    return Receipt(
        operation=operation,
        task_state=task.state,
        attempt_state=att.state,
        task_revision=task.revision,
        lease_until=to_datetime(att.lease_until),
        disposition=disposition,
    )


# --------------------------------------------------------------------------- snapshots


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _maybe_dt(us: int | None) -> _dt.datetime | None:
    return None if us is None else to_datetime(us)


def snapshot_task(task: Task, namespace_id: str) -> TaskSnapshot:
    """A frozen, secret-free snapshot of *task*."""
    p = task.policy
    policy = TaskPolicy(
        max_attempts=p.max_attempts,
        backoff_initial=p.backoff_initial_us / US,
        backoff_max=p.backoff_max_us / US,
        retry_safety=p.retry_safety,
        deadline=_maybe_dt(p.deadline),
        latest_start=_maybe_dt(p.latest_start),
        attempt_time_limit=None
        if p.attempt_time_limit_us is None
        else p.attempt_time_limit_us / US,
    )
    attempts = tuple(
        AttemptSnapshot(
            attempt_id=a.attempt_id,
            number=a.number,
            epoch=a.epoch,
            state=a.state,
            instance_id=a.instance_id,
            session_id=a.session_id,
            assigned_at=to_datetime(a.assigned_at),
            started_at=_maybe_dt(a.started_at),
            lease_until=to_datetime(a.lease_until),
            finished_at=_maybe_dt(a.finished_at),
            outcome=a.outcome,
            error_code=a.error_code,
            result=_loads(a.result),
            retryable=a.retryable,
        )
        for a in task.attempts
    )
    evidence = tuple(
        EvidenceSnapshot(
            attempt_id=e.attempt_id,
            message_id=e.message_id,
            outcome=e.outcome,
            result=_loads(e.result),
            error_code=e.error_code,
            retryable=e.retryable,
            received_at=to_datetime(e.received_at),
            reason=e.reason,
        )
        for e in task.evidence
    )
    return TaskSnapshot(
        task_id=task.task_id,
        queue_id=task.queue_id,
        namespace_id=namespace_id,
        handler=task.handler,
        handler_version=task.handler_version,
        payload_version=task.payload_version,
        payload=json.loads(task.payload),
        state=task.state,
        revision=task.revision,
        epoch=task.epoch,
        attempts=attempts,
        outcome=task.outcome,
        result=_loads(task.result),
        error_code=task.error_code,
        evidence=evidence,
        cancel_requested_at=_maybe_dt(task.cancel_requested_at),
        effect_uncertain=task.effect_uncertain,
        policy=policy,
        created_at=to_datetime(task.created_at),
        next_run_at=_maybe_dt(task.next_run_at),
    )
