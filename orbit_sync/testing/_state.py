"""The mock Orbit server's state machine: PROTOCOL §5-§11, with no sockets and no threads.

Everything here is plain Python driven by three kinds of input:

* a validated client request (``hello`` / ``handle``) from the WebSocket shell,
* an operator call (``enqueue``, ``request_cancel``, ``pause_queue``, ...),
* time (``run_due``), read from an injected clock.

Each call returns what the shell must do next: an answer for the requesting connection and an
ordered list of actions (frames to push to other sessions, sessions to close). The caller holds
one lock around every call; this module is not thread-safe by itself, on purpose, so the rules
can be tested deterministically.

:class:`OrbitState` is assembled from parts with one concern each: records and snapshots
(``_records``), storage, events and receipts (``_core``), dispatch, timers and recovery
(``_dispatch``), worker requests (``_requests``) and inspection and invariants (``_inspect``);
this module adds the operator API.

Bounded state: a request's ``message_id`` is remembered for ``idempotency_window`` seconds
(10 minutes by default; at most ``max_receipts`` of them, 100,000 by default), ended tasks,
sessions and instances for ``retention`` seconds after they end (1 hour by default), and the
event log keeps the last ``event_log_size`` events.
"""

from __future__ import annotations

import datetime as _dt
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from .. import _json
from .._codec import unstructure
from ..clock import Clock
from ..models import (
    ID_RE,
    MAX_LEASE_WINDOW,
    MAX_SESSION_WINDOW,
    CancelNotice,
    Capability,
    TaskState,
    new_id,
)
from ._clock import ServerTime
from ._inspect import Inspection
from ._options import TOKEN_RE
from ._records import (
    ASSIGN_OVERHEAD,
    ENQUEUE_KEYWORDS,
    EPOCH,
    LIVE,
    SCOPE_CONNECT,
    SCOPE_CONSUME,
    TERMINAL_TASK,
    US,
    Action,
    Answer,
    Attempt,
    CloseSession,
    Handled,
    InvariantError,
    Policy,
    Push,
    Queue,
    Task,
    check_concurrency,
    queue_scope,
    seconds_us,
    to_datetime,
)
from ._requests import Requests
from ._snapshots import RetrySafety

__all__ = [
    "DEFAULT_EVENT_LOG_SIZE",
    "DEFAULT_IDEMPOTENCY_WINDOW",
    "DEFAULT_MAX_RECEIPTS",
    "DEFAULT_RETENTION",
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
    "to_datetime",
]

#: What an ``Authorization: Bearer`` token may look like here (visible ASCII, no spaces).
#: How long a request's message_id (and its receipt) is remembered, in seconds: longer than
#: the longest session window (5 min) plus the longest lease (2 min), so an operation re-sent
#: after any reconnect within a session's life is still recognized (PROTOCOL §7).
DEFAULT_IDEMPOTENCY_WINDOW = 600.0
#: At most this many receipts are kept at once, whatever the window (the oldest go first).
DEFAULT_MAX_RECEIPTS = 100_000
#: How long an ended task (with its attempts), session or worker process stays inspectable.
DEFAULT_RETENTION = 3600.0
#: How many events the event log keeps (the oldest are dropped first).
DEFAULT_EVENT_LOG_SIZE = 100_000


