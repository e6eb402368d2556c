"""The mock Orbit server's state machine: PROTOCOL §5-§11, with no sockets and no threads.

Everything here is plain Python driven by three kinds of input:

* a validated client request (``hello`` / ``handle``) from the WebSocket shell,
* an operator call (``enqueue``, ``request_cancel``, ``pause_queue``, ...),
* time (``run_due``), read from an injected clock.

Each call returns what the shell must do next: an answer for the requesting connection and an
ordered list of actions (frames to push to other sessions, sessions to close). The caller holds
one lock around every call; this module is not thread-safe by itself, on purpose, so the rules
can be tested deterministically.

Times are integer microseconds of POSIX time internally, so that a lease window computed as
``lease_until - server_time`` is exact on the wire (a float round trip could make a 120 s window
121 µs long and a strict client would reject it).
"""

from __future__ import annotations

import collections
import datetime as _dt
import hashlib
import hmac
import json
import math
import re
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs

from .. import _json
from .._codec import ClientFrame, unstructure
from ..models import (
    Assignment,
    AttemptRef,
    AttemptState,
    CancelNotice,
    Capability,
    CapacityReport,
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
    new_id,
    new_secret,
)
from ._clock import Clock
from ._snapshots import (
    AttemptSnapshot,
    EventRecord,
    EvidenceSnapshot,
    RetrySafety,
    SessionSnapshot,
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
    "OrbitState",
    "Push",
    "queue_scope",
]

SCOPE_CONNECT = "workers:connect"
SCOPE_CONSUME = "workers:consume"

_US = 1_000_000
#: What an ``Authorization: Bearer`` token may look like here (visible ASCII, no spaces).
_TOKEN_RE = re.compile(r"[\x21-\x7e]{1,512}")
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
#: Recovery scan period and batch size (PROTOCOL §8).
SCAN_INTERVAL_US = 2 * _US
SCAN_BATCH = 100
#: The keywords ``enqueue`` (and each ``enqueue_many`` spec) accepts besides handler/payload.
_ENQUEUE_KEYWORDS = frozenset(
    {
        "handler_version",
        "payload_version",
        "queue_id",
        "max_attempts",
        "backoff_initial",
        "backoff_max",
        "retry_safety",
        "deadline",
        "latest_start",
        "attempt_time_limit",
    }
)
#: Room kept for the task payload's envelope when checking that an assignment fits a frame.
_ASSIGN_OVERHEAD = 4096

_LIVE = (AttemptState.LEASED, AttemptState.RUNNING)
_TERMINAL_TASK = (
    TaskState.SUCCEEDED,
    TaskState.FAILED,
    TaskState.CANCELLED,
    TaskState.NEEDS_REVIEW,
)
_FINISH_STATE = {
    Outcome.SUCCEEDED: AttemptState.SUCCEEDED,
    Outcome.FAILED: AttemptState.FAILED,
    Outcome.UNKNOWN: AttemptState.UNKNOWN,
    Outcome.CANCELLED: AttemptState.CANCELLED,
}

# Public error messages: stable, and never carrying payloads or secrets (PROTOCOL §2).
_MSG = {
    "STALE_SESSION": "the session is no longer current",
    "EXPIRED": "the session expired without a renewal",
    "LEASE_LOST": "attempt no longer grants execution authority",
    "IDEMPOTENCY_CONFLICT": "message_id was already used for a different operation",
    "UNAUTHENTICATED": "the token is not valid",
    "PERMISSION_DENIED": "the token lacks a required scope",
    "RATE_LIMITED": "too many requests; retry later",
    "PAUSED": "the queue is paused",
}


def queue_scope(queue_id: str) -> str:
    """The token scope that lets a worker consume *queue_id*."""
    return f"queue:{queue_id}"


def to_datetime(us: int) -> _dt.datetime:
    """Server microseconds to an aware UTC datetime."""
    return _EPOCH + _dt.timedelta(microseconds=us)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content_key(kind: str, body: dict[str, Any]) -> str:
    # A digest, so a request's lease_secret is never kept as part of a lookup key.
    if kind == "task.finish":
        body = dict(body)
        body["retryable"] = body.get("retryable", False) is True
    return hashlib.sha256(f"{kind}\n{_canonical(body)}".encode()).hexdigest()


def _finish_key(fin: Finish) -> str:
    content = {
        "outcome": fin.outcome.value,
        "result": fin.result,
        "error_code": fin.error_code,
        "retryable": fin.retryable is True,
    }
    return hashlib.sha256(_canonical(content).encode()).hexdigest()


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


class _Reject(Exception):
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


@attrs.define
class _Queue:
    queue_id: str
    max_concurrency: int | None
    paused: bool = False
    in_use: int = 0


@attrs.define
class _Instance:
    instance_id: str
    secret_digest: bytes = attrs.field(repr=False)
    token_digest: bytes = attrs.field(repr=False)
    queue_id: str
    capabilities: frozenset[Capability]
    epoch: int = 0
    draining: bool = False
    sequence: int | None = None
    report: CapacityReport | None = None
    held: int = 0
    current_session: str | None = None


@attrs.define
class _Session:
    session_id: str
    instance_id: str
    epoch: int
    token: str = attrs.field(repr=False)
    registration: Registration
    opened_at: int
    expires_at: int
    connected: bool = True
    stale: bool = False
    expired: bool = False
    enabled: bool = False
    requests: collections.deque[int] = attrs.field(factory=collections.deque, repr=False)


@attrs.define
class _FinishRecord:
    key: str
    receipt: Receipt


@attrs.define
class _Attempt:
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
    finish: _FinishRecord | None = None
    evidence: dict[str, Receipt] = attrs.field(factory=dict)


@attrs.define
class _Evidence:
    attempt_id: str
    message_id: str
    outcome: Outcome
    result: str
    error_code: str | None
    retryable: bool
    received_at: int
    reason: str


@attrs.define
class _Policy:
    max_attempts: int
    backoff_initial_us: int
    backoff_max_us: int
    retry_safety: RetrySafety
    deadline: int | None
    latest_start: int | None
    attempt_time_limit_us: int | None


@attrs.define
class _Task:
    task_id: str
    seq: int
    queue_id: str
    handler: str
    handler_version: str
    payload_version: str
    payload: str  # canonical JSON text; parsed afresh for every frame and snapshot
    policy: _Policy
    created_at: int
    state: TaskState = TaskState.WAITING
    revision: int = 1
    epoch: int = 0
    attempts: list[_Attempt] = attrs.field(factory=list)
    next_run_at: int | None = None
    outcome: Outcome | None = None
    result: str | None = None
    error_code: str | None = None
    evidence: list[_Evidence] = attrs.field(factory=list)
    cancel_requested_at: int | None = None
    effect_uncertain: bool = False

    @property
    def current(self) -> _Attempt | None:
        return self.attempts[-1] if self.attempts else None


@attrs.define
class _Op:
    """What one ``message_id`` named, and (for start/renew/finish) its original receipt."""

    kind: str
    key: str
    receipt: Receipt | None = None
    attempt_id: str | None = None


