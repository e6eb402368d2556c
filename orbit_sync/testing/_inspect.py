"""Inspection of the state machine: frozen snapshots, the event log and global invariants."""

from __future__ import annotations

import collections
from collections.abc import Collection, Iterator

from ..models import AttemptState, Outcome, TaskState
from ._core import StateCore
from ._records import LIVE, InvariantError, snapshot_task, to_datetime
from ._snapshots import EventLog, SessionSnapshot, TaskSnapshot

__all__ = ["Inspection"]


class Inspection(StateCore):
    """Read-only views of the state, and the invariants every transition must keep."""

    def task_snapshot(self, task_id: str) -> TaskSnapshot:
        """A frozen snapshot of one task."""
        return snapshot_task(self._task(task_id), self.namespace_id)

    def task_snapshots(self) -> tuple[TaskSnapshot, ...]:
        """Every task kept, in enqueue order (an ended one is forgotten a retention later)."""
        return tuple(snapshot_task(t, self.namespace_id) for t in self._tasks.values())

    def task_page(
        self,
        *,
        states: Collection[TaskState] | None = None,
        queue_id: str | None = None,
        handler: str | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> tuple[tuple[TaskSnapshot, ...], int | None]:
        """Up to *limit* snapshots of the tasks that match, in enqueue order, from the first
        enqueued after cursor *after* (0: from the start); with the cursor of the next page, or
        ``None`` when no matching task follows. Only the page is snapshotted."""
        page: list[TaskSnapshot] = []
        last = 0
        for task in self._tasks.values():  # enqueue order: seq increases
            if (
                task.seq <= after
                or (states is not None and task.state not in states)
                or (queue_id is not None and task.queue_id != queue_id)
                or (handler is not None and task.handler != handler)
            ):
                continue
            if len(page) == limit:
                return tuple(page), last
            page.append(snapshot_task(task, self.namespace_id))
            last = task.seq
        return tuple(page), None

    def session_snapshots(self) -> tuple[SessionSnapshot, ...]:
        """Every session kept, oldest first (an ended one is forgotten a retention later)."""
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

    def events(self) -> EventLog:
        """The recorded transitions still in the ring, in order; ``.dropped`` counts the older
        ones the ring let go (``.truncated`` is true when there are any)."""
        records = self._event_log()
        return EventLog(records, self._events_total - len(records))

    def bounds(self) -> dict[str, float | int | bool | None]:
        """The state bounds in force: ``idempotency_window``, ``retention`` (seconds; ``None``:
        forever), ``max_receipts``, ``event_log_size``, ``exact_recovery``; and how full they
        are: ``receipts``, ``receipts_evicted`` (forgotten early to stay under the cap),
        ``tasks``, ``attempts``, ``sessions``, ``instances`` (worker processes) and ``timers``
        (scheduled wake-ups: retries, deadlines, lease and session expiries, forgetting)."""
        return {
            "idempotency_window": self.idempotency_us / 1_000_000,
            "retention": None if self.retention_us is None else self.retention_us / 1_000_000,
            "max_receipts": self.max_receipts,
            "event_log_size": self._event_records.maxlen,
            "exact_recovery": self.exact_recovery,
            "receipts": len(self._ops),
            "receipts_evicted": self.receipts_evicted,
            "tasks": len(self._tasks),
            "attempts": len(self._attempts),
            "sessions": len(self._sessions),
            "instances": len(self._instances),
            "timers": sum(map(len, self._ready.values()))
            + len(self._backoff)
            + len(self._overdue)
            + len(self._leases)
            + len(self._expiries)
            + len(self._forget),
        }

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
            live = [a for a in task.attempts if a.state in LIVE]
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
                if att.holds_slot != (att.state in LIVE):
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
            current = [sid for sid in inst.sessions if not self._sessions[sid].stale]
            if len(current) > 1:
                yield f"instance {inst.instance_id} has {len(current)} current sessions"
        for sid, session in self._sessions.items():
            if session.connected != (sid in self._connected):
                yield f"session {sid} connected index is out of date"
            if sid not in self._instances[session.instance_id].sessions:
                yield f"session {sid} is not listed by its instance"
