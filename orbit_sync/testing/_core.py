"""The state machine's storage, server time, event ring and receipt window.

:class:`StateCore` holds every table of the mock server and the few operations all its parts
share; dispatch and recovery (``_dispatch``), request handling (``_requests``) and inspection
(``_inspect``) build on it, and :class:`~._state.OrbitState` puts them together.

Memory stays bounded on a long-running server:

* a request's receipt (its ``message_id``) is remembered for the idempotency window, then
  forgotten, oldest first, and never more than ``max_receipts`` of them; a capacity report's
  receipt only until the process's next report, and a resume's only while its session lasts
  (both are superseded: see ``docs/mock-server.md``);
* the event log is a ring of ``event_log_size`` records;
* ended tasks, sessions and instances are forgotten a retention after they end (``_dispatch``).
"""

from __future__ import annotations

import collections
import heapq
import hmac
from collections.abc import Callable

from ..models import Receipt, new_id
from ._clock import ServerTime
from ._records import (
    SCAN_INTERVAL_US,
    US,
    Attempt,
    Instance,
    Op,
    Queue,
    RateWindow,
    ReadyKey,
    Session,
    Task,
    to_datetime,
)
from ._snapshots import EventRecord

#: One event as recorded: (at µs, kind, task_id, attempt_id, session_id, old, new, detail).
_RawEvent = tuple[int, str, str | None, str | None, str | None, str | None, str | None, str]

__all__ = ["StateCore"]

#: What the forget heap names: an ended task, session or instance.
FORGET_TASK, FORGET_SESSION, FORGET_INSTANCE = 0, 1, 2


