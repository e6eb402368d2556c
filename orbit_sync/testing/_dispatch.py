"""Dispatch, timers and recovery: how tasks meet sessions and how time moves the state.

Every WAITING task sits in exactly one place: a backoff heap (not ready yet) or the ready heap
of its (queue, capability), ordered by (ready time, enqueue order): the order PROTOCOL §6.1 and
the mock server have always dispatched in, oldest ready first. An assignment costs a heap pop
plus a look at the eligible sessions' heaps, so it does not depend on how many tasks wait.

Time-driven work runs at its own moment, read from heaps rather than from a scan of everything:

* backoff ends, assignment-rate windows and session expiries fire exactly when due;
* expired leases and WAITING tasks past their deadline are recovered by the 2 s recovery scan,
  at most 100 a batch (PROTOCOL §8), which now only wakes when one of them is due and pops only
  what is due from the lease and deadline heaps (never a walk of every attempt); with
  ``exact_recovery`` they are recovered at their own moment instead;
* ended tasks, sessions and instances are forgotten a retention after they end.

Heap entries are never searched for and removed: an entry is checked when it reaches the top,
and one whose task or attempt has moved on is dropped (or re-armed at its new moment).
"""

from __future__ import annotations

import collections
import heapq
import json
from collections.abc import Callable

from .. import models
from .._codec import unstructure
from .._seconds import seconds as check_seconds
from ..models import (
    Assignment,
    AttemptState,
    Outcome,
    TaskState,
    new_id,
    new_secret,
)
from ._core import FORGET_INSTANCE, FORGET_SESSION, FORGET_TASK, StateCore
from ._records import (
    LIVE,
    MSG,
    SCAN_BATCH,
    SCAN_INTERVAL_US,
    TERMINAL_TASK,
    US,
    Action,
    Attempt,
    CloseSession,
    Instance,
    Push,
    Session,
    Task,
    to_datetime,
)
from ._snapshots import RetrySafety

__all__ = ["Dispatch"]

#: A heap holding more than this many times its live entries (plus slack) is rebuilt.
_COMPACT_FACTOR = 2
_COMPACT_SLACK = 64


def _order(task: Task) -> tuple[int, int]:
    """Dispatch order: ready time, then enqueue order."""
    return (task.next_run_at or 0, task.seq)