class OrbitState(Requests, Inspection):
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
        idempotency_window: float = DEFAULT_IDEMPOTENCY_WINDOW,
        retention: float | None = DEFAULT_RETENTION,
        event_log_size: int = DEFAULT_EVENT_LOG_SIZE,
        max_receipts: int = DEFAULT_MAX_RECEIPTS,
        exact_recovery: bool = False,
        queue_id: str | None = None,
    ) -> None:
        """*queue_id*: the default queue's id (a fresh random one unless given: a server
        restarted with the same id, and tokens, keeps its workers' registrations valid);
        *idempotency_window*: seconds a ``message_id`` is remembered (at most
        *max_receipts* of them, the oldest forgotten first); *retention*: seconds
        an ended task, session or instance is kept (``None``: forever); *event_log_size*: how
        many events the log keeps; *exact_recovery*: recover an expired lease or an overdue
        WAITING task at its own moment instead of on PROTOCOL §8's 2 s scan."""
        if not 1.0 <= lease_duration <= MAX_LEASE_WINDOW:
            raise ValueError(f"lease_duration must be between 1 and {MAX_LEASE_WINDOW} seconds")
        if not 0.0 < session_window <= MAX_SESSION_WINDOW:
            raise ValueError(f"session_window must be in (0, {MAX_SESSION_WINDOW}] seconds")
        if assignment_rate is not None and not assignment_rate > 0:
            raise ValueError("assignment_rate must be > 0 (or None for no limit)")
        if request_rate is not None and not request_rate > 0:
            raise ValueError("request_rate must be > 0 (or None for no limit)")
        window = seconds_us("idempotency_window", idempotency_window, allow_none=False)
        assert window is not None
        if window == 0:
            raise ValueError("idempotency_window must be > 0")
        keep = seconds_us("retention", retention)
        if type(event_log_size) is not int or event_log_size < 1:
            raise ValueError("event_log_size must be an int >= 1")
        if type(max_receipts) is not int or max_receipts < 1:
            raise ValueError("max_receipts must be an int >= 1")
        super().__init__(
            clock=ServerTime(clock),
            lease_us=round(lease_duration * US),
            session_us=round(session_window * US),
            assignment_rate=assignment_rate,
            request_rate=request_rate,
            retention_us=keep,
            idempotency_us=window,
            max_receipts=max_receipts,
            event_log_size=event_log_size,
            exact_recovery=bool(exact_recovery),
        )
        self.default_queue = self._new_queue(queue_id, max_concurrency, paused=False)

    # ------------------------------------------------------------------ operator API

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
        elif type(token) is not str or not TOKEN_RE.fullmatch(token):
            # Never echo the value: it is a credential.
            raise ValueError("token must be 1-512 characters of the bearer-token set (no spaces)")
        elif self.token_scopes(token) is not None:
            raise ValueError("that token is already registered")
        self._tokens[token] = scope_set
        return token

    def revoke_token(self, token: str) -> None:
        """Make *token* invalid: new connections get 401, live sessions UNAUTHENTICATED."""
        self._tokens.pop(token, None)

    def add_queue(self, *, max_concurrency: int | None = None, paused: bool = False) -> str:
        """Create a queue; returns its id."""
        return self._new_queue(None, max_concurrency, paused=paused)

    def _new_queue(self, queue_id: str | None, max_concurrency: int | None, *, paused: bool) -> str:
        check_concurrency(max_concurrency)
        if queue_id is None:
            queue_id = new_id()
        elif type(queue_id) is not str or not ID_RE.fullmatch(queue_id):
            raise ValueError("queue_id must be 32 lowercase hex characters")
        self._queues[queue_id] = Queue(queue_id, max_concurrency, paused)
        self._event("queue.created", detail=queue_id)
        return queue_id

    def _queue(self, queue_id: str | None) -> Queue:
        qid = self.default_queue if queue_id is None else queue_id
        try:
            return self._queues[qid]
        except KeyError:
            raise KeyError(f"unknown queue {qid}") from None

    def set_max_concurrency(
        self, queue_id: str | None, max_concurrency: int | None
    ) -> list[Action]:
        """Change a queue's concurrency limit (``None``: unlimited)."""
        check_concurrency(max_concurrency)
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
        tasks: list[Task] = []
        for index, spec in enumerate(specs):
            if not isinstance(spec, Mapping):
                raise TypeError(f"spec {index} must be a mapping")
            args = dict(spec)
            try:
                handler = args.pop("handler")
                payload = args.pop("payload")
            except KeyError as exc:
                raise ValueError(f"spec {index} lacks {exc.args[0]!r}") from None
            unknown = set(args) - ENQUEUE_KEYWORDS
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
    ) -> Task:
        """Validate one enqueue and build its task, without storing it."""
        # Capability validates handler and versions exactly as the wire does.
        cap = Capability(handler, handler_version, payload_version)
        queue = self._queue(queue_id)
        if payload is None:
            raise ValueError("payload must be JSON other than null")
        text = _json.dumps(payload)  # refuses NaN, surrogates, non-JSON values
        if len(text.encode("utf-8")) > _json.MAX_FRAME_BYTES - ASSIGN_OVERHEAD:
            raise ValueError("payload is too large to fit one assignment frame")
        _json.loads(text)  # what a strict peer will accept (int keys, huge ints)
        if type(max_attempts) is not int or not 1 <= max_attempts <= 1000:
            raise ValueError("max_attempts must be an int between 1 and 1000")
        initial = seconds_us("backoff_initial", backoff_initial, allow_none=False)
        maximum = seconds_us("backoff_max", backoff_max, allow_none=False)
        assert initial is not None and maximum is not None
        if maximum < initial:
            raise ValueError("backoff_max must be >= backoff_initial")
        safety = RetrySafety(retry_safety)
        now = self.now_us()
        limit = seconds_us("attempt_time_limit", attempt_time_limit)
        if limit == 0:
            raise ValueError("attempt_time_limit must be > 0")
        policy = Policy(
            max_attempts=max_attempts,
            backoff_initial_us=initial,
            backoff_max_us=maximum,
            retry_safety=safety,
            deadline=self._moment("deadline", deadline, now),
            latest_start=self._moment("latest_start", latest_start, now),
            attempt_time_limit_us=limit,
        )
        return Task(
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

    def _add_task(self, task: Task) -> None:
        self._seq += 1
        task.seq = self._seq
        self._tasks[task.task_id] = task
        self._waiting[task.task_id] = None
        self._schedule_waiting(task)
        self._event("task.enqueued", task=task, new=TaskState.WAITING.value, detail=task.handler)

    @staticmethod
    def _moment(name: str, value: float | _dt.datetime | None, now: int) -> int | None:
        if value is None:
            return None
        if isinstance(value, _dt.datetime):
            if value.utcoffset() is None:
                raise ValueError(f"{name} must be an aware datetime")
            delta = value - EPOCH
            return delta // _dt.timedelta(microseconds=1)
        rel = seconds_us(name, value)
        assert rel is not None
        return now + rel

    def request_cancel(self, task_id: str) -> list[Action]:
        """Store a cancel request (PROTOCOL §9). A no-op on a finished or already-cancelled task."""
        task = self._task(task_id)
        if task.state in TERMINAL_TASK or task.cancel_requested_at is not None:
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
        if att is not None and att.state in LIVE:
            actions.extend(self._cancel_push(task, att))
        actions.extend(self._pump())
        return actions

    def _cancel_push(self, task: Task, att: Attempt) -> list[Action]:
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