class StateCore:
    """Tables, clock, events and receipts shared by every part of the state machine."""

    def __init__(
        self,
        *,
        clock: ServerTime,
        lease_us: int,
        session_us: int,
        assignment_rate: float | None,
        request_rate: float | None,
        retention_us: int | None,
        idempotency_us: int,
        max_receipts: int,
        event_log_size: int,
        exact_recovery: bool = False,
    ) -> None:
        self._clock = clock
        self.lease_us = lease_us
        self.session_us = session_us
        #: Ended tasks/sessions/instances are forgotten this long after they end (None: never).
        self.retention_us = retention_us
        #: How long a request's message_id (and its receipt) is remembered.
        self.idempotency_us = idempotency_us
        #: Recover expired leases and overdue tasks at their own moment, not on the 2 s scan.
        self.exact_recovery = exact_recovery
        #: At most this many receipts are kept; past it the oldest is forgotten first.
        self.max_receipts = max_receipts
        #: Receipts forgotten to stay under max_receipts (not counting the window's).
        self.receipts_evicted = 0
        self._assign_rate = RateWindow(assignment_rate)
        self._request_rate = request_rate
        self.namespace_id = new_id()
        self._tokens: dict[str, frozenset[str]] = {}
        self._queues: dict[str, Queue] = {}
        self._instances: dict[str, Instance] = {}
        self._instances_made = 0
        self._sessions: dict[str, Session] = {}
        self._connected: dict[str, None] = {}  # connected session ids, oldest first
        self._tasks: dict[str, Task] = {}
        self._attempts: dict[str, Attempt] = {}
        self._waiting: dict[str, None] = {}  # WAITING task ids
        # Insertion order is time order (server time never goes back), so the oldest receipt
        # is always first: pruning and eviction are O(1) each, and a superseded receipt can be
        # dropped from the middle.
        self._ops: collections.OrderedDict[str, Op] = collections.OrderedDict()
        # The ring of events as plain tuples (stamped in microseconds): recording one is on
        # every request's path, while EventRecord objects are only needed when someone reads
        # the log, so events() builds them then, once each (_event_records keeps them).
        self._events: collections.deque[_RawEvent] = collections.deque(maxlen=event_log_size)
        self._event_records: collections.deque[EventRecord] = collections.deque(
            maxlen=event_log_size
        )
        self._events_total = 0
        self._seq = 0
        # Dispatch and timer heaps (owned by _dispatch; entries are checked when popped, so a
        # task or attempt that moved on leaves a stale entry behind instead of a search).
        #: Ready WAITING tasks per (queue, capability): (ready_at, seq, task_id).
        self._ready: dict[ReadyKey, list[tuple[int, int, str]]] = {}
        #: WAITING tasks in backoff: (next_run_at, seq, task_id).
        self._backoff: list[tuple[int, int, str]] = []
        #: WAITING tasks with a deadline or latest start: (overdue_at, seq, task_id).
        self._overdue: list[tuple[int, int, str]] = []
        #: Live attempts by lease end: (lease_until, assigned_at, attempt_id).
        self._leases: list[tuple[int, int, str]] = []
        #: Sessions by expiry: (expires_at, session_id).
        self._expiries: list[tuple[int, str]] = []
        #: Ended records to forget: (at, kind, id).
        self._forget: list[tuple[int, int, str]] = []
        #: When a dispatch held back by the assignment rate may go on (None: not held back).
        self._rate_wake: int | None = None
        self._next_scan = self.now_us() + SCAN_INTERVAL_US
        #: The shell's answer to "may I push to this session now, *n* pushes already emitted
        #: by this dispatch round?" (room left in its outbox).
        self.push_gate: Callable[[str, int], bool] = lambda _sid, _n: True

    # ------------------------------------------------------------------ time

    def now_us(self) -> int:
        """Server time in integer microseconds."""
        return round(self._clock.now() * US)

    # ------------------------------------------------------------------ lookups

    def token_scopes(self, token: str) -> frozenset[str] | None:
        """The scopes of *token*, or ``None`` when it is unknown."""
        for known, scopes in self._tokens.items():
            # Constant-time per comparison: a token is a credential.
            if hmac.compare_digest(known.encode(), token.encode()):
                return scopes
        return None

    def _task(self, task_id: str) -> Task:
        try:
            return self._tasks[task_id]
        except KeyError:
            raise KeyError(f"unknown task {task_id}") from None

    # ------------------------------------------------------------------ events

    def _event(
        self,
        kind: str,
        *,
        task: Task | None = None,
        task_id: str | None = None,
        attempt: Attempt | None = None,
        session: str | None = None,
        old: str | None = None,
        new: str | None = None,
        detail: str = "",
    ) -> None:
        self._events_total += 1
        self._events.append(
            (
                self.now_us(),
                kind,
                task.task_id if task is not None else task_id,
                attempt.attempt_id if attempt is not None else None,
                session,
                old,
                new,
                detail,
            )
        )

    def _event_log(self) -> collections.deque[EventRecord]:
        """The ring as EventRecords, building those recorded since the last call."""
        records, raw = self._event_records, self._events
        while raw:
            at, kind, task_id, attempt_id, session, old, new, detail = raw.popleft()
            records.append(
                EventRecord(
                    at=to_datetime(at),
                    kind=kind,
                    task_id=task_id,
                    attempt_id=attempt_id,
                    session_id=session,
                    old=old,
                    new=new,
                    detail=detail,
                )
            )
        return records

    # ------------------------------------------------------------------ receipts

    def _record(
        self,
        message_id: str,
        kind: str,
        key: str,
        receipt: Receipt | None = None,
        attempt_id: str | None = None,
    ) -> bool:
        """Remember what *message_id* named, for the idempotency window; False if it already
        was."""
        now = self.now_us()
        ops = self._ops
        self._prune_ops(now)
        if message_id in ops:
            return False
        ops[message_id] = Op(kind, key, receipt, attempt_id, now)
        if len(ops) > self.max_receipts:
            ops.popitem(last=False)
            self.receipts_evicted += 1
        return True

    def _prune_ops(self, now: int) -> None:
        ops = self._ops
        horizon = now - self.idempotency_us
        while ops:
            oldest = next(iter(ops.values()))
            if oldest.at > horizon:
                break
            ops.popitem(last=False)

    def _forget_op(self, message_id: str | None) -> None:
        """Drop a superseded receipt before its window ends."""
        if message_id is not None:
            self._ops.pop(message_id, None)

    # ------------------------------------------------------------------ sessions

    def _expire(self, session: Session) -> None:
        if not session.expired:
            session.expired = True
            self._event("session.expired", session=session.session_id)
            self._maybe_ended(session)

    def _maybe_ended(self, session: Session) -> None:
        """Schedule *session* to be forgotten once it is both over and disconnected."""
        if session.ended_at is not None or session.connected:
            return
        if not (session.stale or session.expired):
            return
        now = self.now_us()
        session.ended_at = now
        # A resume re-binds attempts to *this* session: re-sent under a later session it is a
        # new resume whatever its message_id, so its receipt is of no use once the session ended.
        for message_id in session.resume_ops:
            self._forget_op(message_id)
        session.resume_ops.clear()
        self._forget_later(now, FORGET_SESSION, session.session_id)

    def _forget_later(self, now: int, kind: int, ident: str) -> None:
        if self.retention_us is not None:
            heapq.heappush(self._forget, (now + self.retention_us, kind, ident))