class Dispatch(StateCore):
    """Transitions, dispatch, timers, recovery and forgetting (see the module docstring)."""

    # ------------------------------------------------------------------ transitions

    def _set_task(self, task: Task, state: TaskState) -> None:
        old = task.state
        task.state = state
        task.revision += 1
        if state is TaskState.WAITING:
            self._waiting[task.task_id] = None
            self._schedule_waiting(task)
        else:
            self._waiting.pop(task.task_id, None)
            if state in TERMINAL_TASK:
                self._forget_later(self.now_us(), FORGET_TASK, task.task_id)
        self._event("task.state", task=task, old=old.value, new=state.value)

    def _set_attempt(self, att: Attempt, state: AttemptState) -> None:
        old = att.state
        att.state = state
        self._event(
            "attempt.state", task_id=att.task_id, attempt=att, old=old.value, new=state.value
        )

    def _release(self, att: Attempt) -> None:
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
        task: Task,
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

    def _retry(self, task: Task) -> bool:
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

    # ------------------------------------------------------------------ waiting tasks

    def _schedule_waiting(self, task: Task) -> None:
        """File a task that just became WAITING under its ready heap or its backoff."""
        now = self.now_us()
        if task.next_run_at is None:
            task.next_run_at = now
        if task.next_run_at > now:
            self._push_compacting(self._backoff, (task.next_run_at, task.seq, task.task_id))
        else:
            self._push_ready(task)
        overdue_at = task.policy.overdue_at()
        if overdue_at is not None:
            self._push_compacting(self._overdue, (overdue_at, task.seq, task.task_id))

    def _push_compacting(
        self, heap: list[tuple[int, int, str]], entry: tuple[int, int, str]
    ) -> None:
        # Entries of tasks that left WAITING stay until popped; rebuild once they dominate,
        # so a long deadline on many finished tasks cannot grow the heap without bound.
        if len(heap) > _COMPACT_FACTOR * len(self._waiting) + _COMPACT_SLACK:
            heap[:] = [e for e in heap if e[2] in self._waiting]
            heapq.heapify(heap)
        heapq.heappush(heap, entry)

    def _push_ready(self, task: Task) -> None:
        assert task.next_run_at is not None
        heap = self._ready.setdefault(task.key, [])
        heapq.heappush(heap, (task.next_run_at, task.seq, task.task_id))

    def _ready_top(self, key: tuple[str, str, str, str]) -> Task | None:
        """The first ready task under *key*, dropping stale entries on the way."""
        heap = self._ready.get(key)
        while heap:
            task = self._still_waiting(heap[0])
            if task is not None:
                return task
            heapq.heappop(heap)
        self._ready.pop(key, None)
        return None

    def _promote(self, now: int) -> None:
        """Move every task whose backoff ended by *now* to its ready heap."""
        heap = self._backoff
        while heap and heap[0][0] <= now:
            task = self._still_waiting(heapq.heappop(heap))
            if task is not None:
                self._push_ready(task)

    def _still_waiting(self, entry: tuple[int, int, str]) -> Task | None:
        """The task of a ready or backoff entry, unless it moved on since (stale entry)."""
        at, _seq, task_id = entry
        task = self._tasks.get(task_id)
        if task is not None and task.state is TaskState.WAITING and task.next_run_at == at:
            return task
        return None

    @staticmethod
    def _is_overdue(task: Task, now: int) -> bool:
        policy = task.policy
        return (policy.deadline is not None and now >= policy.deadline) or (
            policy.latest_start is not None and now > policy.latest_start
        )

    # ------------------------------------------------------------------ dispatch

    def _eligible_sessions(self, now: int) -> list[Session]:
        out: list[tuple[int, Session]] = []
        for sid in self._connected:
            session = self._sessions[sid]
            inst = self._instances[session.instance_id]
            if (
                inst.current_session != sid
                or inst.draining
                or inst.report is None
                or session.stale
                or session.expired
                or not session.enabled
                or session.expires_at <= now
            ):
                continue
            if self._free(inst, session) <= 0 or not self.push_gate(sid, 0):
                continue
            out.append((inst.order, session))
        # Oldest process first, as load ties are broken by it.
        out.sort(key=lambda pair: pair[0])
        return [session for _, session in out]

    def _free(self, inst: Instance, session: Session) -> int:
        assert inst.report is not None
        # The hello's capacity is the process's total slots; a report never raises it.
        capacity = min(inst.report.capacity, session.registration.capacity)
        return capacity - inst.held

    def _pump(self) -> list[Action]:
        """Assign ready WAITING tasks to sessions with room (PROTOCOL §5.5, §6.1, §10)."""
        now = self.now_us()
        self._promote(now)
        if not self._ready:
            return []
        if not self._assign_rate.allows(now):
            self._rate_wake = self._assign_rate.frees_at(now)
            return []
        sessions = self._eligible_sessions(now)
        actions: list[Action] = []
        emitted: collections.Counter[str] = collections.Counter()
        unplaced: list[Task] = []
        while sessions and self._assign_rate.allows(now):
            task = self._next_ready(sessions)
            if task is None:
                break
            heapq.heappop(self._ready[task.key])
            if self._is_overdue(task, now):
                continue  # never assigned; the recovery scan fails it (PROTOCOL §8)
            session = self._pick(sessions, task, now)
            if session is None:
                unplaced.append(task)
                continue
            actions.append(self._assign(task, session, now))
            emitted[session.session_id] += 1
            inst = self._instances[session.instance_id]
            if self._free(inst, session) <= 0 or not self.push_gate(
                session.session_id, emitted[session.session_id]
            ):
                sessions.remove(session)
        for task in unplaced:
            self._push_ready(task)
        if self._ready and not self._assign_rate.allows(now):
            # Stays due until run_due ran at (or after) it, even once the window has room.
            self._rate_wake = self._assign_rate.frees_at(now)
        return actions

    def _next_ready(self, sessions: list[Session]) -> Task | None:
        """The oldest ready task any of *sessions* could take, in any open queue."""
        best: Task | None = None
        seen: set[tuple[str, str, str, str]] = set()
        for session in sessions:
            for key in session.keys:
                if key in seen:
                    continue
                seen.add(key)
                queue = self._queues[key[0]]
                if queue.paused or (
                    queue.max_concurrency is not None and queue.in_use >= queue.max_concurrency
                ):
                    continue
                task = self._ready_top(key)
                if task is not None and (best is None or _order(task) < _order(best)):
                    best = task
        return best

    def _pick(self, sessions: list[Session], task: Task, now: int) -> Session | None:
        best: Session | None = None
        key = task.key
        for session in sessions:
            if key not in session.keys:
                continue
            if self._cap(now + self.lease_us, session, task, None) <= now:
                continue
            # Least loaded first (then oldest process): spreads work over processes.
            if best is None or (
                self._instances[session.instance_id].held < self._instances[best.instance_id].held
            ):
                best = session
        return best

    def _cap(self, base: int, session: Session, task: Task, started_at: int | None) -> int:
        """A lease end bounded by the session, the task deadline and the attempt time limit."""
        until = min(base, session.expires_at)
        if task.policy.deadline is not None:
            until = min(until, task.policy.deadline)
        limit = task.policy.attempt_time_limit_us
        if started_at is not None and limit is not None:
            until = min(until, started_at + limit)
        return until

    def _assign(self, task: Task, session: Session, now: int) -> Push:
        inst = self._instances[session.instance_id]
        task.epoch += 1
        att = Attempt(
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
        heapq.heappush(self._leases, (att.lease_until, att.assigned_at, att.attempt_id))
        self._queues[task.queue_id].in_use += 1
        inst.held += 1
        task.next_run_at = None
        self._assign_rate.add(now)
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
            task=models.Task(
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
        body = unstructure(assignment)
        return Push(session.session_id, "task.assign", body, task_id=task.task_id)

    # ------------------------------------------------------------------ time-driven work

    def next_due(self) -> int | None:
        """The next server time (µs) at which ``run_due`` has something to do (``None``:
        nothing is scheduled; only a new request or operator call can change that).

        A moment that has passed stays due until ``run_due`` ran: a scheduler that wakes
        late still finds the work waiting for it.
        """
        due: list[int] = []
        if self._backoff:
            due.append(self._backoff[0][0])
        if self._expiries:
            due.append(self._expiries[0][0])
        if self._forget:
            due.append(self._forget[0][0])
        recovery = self._recovery_due()
        if recovery is not None:
            due.append(
                recovery if self.exact_recovery else self._scan_tick(max(recovery, self._next_scan))
            )
        if self._rate_wake is not None:
            due.append(self._rate_wake)
        return min(due) if due else None

    def _recovery_due(self) -> int | None:
        """The earliest moment a lease may have expired or a WAITING task become overdue."""
        tops = [heap[0][0] for heap in (self._leases, self._overdue) if heap]
        return min(tops) if tops else None

    def _scan_tick(self, at: int) -> int:
        """The first recovery-scan tick at or after *at* (ticks are 2 s apart)."""
        steps = -(-(at - self._next_scan) // SCAN_INTERVAL_US)
        return self._next_scan + max(0, steps) * SCAN_INTERVAL_US

    def advance(
        self, seconds: float, commit: Callable[[list[Action]], None] | None = None
    ) -> list[Action]:
        """Move the clock forward by *seconds*, running every due step at its own moment.

        With *commit*, each step's actions are handed over as soon as the step ran (so the
        shell's outbox gates see them) and the returned list is empty.
        """
        target = self.now_us() + round(check_seconds(seconds, "seconds") * US)
        actions: list[Action] = []
        while True:
            due = self.next_due()
            now = self.now_us()
            if due is None or due > target:
                break
            if due > now:
                self._clock.advance((due - now) / US)
            actions.extend(self.run_due())
            if commit is not None:
                commit(actions)
                actions = []
        now = self.now_us()
        if target > now:
            self._clock.advance((target - now) / US)
        actions.extend(self.run_due())
        if commit is not None:
            commit(actions)
            actions = []
        return actions

    def run_due(self) -> list[Action]:
        """Run what is due now: recovery scans, session expiries, forgetting, then dispatch."""
        actions: list[Action] = []
        now = self.now_us()
        if self.exact_recovery:
            # Every due lease and overdue task at once, in batches, whatever the tick.
            while (recovery := self._recovery_due()) is not None and recovery <= now:
                self._scan(now)
        while not self.exact_recovery and self._next_scan <= now:
            recovery = self._recovery_due()
            if recovery is not None and recovery <= self._next_scan:
                self._scan(now)
                self._next_scan += SCAN_INTERVAL_US
            elif recovery is not None and recovery <= now:
                self._next_scan = self._scan_tick(recovery)  # idle ticks did nothing
            else:
                self._next_scan = self._scan_tick(now + 1)
        actions.extend(self._expire_sessions(now))
        self._forget_due(now)
        if self._rate_wake is not None and self._rate_wake <= now:
            self._rate_wake = None
        actions.extend(self._pump())
        return actions

    def _scan(self, now: int) -> None:
        """One recovery scan (PROTOCOL §8): expired leases first, then overdue WAITING tasks."""
        budget = SCAN_BATCH
        leases = self._leases
        while budget and leases and leases[0][0] <= now:
            until, _assigned, attempt_id = heapq.heappop(leases)
            att = self._attempts.get(attempt_id)
            if att is None or att.state not in LIVE:
                continue
            if att.lease_until != until:  # started or renewed since: re-arm at the new end
                heapq.heappush(leases, (att.lease_until, att.assigned_at, attempt_id))
                continue
            self._recover(att)
            budget -= 1
        overdue = self._overdue
        while budget and overdue and overdue[0][0] <= now:
            _at, _seq, task_id = heapq.heappop(overdue)
            task = self._tasks.get(task_id)
            if task is None or task.state is not TaskState.WAITING:
                continue
            self._event("recovery.overdue", task=task)
            self._finalize(task, TaskState.FAILED, None, None, "DEADLINE_EXCEEDED")
            budget -= 1

    def _recover(self, att: Attempt) -> None:
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

    def _expire_sessions(self, now: int) -> list[Action]:
        """Expire every session whose window ended by *now*, at that moment."""
        actions: list[Action] = []
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _at, session_id = heapq.heappop(heap)
            session = self._sessions.get(session_id)
            if session is None or session.expired or session.stale:
                continue
            if session.expires_at > now:  # renewed since: re-arm at the new end
                heapq.heappush(heap, (session.expires_at, session_id))
                continue
            self._expire(session)
            if session.connected:
                actions.append(
                    Push(session.session_id, "error", error=("STALE_SESSION", MSG["EXPIRED"]))
                )
                actions.append(CloseSession(session.session_id, "session expired"))
        return actions

    # ------------------------------------------------------------------ forgetting

    def _forget_due(self, now: int) -> None:
        """Forget the ended records whose retention ran out, and receipts past their window."""
        self._prune_ops(now)
        heap = self._forget
        while heap and heap[0][0] <= now:
            _at, kind, ident = heapq.heappop(heap)
            if kind == FORGET_TASK:
                task = self._tasks.pop(ident, None)
                if task is not None:
                    for att in task.attempts:
                        self._attempts.pop(att.attempt_id, None)
            elif kind == FORGET_SESSION:
                session = self._sessions.pop(ident, None)
                if session is None:
                    continue
                self._connected.pop(ident, None)
                inst = self._instances.get(session.instance_id)
                if inst is not None:
                    inst.sessions.discard(ident)
                    if inst.current_session == ident:
                        inst.current_session = None
                    self._forget_instance(inst, now)
            else:
                inst = self._instances.get(ident)
                if inst is not None:
                    self._forget_instance(inst, now)

    def _forget_instance(self, inst: Instance, now: int) -> None:
        # A process is forgotten with its last session, once it holds no slot.
        if inst.sessions:
            return
        if inst.held:
            self._forget_later(now, FORGET_INSTANCE, inst.instance_id)
            return
        self._forget_op(inst.capacity_op)
        del self._instances[inst.instance_id]