# --------------------------------------------------------------------------- the state machine


def _seconds_us(name: str, value: float | None, *, allow_none: bool = True) -> int | None:
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{name} is required")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0")
    return round(value * _US)


def _receipt(operation: Operation, task: _Task, att: _Attempt, disposition: Disposition) -> Receipt:
    """The receipt of *operation* as the task and attempt stand now."""
    return Receipt(
        operation=operation,
        task_state=task.state,
        attempt_state=att.state,
        task_revision=task.revision,
        lease_until=to_datetime(att.lease_until),
        disposition=disposition,
    )


class OrbitState:
    """The server side of ``pulse.worker.v1`` as a pure state machine (see module docstring)."""

    def __init__(
        self,
        *,
        clock: Clock,
        lease_duration: float = 30.0,
        session_window: float = 45.0,
        assignment_rate: float | None = 4.0,
        request_rate: float | None = None,
        max_concurrency: int | None = None,
    ) -> None:
        if not 1.0 <= lease_duration <= 120.0:
            raise ValueError("lease_duration must be between 1 and 120 seconds")
        if not 0.0 < session_window <= 300.0:
            raise ValueError("session_window must be in (0, 300] seconds")
        if assignment_rate is not None and not assignment_rate > 0:
            raise ValueError("assignment_rate must be > 0 (or None for no limit)")
        if request_rate is not None and not request_rate > 0:
            raise ValueError("request_rate must be > 0 (or None for no limit)")
        self._clock = clock
        self.lease_us = round(lease_duration * _US)
        self.session_us = round(session_window * _US)
        self._rate_window_us, self._rate_count = _rate_shape(assignment_rate)
        self._req_window_us, self._req_count = _rate_shape(request_rate)
        self.namespace_id = new_id()
        self._tokens: dict[str, frozenset[str]] = {}
        self._queues: dict[str, _Queue] = {}
        self._instances: dict[str, _Instance] = {}
        self._sessions: dict[str, _Session] = {}
        self._tasks: dict[str, _Task] = {}
        self._attempts: dict[str, _Attempt] = {}
        self._waiting: dict[str, None] = {}  # WAITING task ids, insertion-ordered
        self._ops: dict[str, _Op] = {}
        self._events: list[EventRecord] = []
        self._assigned_at: collections.deque[int] = collections.deque()
        self._seq = 0
        self._next_scan = self.now_us() + SCAN_INTERVAL_US
        #: The shell's answer to "may I push to this session now, *n* pushes already emitted
        #: by this dispatch round?" (room left in its outbox).
        self.push_gate: Callable[[str, int], bool] = lambda _sid, _n: True
        self.default_queue = self.add_queue(max_concurrency=max_concurrency)

    # ------------------------------------------------------------------ time

    def now_us(self) -> int:
        """Server time in integer microseconds."""
        return round(self._clock.now() * _US)

    def _now_dt(self) -> _dt.datetime:
        return to_datetime(self.now_us())

    # ------------------------------------------------------------------ operator API

    def add_token(self, scopes: Iterable[str], *, token: str | None = None) -> str:
        """Register a bearer token with *scopes* (a fresh random one unless *token* is given);
        returns the token."""
        if isinstance(scopes, str):
            raise TypeError("scopes must be an iterable of strings, not one string")
        scope_set = frozenset(scopes)
        for scope in scope_set:
            if type(scope) is not str:
                raise TypeError("scopes must be strings")
        if token is None:
            token = secrets.token_urlsafe(32)
        elif type(token) is not str or not _TOKEN_RE.fullmatch(token):
            # Never echo the value: it is a credential.
            raise ValueError("token must be 1-512 visible ASCII characters without spaces")
        elif self.token_scopes(token) is not None:
            raise ValueError("that token is already registered")
        self._tokens[token] = scope_set
        return token

    def revoke_token(self, token: str) -> None:
        """Make *token* invalid: new connections get 401, live sessions UNAUTHENTICATED."""
        self._tokens.pop(token, None)

    def token_scopes(self, token: str) -> frozenset[str] | None:
        """The scopes of *token*, or ``None`` when it is unknown."""
        for known, scopes in self._tokens.items():
            # Constant-time per comparison: a token is a credential.
            if hmac.compare_digest(known.encode(), token.encode()):
                return scopes
        return None

    def add_queue(self, *, max_concurrency: int | None = None, paused: bool = False) -> str:
        """Create a queue; returns its id."""
        _check_concurrency(max_concurrency)
        queue_id = new_id()
        self._queues[queue_id] = _Queue(queue_id, max_concurrency, paused)
        self._event("queue.created", detail=queue_id)
        return queue_id

    def _queue(self, queue_id: str | None) -> _Queue:
        qid = self.default_queue if queue_id is None else queue_id
        try:
            return self._queues[qid]
        except KeyError:
            raise KeyError(f"unknown queue {qid}") from None

    def set_max_concurrency(
        self, queue_id: str | None, max_concurrency: int | None
    ) -> list[Action]:
        """Change a queue's concurrency limit (``None``: unlimited)."""
        _check_concurrency(max_concurrency)
        queue = self._queue(queue_id)
        queue.max_concurrency = max_concurrency
        self._event("queue.max_concurrency", detail=f"{queue.queue_id}={max_concurrency}")
        return self._pump()

    def pause_queue(self, queue_id: str | None = None) -> list[Action]:
        """Pause a queue: no new assignments, and ``task.start`` is refused."""
        queue = self._queue(queue_id)
        queue.paused = True
        self._event("queue.paused", detail=queue.queue_id)
        return []

    def resume_queue(self, queue_id: str | None = None) -> list[Action]:
        """Resume a paused queue."""
        queue = self._queue(queue_id)
        queue.paused = False
        self._event("queue.resumed", detail=queue.queue_id)
        return self._pump()

    def enqueue(
        self,
        handler: str,
        payload: Any,
        *,
        handler_version: str = "1",
        payload_version: str = "1",
        queue_id: str | None = None,
        max_attempts: int = 3,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        retry_safety: RetrySafety | str = RetrySafety.RECONCILE_ONLY,
        deadline: float | _dt.datetime | None = None,
        latest_start: float | _dt.datetime | None = None,
        attempt_time_limit: float | None = None,
    ) -> tuple[str, list[Action]]:
        """Create a WAITING task; returns its id and the assignments that follow at once."""
        task = self._new_task(
            handler,
            payload,
            handler_version=handler_version,
            payload_version=payload_version,
            queue_id=queue_id,
            max_attempts=max_attempts,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            retry_safety=retry_safety,
            deadline=deadline,
            latest_start=latest_start,
            attempt_time_limit=attempt_time_limit,
        )
        self._add_task(task)
        return task.task_id, self._pump()

    def enqueue_many(self, specs: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[Action]]:
        """Create many WAITING tasks at once, all or none; returns their ids (in order) and the
        assignments that follow.

        Each spec is a mapping of :meth:`enqueue`'s arguments (``handler``, ``payload`` and any
        of its keywords). Every spec is validated before the first task is created, so a bad
        one raises (naming its index) and leaves the state untouched; dispatch runs once.
        """
        if isinstance(specs, Mapping | str | bytes):
            raise TypeError("specs must be an iterable of mappings")
        tasks: list[_Task] = []
        for index, spec in enumerate(specs):
            if not isinstance(spec, Mapping):
                raise TypeError(f"spec {index} must be a mapping")
            args = dict(spec)
            try:
                handler = args.pop("handler")
                payload = args.pop("payload")
            except KeyError as exc:
                raise ValueError(f"spec {index} lacks {exc.args[0]!r}") from None
            unknown = set(args) - _ENQUEUE_KEYWORDS
            if unknown:
                raise TypeError(f"spec {index} has unknown keys: {', '.join(sorted(unknown))}")
            try:
                tasks.append(self._new_task(handler, payload, **args))
            except (TypeError, ValueError, KeyError) as exc:
                raise type(exc)(f"spec {index}: {exc.args[0] if exc.args else exc}") from None
        for task in tasks:
            self._add_task(task)
        return [t.task_id for t in tasks], self._pump()

    def _new_task(
        self,
        handler: str,
        payload: Any,
        *,
        handler_version: str = "1",
        payload_version: str = "1",
        queue_id: str | None = None,
        max_attempts: int = 3,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        retry_safety: RetrySafety | str = RetrySafety.RECONCILE_ONLY,
        deadline: float | _dt.datetime | None = None,
        latest_start: float | _dt.datetime | None = None,
        attempt_time_limit: float | None = None,
    ) -> _Task:
        """Validate one enqueue and build its task, without storing it."""
        # Capability validates handler and versions exactly as the wire does.
        cap = Capability(handler, handler_version, payload_version)
        queue = self._queue(queue_id)
        if payload is None:
            raise ValueError("payload must be JSON other than null")
        text = _json.dumps(payload)  # refuses NaN, surrogates, non-JSON values
        if len(text.encode("utf-8")) > _json.MAX_FRAME_BYTES - _ASSIGN_OVERHEAD:
            raise ValueError("payload is too large to fit one assignment frame")
        _json.loads(text)  # what a strict peer will accept (int keys, huge ints)
        if type(max_attempts) is not int or not 1 <= max_attempts <= 1000:
            raise ValueError("max_attempts must be an int between 1 and 1000")
        initial = _seconds_us("backoff_initial", backoff_initial, allow_none=False)
        maximum = _seconds_us("backoff_max", backoff_max, allow_none=False)
        assert initial is not None and maximum is not None
        if maximum < initial:
            raise ValueError("backoff_max must be >= backoff_initial")
        safety = RetrySafety(retry_safety)
        now = self.now_us()
        limit = _seconds_us("attempt_time_limit", attempt_time_limit)
        if limit == 0:
            raise ValueError("attempt_time_limit must be > 0")
        policy = _Policy(
            max_attempts=max_attempts,
            backoff_initial_us=initial,
            backoff_max_us=maximum,
            retry_safety=safety,
            deadline=self._moment("deadline", deadline, now),
            latest_start=self._moment("latest_start", latest_start, now),
            attempt_time_limit_us=limit,
        )
        return _Task(
            task_id=new_id(),
            seq=0,  # numbered when stored
            queue_id=queue.queue_id,
            handler=cap.handler,
            handler_version=cap.handler_version,
            payload_version=cap.payload_version,
            payload=text,
            policy=policy,
            created_at=now,
            next_run_at=now,
        )

    def _add_task(self, task: _Task) -> None:
        self._seq += 1
        task.seq = self._seq
        self._tasks[task.task_id] = task
        self._waiting[task.task_id] = None
        self._event("task.enqueued", task=task, new=TaskState.WAITING.value, detail=task.handler)

    @staticmethod
    def _moment(name: str, value: float | _dt.datetime | None, now: int) -> int | None:
        if value is None:
            return None
        if isinstance(value, _dt.datetime):
            if value.utcoffset() is None:
                raise ValueError(f"{name} must be an aware datetime")
            delta = value - _EPOCH
            return delta // _dt.timedelta(microseconds=1)
        rel = _seconds_us(name, value)
        assert rel is not None
        return now + rel

    def request_cancel(self, task_id: str) -> list[Action]:
        """Store a cancel request (PROTOCOL §9). A no-op on a finished or already-cancelled task."""
        task = self._task(task_id)
        if task.state in _TERMINAL_TASK or task.cancel_requested_at is not None:
            return []
        now = self.now_us()
        task.cancel_requested_at = now
        task.revision += 1
        self._event("task.cancel_requested", task=task, old=task.state.value)
        actions: list[Action] = []
        att = task.current
        if task.state is TaskState.WAITING:
            self._finalize(task, TaskState.CANCELLED, error_code=None, outcome=None, result=None)
        # A LEASED or RUNNING attempt is kept (PROTOCOL §9): its leases carry the request, a
        # start is still applied, and it ends by a truthful finish or by lease recovery.
        if att is not None and att.state in _LIVE:
            actions.extend(self._cancel_push(task, att))
        actions.extend(self._pump())
        return actions

    def _cancel_push(self, task: _Task, att: _Attempt) -> list[Action]:
        session = self._sessions.get(att.session_id)
        if (
            session is None
            or not session.connected
            or session.stale
            or session.expired
            or not session.registration.cancellation_notifications
            or task.cancel_requested_at is None
        ):
            return []
        notice = CancelNotice(
            task_id=task.task_id,
            attempt_id=att.attempt_id,
            epoch=att.epoch,
            cancel_requested_at=to_datetime(task.cancel_requested_at),
        )
        self._event("task.cancel_pushed", task=task, attempt=att, session=session.session_id)
        return [Push(session.session_id, "task.cancel", unstructure(notice), task_id=task.task_id)]

    # ------------------------------------------------------------------ sessions

    def hello(self, token: str, frame: ClientFrame) -> Handled:
        """Open a session for a validated ``worker.hello`` (PROTOCOL §5.1-§5.4)."""
        try:
            return self._hello(token, frame)
        except _Reject as rej:
            self._event("session.refused", detail=rej.code)
            return Handled(Answer("error", error=(rej.code, rej.message), close=True))

    def _hello(self, token: str, frame: ClientFrame) -> Handled:
        reg = frame.body
        assert isinstance(reg, Registration)
        scopes = self.token_scopes(token)
        if scopes is None:
            raise _Reject("UNAUTHENTICATED", _MSG["UNAUTHENTICATED"], close=True)
        if (
            SCOPE_CONSUME not in scopes
            or queue_scope(reg.queue_id) not in scopes
            or reg.queue_id not in self._queues
        ):
            # An unknown queue looks like a missing scope: no oracle for queue ids.
            raise _Reject("PERMISSION_DENIED", _MSG["PERMISSION_DENIED"], close=True)
        caps = frozenset(reg.capabilities)
        inst = self._instances.get(reg.instance_id)
        if inst is None:
            inst = _Instance(
                instance_id=reg.instance_id,
                secret_digest=_digest(reg.instance_secret),
                token_digest=_digest(token),
                queue_id=reg.queue_id,
                capabilities=caps,
            )
            self._instances[inst.instance_id] = inst
        else:
            # Knowing an instance_id is not enough to take a process over (PROTOCOL §5.4).
            if not hmac.compare_digest(
                inst.secret_digest, _digest(reg.instance_secret)
            ) or not hmac.compare_digest(inst.token_digest, _digest(token)):
                raise _Reject(
                    "PERMISSION_DENIED", "the instance is bound to other credentials", close=True
                )
            if inst.queue_id != reg.queue_id:
                raise _Reject("STATE_CONFLICT", "a worker process cannot switch queues", close=True)
            if inst.capabilities != caps:
                raise _Reject(
                    "STATE_CONFLICT",
                    "a worker process cannot change its capabilities by reconnecting",
                    close=True,
                )
        actions: list[Action] = []
        now = self.now_us()
        inst.epoch += 1
        for old in self._sessions.values():
            if old.instance_id == inst.instance_id and not old.stale:
                old.stale = True
                self._event("session.stale", session=old.session_id, detail=f"epoch={old.epoch}")
                if old.connected and not old.expired:
                    actions.append(
                        Push(
                            old.session_id,
                            "error",
                            error=("STALE_SESSION", "a newer session of this worker exists"),
                        )
                    )
                    actions.append(CloseSession(old.session_id, "stale session"))
        session = _Session(
            session_id=new_id(),
            instance_id=inst.instance_id,
            epoch=inst.epoch,
            token=token,
            registration=reg,
            opened_at=now,
            expires_at=now + self.session_us,
        )
        self._sessions[session.session_id] = session
        inst.current_session = session.session_id
        self._event("session.opened", session=session.session_id, detail=f"epoch={inst.epoch}")
        return Handled(
            Answer("worker.welcome", self._welcome(session)),
            tuple(actions),
            session.session_id,
        )

    def _welcome(self, session: _Session) -> dict[str, Any]:
        inst = self._instances[session.instance_id]
        now = self.now_us()
        welcome = Welcome(
            session_id=session.session_id,
            epoch=session.epoch,
            server_time=to_datetime(now),
            expires_at=to_datetime(session.expires_at),
            lease_duration_ms=self.lease_us // 1000,
            draining=inst.draining,
        )
        return unstructure(welcome)

    def connection_lost(self, session_id: str) -> list[Action]:
        """The session's WebSocket closed. Its attempts keep their leases until they expire."""
        session = self._sessions.get(session_id)
        if session is None or not session.connected:
            return []
        session.connected = False
        self._event("session.disconnected", session=session_id)
        return []

    def handle(self, session_id: str, frame: ClientFrame) -> Handled:
        """Answer one validated request received on *session_id*'s connection."""
        session = self._sessions[session_id]
        try:
            answer, actions = self._handle(session, frame)
        except _Reject as rej:
            if rej.close:
                self._event("session.closed", session=session_id, detail=rej.code)
            return Handled(
                Answer("error", error=(rej.code, rej.message), close=rej.close),
                session_id=session_id,
            )
        return Handled(answer, tuple(actions), session_id)

    def _handle(self, session: _Session, frame: ClientFrame) -> tuple[Answer, list[Action]]:
        if frame.type == "worker.hello":
            raise _Reject("INVALID_FRAME", "worker.hello was already received", close=True)
        if frame.session_id != session.session_id:
            raise _Reject(
                "STALE_SESSION", "the frame does not name this connection's session", close=True
            )
        self._check_live(session)
        self._check_token(session)
        self._check_request_rate(session)
        key = _content_key(frame.type, frame.raw_body)
        op = self._ops.get(frame.message_id)
        if op is not None and (op.kind != frame.type or op.key != key):
            raise _Reject("IDEMPOTENCY_CONFLICT", _MSG["IDEMPOTENCY_CONFLICT"])
        if frame.type == "worker.capacity":
            return self._capacity(session, frame, key)
        if frame.type == "worker.resume":
            return self._resume(session, frame, key)
        if op is not None and op.receipt is not None:
            return self._replay(session, frame, op), []
        if frame.type == "task.start":
            return self._start(session, frame, key)
        if frame.type == "task.renew":
            return self._renew(session, frame, key)
        return self._finish(session, frame, key)

    def _check_live(self, session: _Session) -> None:
        if session.stale:
            raise _Reject("STALE_SESSION", _MSG["STALE_SESSION"], close=True)
        if session.expired or session.expires_at <= self.now_us():
            self._expire(session)
            raise _Reject("STALE_SESSION", _MSG["EXPIRED"], close=True)

    def _expire(self, session: _Session) -> None:
        if not session.expired:
            session.expired = True
            self._event("session.expired", session=session.session_id)

    def _check_token(self, session: _Session) -> None:
        # Every control operation re-checks the credential (the token may have been revoked).
        scopes = self.token_scopes(session.token)
        if scopes is None:
            raise _Reject("UNAUTHENTICATED", _MSG["UNAUTHENTICATED"], close=True)
        if SCOPE_CONSUME not in scopes or queue_scope(session.registration.queue_id) not in scopes:
            raise _Reject("PERMISSION_DENIED", _MSG["PERMISSION_DENIED"], close=True)

    def _check_request_rate(self, session: _Session) -> None:
        if self._req_count is None:
            return
        now = self.now_us()
        window = session.requests
        while window and window[0] <= now - self._req_window_us:
            window.popleft()
        if len(window) >= self._req_count:
            raise _Reject("RATE_LIMITED", _MSG["RATE_LIMITED"])
        window.append(now)

    def _record(
        self,
        message_id: str,
        kind: str,
        key: str,
        receipt: Receipt | None = None,
        attempt_id: str | None = None,
    ) -> None:
        self._ops.setdefault(message_id, _Op(kind, key, receipt, attempt_id))

    # ------------------------------------------------------------------ capacity

    def _capacity(
        self, session: _Session, frame: ClientFrame, key: str
    ) -> tuple[Answer, list[Action]]:
        report = frame.body
        assert isinstance(report, CapacityReport)
        inst = self._instances[session.instance_id]
        # The sequence belongs to the process: it keeps increasing across its sessions.
        if inst.sequence is not None:
            if report.sequence < inst.sequence:
                raise _Reject("STATE_CONFLICT", "capacity sequence is older than the current one")
            if report.sequence == inst.sequence and report != inst.report:
                raise _Reject("STATE_CONFLICT", "capacity sequence was used with other content")
        if inst.draining and not report.drain:
            raise _Reject("STATE_CONFLICT", "drain is persistent for the worker process")
        repeat = inst.sequence == report.sequence
        inst.sequence = report.sequence
        inst.report = report
        if report.drain and not inst.draining:
            inst.draining = True
            self._event("instance.draining", session=session.session_id)
        first = not session.enabled
        session.enabled = True
        session.expires_at = self.now_us() + self.session_us
        if not repeat or first:
            self._event(
                "session.capacity",
                session=session.session_id,
                detail=f"sequence={report.sequence} capacity={report.capacity} "
                f"drain={str(report.drain).lower()}",
            )
        self._record(frame.message_id, frame.type, key)
        return Answer("ack", self._welcome(session)), self._pump()

    # ------------------------------------------------------------------ attempts

    def _find(self, session: _Session, ref: AttemptRef) -> tuple[_Task, _Attempt]:
        # One answer for every mismatch (unknown, other instance, wrong secret): no oracle.
        att = self._attempts.get(ref.attempt_id)
        if (
            att is None
            or att.task_id != ref.task_id
            or att.epoch != ref.epoch
            or att.instance_id != session.instance_id
            or not hmac.compare_digest(att.lease_secret.encode(), ref.lease_secret.encode())
        ):
            raise _Reject("LEASE_LOST", _MSG["LEASE_LOST"])
        return self._tasks[att.task_id], att

    def _lease(self, task: _Task, att: _Attempt, session: _Session) -> dict[str, Any]:
        now = self.now_us()
        active = (
            att.state in _LIVE and now < att.lease_until and att.session_id == session.session_id
        )
        cancel = task.cancel_requested_at
        lease = Lease(
            active=active,
            state=att.state,
            lease_until=to_datetime(att.lease_until),
            server_time=to_datetime(now),
            cancel_requested_at=None if cancel is None else to_datetime(cancel),
        )
        return unstructure(lease)

    def _answer(
        self,
        frame: ClientFrame,
        key: str,
        session: _Session,
        task: _Task,
        att: _Attempt,
        receipt: Receipt,
        *,
        dedup: bool = False,
    ) -> Answer:
        """Remember *receipt* under the request's message_id and build its CommandResult."""
        self._record(frame.message_id, frame.type, key, receipt, att.attempt_id)
        return self._result(task, att, session, receipt, dedup)

    def _result(
        self, task: _Task, att: _Attempt, session: _Session, receipt: Receipt, dedup: bool
    ) -> Answer:
        body = {
            "receipt": unstructure(receipt),
            "lease": self._lease(task, att, session),
            "deduplicated": dedup,
        }
        return Answer("ack", body)

    def _replay(self, session: _Session, frame: ClientFrame, op: _Op) -> Answer:
        # Same operation again: the original receipt, the lease as it is *now* (PROTOCOL §6.5).
        assert op.receipt is not None and op.attempt_id is not None
        att = self._attempts[op.attempt_id]
        task = self._tasks[att.task_id]
        self._event(
            "request.deduplicated",
            task=task,
            attempt=att,
            session=session.session_id,
            detail=frame.type,
        )
        return self._result(task, att, session, op.receipt, True)

    def _resume(
        self, session: _Session, frame: ClientFrame, key: str
    ) -> tuple[Answer, list[Action]]:
        ref = frame.body
        assert isinstance(ref, AttemptRef)
        task, att = self._find(session, ref)
        if (
            att.state in _LIVE
            and self.now_us() < att.lease_until
            and att.session_id != session.session_id
        ):
            old = att.session_id
            att.session_id = session.session_id
            self._event(
                "attempt.resumed",
                task=task,
                attempt=att,
                session=session.session_id,
                old=old,
                new=session.session_id,
            )
        self._record(frame.message_id, frame.type, key)
        return Answer("ack", self._lease(task, att, session)), []

    def _cap(self, base: int, session: _Session, task: _Task, started_at: int | None) -> int:
        """A lease end bounded by the session, the task deadline and the attempt time limit."""
        until = min(base, session.expires_at)
        if task.policy.deadline is not None:
            until = min(until, task.policy.deadline)
        limit = task.policy.attempt_time_limit_us
        if started_at is not None and limit is not None:
            until = min(until, started_at + limit)
        return until

    def _start(
        self, session: _Session, frame: ClientFrame, key: str
    ) -> tuple[Answer, list[Action]]:
        ref = frame.body
        assert isinstance(ref, AttemptRef)
        task, att = self._find(session, ref)
        now = self.now_us()
        if att.state not in _LIVE or now >= att.lease_until:
            raise _Reject("LEASE_LOST", _MSG["LEASE_LOST"])
        if att.state is AttemptState.RUNNING:
            raise _Reject("STATE_CONFLICT", "the attempt was already started")
        if att.session_id != session.session_id:
            raise _Reject("LEASE_LOST", "the attempt belongs to another session; resume it first")
        if self._queues[task.queue_id].paused:
            raise _Reject("UNAVAILABLE", _MSG["PAUSED"])
        until = self._cap(now + self.lease_us, session, task, now)
        if until <= now:
            raise _Reject("LEASE_LOST", _MSG["LEASE_LOST"])
        att.started_at = now
        att.lease_until = until
        self._set_attempt(att, AttemptState.RUNNING)
        self._set_task(task, TaskState.RUNNING)
        receipt = _receipt(Operation.START, task, att, Disposition.APPLIED)
        return self._answer(frame, key, session, task, att, receipt), []

    def _renew(
        self, session: _Session, frame: ClientFrame, key: str
    ) -> tuple[Answer, list[Action]]:
        ref = frame.body
        assert isinstance(ref, AttemptRef)
        task, att = self._find(session, ref)
        now = self.now_us()
        if att.state is AttemptState.LEASED and now < att.lease_until:
            raise _Reject("STATE_CONFLICT", "only a started attempt can be renewed")
        if att.state is not AttemptState.RUNNING or now >= att.lease_until:
            raise _Reject("LEASE_LOST", _MSG["LEASE_LOST"])
        if att.session_id != session.session_id:
            raise _Reject("LEASE_LOST", "the attempt belongs to another session; resume it first")
        if task.cancel_requested_at is None:
            until = self._cap(now + self.lease_us, session, task, att.started_at)
            if until > att.lease_until:  # a renewal never shortens a lease
                att.lease_until = until
                self._event("attempt.renewed", task=task, attempt=att, detail=str(until))
        receipt = _receipt(Operation.RENEW, task, att, Disposition.APPLIED)
        return self._answer(frame, key, session, task, att, receipt), []

    def _finish(
        self, session: _Session, frame: ClientFrame, key: str
    ) -> tuple[Answer, list[Action]]:
        fin = frame.body
        assert isinstance(fin, Finish)
        task, att = self._find(session, fin.ref)
        now = self.now_us()
        fkey = _finish_key(fin)
        if att.finish is not None and att.finish.key == fkey:
            # Same result re-reported under a new message_id: the first applied receipt.
            receipt = att.finish.receipt
            self._event("finish.repeated", task=task, attempt=att, session=session.session_id)
            return self._answer(frame, key, session, task, att, receipt, dedup=True), []
        if fkey in att.evidence:
            receipt = att.evidence[fkey]
            return self._answer(frame, key, session, task, att, receipt, dedup=True), []
        if att.finish is not None:
            return self._evidence(session, frame, key, task, att, fin, fkey, "conflict"), []
        if att.state is AttemptState.RUNNING and now < att.lease_until:
            if fin.outcome is Outcome.CANCELLED and task.cancel_requested_at is None:
                raise _Reject("STATE_CONFLICT", "CANCELLED needs a stored cancel request")
            return self._apply_finish(session, frame, key, task, att, fin, fkey)
        reason = "not_started" if att.started_at is None else "late"
        return self._evidence(session, frame, key, task, att, fin, fkey, reason), []

    def _apply_finish(
        self,
        session: _Session,
        frame: ClientFrame,
        key: str,
        task: _Task,
        att: _Attempt,
        fin: Finish,
        fkey: str,
    ) -> tuple[Answer, list[Action]]:
        now = self.now_us()
        result = _canonical(fin.result)
        att.outcome = fin.outcome
        att.error_code = fin.error_code
        att.result = result
        att.retryable = fin.retryable
        att.finished_at = now
        self._set_attempt(att, _FINISH_STATE[fin.outcome])
        self._release(att)
        if fin.outcome is Outcome.UNKNOWN:
            task.effect_uncertain = True
        if fin.outcome is Outcome.SUCCEEDED:
            self._finalize(task, TaskState.SUCCEEDED, fin.outcome, result, None)
        elif fin.outcome is Outcome.FAILED:
            if fin.retryable is True and self._retry(task):
                pass
            else:
                self._finalize(task, TaskState.FAILED, fin.outcome, result, fin.error_code)
        elif fin.outcome is Outcome.UNKNOWN:
            if not (task.policy.retry_safety is RetrySafety.IDEMPOTENT and self._retry(task)):
                self._finalize(task, TaskState.NEEDS_REVIEW, fin.outcome, result, fin.error_code)
        else:
            self._finalize(task, TaskState.CANCELLED, fin.outcome, result, fin.error_code)
        receipt = _receipt(Operation.FINISH, task, att, Disposition.APPLIED)
        att.finish = _FinishRecord(fkey, receipt)
        return self._answer(frame, key, session, task, att, receipt), self._pump()

    def _evidence(
        self,
        session: _Session,
        frame: ClientFrame,
        key: str,
        task: _Task,
        att: _Attempt,
        fin: Finish,
        fkey: str,
        reason: str,
    ) -> Answer:
        task.evidence.append(
            _Evidence(
                attempt_id=att.attempt_id,
                message_id=frame.message_id,
                outcome=fin.outcome,
                result=_canonical(fin.result),
                error_code=fin.error_code,
                retryable=fin.retryable is True,
                received_at=self.now_us(),
                reason=reason,
            )
        )
        receipt = _receipt(Operation.FINISH, task, att, Disposition.EVIDENCE_ONLY)
        att.evidence[fkey] = receipt
        self._event(
            "finish.evidence", task=task, attempt=att, session=session.session_id, detail=reason
        )
        return self._answer(frame, key, session, task, att, receipt)

    # ------------------------------------------------------------------ transitions

    def _set_task(self, task: _Task, state: TaskState) -> None:
        old = task.state
        task.state = state
        task.revision += 1
        if state is TaskState.WAITING:
            self._waiting[task.task_id] = None
        else:
            self._waiting.pop(task.task_id, None)
        self._event("task.state", task=task, old=old.value, new=state.value)

    def _set_attempt(self, att: _Attempt, state: AttemptState) -> None:
        old = att.state
        att.state = state
        self._event(
            "attempt.state", task_id=att.task_id, attempt=att, old=old.value, new=state.value
        )

    def _release(self, att: _Attempt) -> None:
        # The only place a slot is freed; guarded so nothing is released twice (PROTOCOL §5.9).
        if not att.holds_slot:
            return
        att.holds_slot = False
        att.releases += 1
        self._queues[att.queue_id].in_use -= 1
        self._instances[att.instance_id].held -= 1
        self._event("slot.released", task_id=att.task_id, attempt=att)

    def _finalize(
        self,
        task: _Task,
        state: TaskState,
        outcome: Outcome | None,
        result: str | None,
        error_code: str | None,
    ) -> None:
        # Uncertain history is never overwritten by a later failure or cancel (PROTOCOL §8).
        if task.effect_uncertain and state in (TaskState.FAILED, TaskState.CANCELLED):
            state = TaskState.NEEDS_REVIEW
        task.outcome = outcome
        task.result = result
        task.error_code = error_code
        task.next_run_at = None
        self._set_task(task, state)

    def _retry(self, task: _Task) -> bool:
        """Send *task* back to WAITING with backoff when budget, time and no cancel allow it."""
        if task.cancel_requested_at is not None:
            return False
        policy = task.policy
        if len(task.attempts) >= policy.max_attempts:
            return False
        exponent = max(0, len(task.attempts) - 1)
        delay = min(policy.backoff_max_us, policy.backoff_initial_us * (2 ** min(exponent, 62)))
        at = self.now_us() + delay
        if policy.deadline is not None and at >= policy.deadline:
            return False
        if policy.latest_start is not None and at > policy.latest_start:
            return False
        task.next_run_at = at
        self._set_task(task, TaskState.WAITING)
        return True

    # ------------------------------------------------------------------ dispatch

    def _rate_ok(self, now: int) -> bool:
        if self._rate_count is None:
            return True
        recent = self._assigned_at
        while recent and recent[0] <= now - self._rate_window_us:
            recent.popleft()
        return len(recent) < self._rate_count

    def _eligible_sessions(self) -> list[_Session]:
        now = self.now_us()
        out = []
        for inst in self._instances.values():
            sid = inst.current_session
            if sid is None or inst.draining or inst.report is None:
                continue
            session = self._sessions[sid]
            if (
                not session.connected
                or session.stale
                or session.expired
                or not session.enabled
                or session.expires_at <= now
            ):
                continue
            if self._free(inst, session) <= 0 or not self.push_gate(sid, 0):
                continue
            out.append(session)
        return out

    def _free(self, inst: _Instance, session: _Session) -> int:
        assert inst.report is not None
        # The hello's capacity is the process's total slots; a report never raises it.
        capacity = min(inst.report.capacity, session.registration.capacity)
        return capacity - inst.held

    def _pump(self) -> list[Action]:
        """Assign ready WAITING tasks to sessions with room (PROTOCOL §5.5, §6.1, §10)."""
        now = self.now_us()
        if not self._waiting or not self._rate_ok(now):
            return []
        sessions = self._eligible_sessions()
        if not sessions:
            return []
        ready = [
            self._tasks[tid]
            for tid in self._waiting
            if (self._tasks[tid].next_run_at or 0) <= now and not self._overdue(self._tasks[tid])
        ]
        ready.sort(key=lambda t: (t.next_run_at or 0, t.seq))
        actions: list[Action] = []
        emitted: collections.Counter[str] = collections.Counter()
        for task in ready:
            if not sessions or not self._rate_ok(now):
                break
            queue = self._queues[task.queue_id]
            if queue.paused or (
                queue.max_concurrency is not None and queue.in_use >= queue.max_concurrency
            ):
                continue
            session = self._pick(sessions, task, now)
            if session is None:
                continue
            actions.append(self._assign(task, session, now))
            emitted[session.session_id] += 1
            inst = self._instances[session.instance_id]
            if self._free(inst, session) <= 0 or not self.push_gate(
                session.session_id, emitted[session.session_id]
            ):
                sessions.remove(session)
        return actions

    def _pick(self, sessions: list[_Session], task: _Task, now: int) -> _Session | None:
        best: _Session | None = None
        for session in sessions:
            reg = session.registration
            if reg.queue_id != task.queue_id or not reg.allows(
                task.handler, task.handler_version, task.payload_version
            ):
                continue
            if self._cap(now + self.lease_us, session, task, None) <= now:
                continue
            # Least loaded first (then oldest session): spreads work over processes.
            if best is None or (
                self._instances[session.instance_id].held < self._instances[best.instance_id].held
            ):
                best = session
        return best

    def _assign(self, task: _Task, session: _Session, now: int) -> Push:
        inst = self._instances[session.instance_id]
        task.epoch += 1
        att = _Attempt(
            attempt_id=new_id(),
            task_id=task.task_id,
            number=len(task.attempts) + 1,
            epoch=task.epoch,
            lease_secret=new_secret(),
            instance_id=inst.instance_id,
            session_id=session.session_id,
            queue_id=task.queue_id,
            state=AttemptState.LEASED,
            assigned_at=now,
            lease_until=self._cap(now + self.lease_us, session, task, None),
            holds_slot=True,
        )
        task.attempts.append(att)
        self._attempts[att.attempt_id] = att
        self._queues[task.queue_id].in_use += 1
        inst.held += 1
        task.next_run_at = None
        if self._rate_count is not None:
            self._assigned_at.append(now)
        self._event(
            "attempt.assigned",
            task=task,
            attempt=att,
            session=session.session_id,
            new=AttemptState.LEASED.value,
            detail=f"number={att.number}",
        )
        self._set_task(task, TaskState.LEASED)
        assignment = Assignment(
            task=Task(
                task_id=task.task_id,
                queue_id=task.queue_id,
                namespace_id=self.namespace_id,
                handler=task.handler,
                handler_version=task.handler_version,
                payload_version=task.payload_version,
                payload=json.loads(task.payload),
                state=task.state,
                revision=task.revision,
                attempt=att.number,
                max_attempts=task.policy.max_attempts,
            ),
            attempt_id=att.attempt_id,
            epoch=att.epoch,
            lease_secret=att.lease_secret,
            lease_until=to_datetime(att.lease_until),
            server_time=to_datetime(now),
        )
        return Push(
            session.session_id, "task.assign", unstructure(assignment), task_id=task.task_id
        )

    # ------------------------------------------------------------------ time-driven work

    def next_due(self) -> int | None:
        """The next server time (µs) at which ``run_due`` has something to do."""
        due = self._next_scan
        now = self.now_us()
        self._rate_ok(now)  # prune, so a stale entry never reads as due
        for tid in self._waiting:
            at = self._tasks[tid].next_run_at
            if at is not None and at > now:
                due = min(due, at)
        if (
            self._rate_count is not None
            and self._waiting
            and len(self._assigned_at) >= self._rate_count
        ):
            due = min(due, self._assigned_at[0] + self._rate_window_us)
        return due

    def advance(
        self, seconds: float, commit: Callable[[list[Action]], None] | None = None
    ) -> list[Action]:
        """Move the clock forward by *seconds*, running every due step at its own moment.

        With *commit*, each step's actions are handed over as soon as the step ran (so the
        shell's outbox gates see them) and the returned list is empty.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
            raise ValueError("seconds must be a number >= 0")
        if not math.isfinite(seconds):
            raise ValueError("seconds must be finite")
        target = self.now_us() + round(seconds * _US)
        actions: list[Action] = []
        while True:
            due = self.next_due()
            now = self.now_us()
            if due is None or due > target:
                break
            if due > now:
                self._clock.advance((due - now) / _US)
            actions.extend(self.run_due())
            if commit is not None:
                commit(actions)
                actions = []
        now = self.now_us()
        if target > now:
            self._clock.advance((target - now) / _US)
        actions.extend(self.run_due())
        if commit is not None:
            commit(actions)
            actions = []
        return actions

    def run_due(self) -> list[Action]:
        """Run the recovery scans that are due, then dispatch (PROTOCOL §8)."""
        actions: list[Action] = []
        now = self.now_us()
        while self._next_scan <= now:
            actions.extend(self._scan())
            self._next_scan += SCAN_INTERVAL_US
        actions.extend(self._pump())
        return actions

    def _overdue(self, task: _Task) -> bool:
        now = self.now_us()
        policy = task.policy
        return (policy.deadline is not None and now >= policy.deadline) or (
            policy.latest_start is not None and now > policy.latest_start
        )

    def _scan(self) -> list[Action]:
        now = self.now_us()
        budget = SCAN_BATCH
        actions: list[Action] = []
        expired = sorted(
            (a for a in self._attempts.values() if a.state in _LIVE and a.lease_until <= now),
            key=lambda a: (a.lease_until, a.assigned_at),
        )
        for att in expired[:budget]:
            self._recover(att)
        budget -= min(budget, len(expired))
        if budget:
            overdue = [self._tasks[t] for t in self._waiting if self._overdue(self._tasks[t])]
            for task in overdue[:budget]:
                self._event("recovery.overdue", task=task)
                self._finalize(task, TaskState.FAILED, None, None, "DEADLINE_EXCEEDED")
        for session in self._sessions.values():
            if not session.expired and not session.stale and session.expires_at <= now:
                self._expire(session)
                if session.connected:
                    actions.append(
                        Push(session.session_id, "error", error=("STALE_SESSION", _MSG["EXPIRED"]))
                    )
                    actions.append(CloseSession(session.session_id, "session expired"))
        return actions

    def _recover(self, att: _Attempt) -> None:
        task = self._tasks[att.task_id]
        started = att.state is AttemptState.RUNNING
        att.finished_at = self.now_us()
        self._release(att)
        if started:
            # Started, then lost: the effect may exist (PROTOCOL §8).
            self._set_attempt(att, AttemptState.UNKNOWN)
            task.effect_uncertain = True
            self._event("recovery.lost", task=task, attempt=att)
            if task.policy.retry_safety is RetrySafety.IDEMPOTENT and self._retry(task):
                return
            self._finalize(task, TaskState.NEEDS_REVIEW, None, None, "LEASE_EXPIRED")
            return
        self._set_attempt(att, AttemptState.EXPIRED)
        self._event("recovery.expired", task=task, attempt=att)
        if task.cancel_requested_at is not None:
            self._finalize(task, TaskState.CANCELLED, None, None, None)
        elif not self._retry(task):
            self._finalize(task, TaskState.FAILED, None, None, "LEASE_EXPIRED")

    # ------------------------------------------------------------------ inspection

    def _task(self, task_id: str) -> _Task:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise KeyError(f"unknown task {task_id}") from None

    def task_snapshot(self, task_id: str) -> TaskSnapshot:
        """A frozen snapshot of one task."""
        return _snapshot(self._task(task_id), self.namespace_id)

    def task_snapshots(self) -> tuple[TaskSnapshot, ...]:
        """Every task, in enqueue order."""
        return tuple(_snapshot(t, self.namespace_id) for t in self._tasks.values())

    def session_snapshots(self) -> tuple[SessionSnapshot, ...]:
        """Every session ever opened, oldest first."""
        out = []
        now = self.now_us()
        for s in self._sessions.values():
            inst = self._instances[s.instance_id]
            current = inst.current_session == s.session_id
            out.append(
                SessionSnapshot(
                    session_id=s.session_id,
                    instance_id=s.instance_id,
                    queue_id=s.registration.queue_id,
                    epoch=s.epoch,
                    opened_at=to_datetime(s.opened_at),
                    expires_at=to_datetime(s.expires_at),
                    connected=s.connected,
                    stale=s.stale,
                    expired=s.expired or (not s.stale and s.expires_at <= now),
                    dispatch_enabled=s.enabled,
                    capacity=inst.report.capacity if (current and inst.report) else None,
                    sequence=inst.sequence if current else None,
                    draining=inst.draining,
                    cancellation_notifications=s.registration.cancellation_notifications,
                    held=inst.held,
                )
            )
        return tuple(out)

    def events(self) -> tuple[EventRecord, ...]:
        """Every recorded transition, in order."""
        return tuple(self._events)

    def _event(
        self,
        kind: str,
        *,
        task: _Task | None = None,
        task_id: str | None = None,
        attempt: _Attempt | None = None,
        session: str | None = None,
        old: str | None = None,
        new: str | None = None,
        detail: str = "",
    ) -> None:
        self._events.append(
            EventRecord(
                at=to_datetime(self.now_us()),
                kind=kind,
                task_id=task.task_id if task is not None else task_id,
                attempt_id=attempt.attempt_id if attempt is not None else None,
                session_id=session,
                old=old,
                new=new,
                detail=detail,
            )
        )

    def record(self, kind: str, *, session: str | None = None, detail: str = "") -> None:
        """Record a shell-level event (faults, slow consumers, refused connections)."""
        self._event(kind, session=session, detail=detail)

    def check_invariants(self) -> None:
        """Raise InvariantError listing every global invariant that does not hold."""
        problems = list(self._problems())
        if problems:
            raise InvariantError(problems)

    def _problems(self) -> Iterator[str]:
        queue_use: collections.Counter[str] = collections.Counter()
        held: collections.Counter[str] = collections.Counter()
        for task in self._tasks.values():
            tid = task.task_id
            live = [a for a in task.attempts if a.state in _LIVE]
            running = [a for a in task.attempts if a.state is AttemptState.RUNNING]
            if len(running) > 1:
                yield f"task {tid} has {len(running)} RUNNING attempts"
            if len(live) > 1:
                yield f"task {tid} has {len(live)} live attempts"
            if len(task.attempts) > task.policy.max_attempts:
                yield f"task {tid} has more attempts than max_attempts"
            for i, att in enumerate(task.attempts):
                if att.number != i + 1:
                    yield f"task {tid} attempt numbers are not 1..n"
                if i and att.epoch <= task.attempts[i - 1].epoch:
                    yield f"task {tid} attempt epochs do not increase"
                if att.releases > 1:
                    yield f"attempt {att.attempt_id} released its slot {att.releases} times"
                if att.holds_slot != (att.state in _LIVE):
                    yield f"attempt {att.attempt_id} slot does not match its state"
                if att.holds_slot:
                    queue_use[att.queue_id] += 1
                    held[att.instance_id] += 1
            expected = {
                TaskState.LEASED: AttemptState.LEASED,
                TaskState.RUNNING: AttemptState.RUNNING,
            }.get(task.state)
            if expected is not None:
                if task.current is None or task.current.state is not expected:
                    yield f"task {tid} is {task.state.value} without a matching attempt"
            elif live:
                yield f"task {tid} is {task.state.value} with a live attempt"
            if (task.state is TaskState.WAITING) != (tid in self._waiting):
                yield f"task {tid} WAITING index is out of date"
            if task.effect_uncertain and task.state in (TaskState.FAILED, TaskState.CANCELLED):
                yield f"task {tid} overwrote uncertain history with {task.state.value}"
            if task.state is TaskState.SUCCEEDED and task.outcome is not Outcome.SUCCEEDED:
                yield f"task {tid} SUCCEEDED without a SUCCEEDED finish"
        for queue in self._queues.values():
            if queue.in_use != queue_use[queue.queue_id]:
                yield f"queue {queue.queue_id} counts {queue.in_use} slots, holds {queue_use[queue.queue_id]}"  # noqa: E501
            if queue.in_use < 0:
                yield f"queue {queue.queue_id} over-released"
        for inst in self._instances.values():
            if inst.held != held[inst.instance_id]:
                yield f"instance {inst.instance_id} counts {inst.held} slots, holds {held[inst.instance_id]}"  # noqa: E501
            if inst.held < 0:
                yield f"instance {inst.instance_id} over-released"
            current = [
                s
                for s in self._sessions.values()
                if s.instance_id == inst.instance_id and not s.stale
            ]
            if len(current) > 1:
                yield f"instance {inst.instance_id} has {len(current)} current sessions"


# --------------------------------------------------------------------------- helpers


def _rate_shape(rate: float | None) -> tuple[int, int | None]:
    """(window µs, events per window) for "at most *rate* per second" (None: unlimited)."""
    if rate is None or rate == float("inf"):
        return _US, None
    if rate >= 1:
        return _US, int(rate)
    return round(_US / rate), 1


def _check_concurrency(value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError("max_concurrency must be an int >= 1 or None")


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _snapshot(task: _Task, namespace_id: str) -> TaskSnapshot:
    p = task.policy
    policy = TaskPolicy(
        max_attempts=p.max_attempts,
        backoff_initial=p.backoff_initial_us / _US,
        backoff_max=p.backoff_max_us / _US,
        retry_safety=p.retry_safety,
        deadline=None if p.deadline is None else to_datetime(p.deadline),
        latest_start=None if p.latest_start is None else to_datetime(p.latest_start),
        attempt_time_limit=None
        if p.attempt_time_limit_us is None
        else p.attempt_time_limit_us / _US,
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
            started_at=None if a.started_at is None else to_datetime(a.started_at),
            lease_until=to_datetime(a.lease_until),
            finished_at=None if a.finished_at is None else to_datetime(a.finished_at),
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
        cancel_requested_at=(
            None if task.cancel_requested_at is None else to_datetime(task.cancel_requested_at)
        ),
        effect_uncertain=task.effect_uncertain,
        policy=policy,
        created_at=to_datetime(task.created_at),
        next_run_at=None if task.next_run_at is None else to_datetime(task.next_run_at),
    )
