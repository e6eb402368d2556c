"""What a chaos run checks once it is over, from what the handlers did (recorded on the
worker's side) and what the server stored: the protocol's promises, each broken one a
:class:`Violation`, and the user's own side effects that happened more than once."""

from __future__ import annotations

import collections
import datetime as _dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from ..models import AttemptState
from ._chaos_plan import PlannedFault
from ._snapshots import TaskSnapshot

__all__ = ["DuplicateEffect", "Invocation", "Violation", "check"]

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"})
#: How long past its local lease deadline a handler may go on uncancelled before it counts: the
#: lease watchdog wakes on a schedule, and a handler may return just as it fires.
LEASE_SLACK = 0.3


@attrs.define
class Invocation:
    """One call of a handler, as the run saw it (seconds from the run's start)."""

    task_id: str
    attempt_id: str
    attempt: int
    started: float
    ended: float | None = None
    returned: bool = False
    value: Any = None
    raised: str | None = None
    cancelled: bool = False
    #: When its lease's local deadline was first seen passed with its context not cancelled.
    past_deadline: float | None = None


@attrs.frozen
class Violation:
    """A broken promise: what, of which task and attempt, and the faults fired before it."""

    kind: str
    task_id: str
    attempt_id: str | None
    attempt: int | None
    detail: str
    faults: tuple[str, ...]

    def __str__(self) -> str:
        which = f"task {self.task_id}"
        if self.attempt_id is not None:
            which += f" attempt {self.attempt} ({self.attempt_id})"
        before = "; ".join(self.faults) or "none"
        return f"{self.kind}: {which}: {self.detail} [faults before: {before}]"


@attrs.frozen
class DuplicateEffect:
    """A task whose side effect (``chaos.effect(ctx)``) happened more than once: the handler is
    not idempotent under retries, which is the user's to fix, not the worker's."""

    task_id: str
    key: str
    #: ``(attempt number, attempt id)`` of each time the effect happened.
    attempts: tuple[tuple[int, str], ...]
    faults: tuple[str, ...]

    def __str__(self) -> str:
        times = ", ".join(f"attempt {n} ({a})" for n, a in self.attempts)
        before = "; ".join(self.faults) or "none"
        return (
            f"non-idempotent: task {self.task_id}: effect {self.key!r} happened "
            f"{len(self.attempts)} times ({times}) [faults before: {before}]"
        )


def faults_before(
    fired: Sequence[tuple[float, PlannedFault]], at: float, since: float | None = None, n: int = 4
) -> tuple[str, ...]:
    """The faults fired from *since* to *at* (s from the start; the last *n* of them), each as
    ``t=…s after N kind``; when none fired in that window, the last one before *at*."""
    earlier = [(t, f) for t, f in fired if t <= at]
    window = earlier if since is None else [(t, f) for t, f in earlier if t >= since]
    chosen = window[-n:] if window else earlier[-1:]
    return tuple(f"t={t:.2f}s after {f.after} {f.describe()}" for t, f in chosen)


def _since(moment: _dt.datetime | None, origin: float) -> float | None:
    return None if moment is None else moment.timestamp() - origin


def check(
    ids: Sequence[str],
    tasks: dict[str, TaskSnapshot],
    invocations: Iterable[Invocation],
    effects: Iterable[tuple[str, str, str, int, float]],
    fired: Sequence[tuple[float, PlannedFault]],
    *,
    started_wall: float,
    end: float,
    at_end: Mapping[str, str] | None = None,
) -> tuple[list[Violation], list[DuplicateEffect]]:
    """The violations and duplicate effects of a run that started at *started_wall* (wall
    clock) and ended *end* s later. *effects* are ``(task, attempt, key, number, at)``;
    *at_end* is each task's state when the run stopped waiting (default: as stored at the end:
    stopping the workers may end a task the run gave up on)."""
    out: list[Violation] = []
    calls = list(invocations)
    by_attempt: dict[str, list[Invocation]] = collections.defaultdict(list)
    by_task: dict[str, list[Invocation]] = collections.defaultdict(list)
    for call in calls:
        by_attempt[call.attempt_id].append(call)
        by_task[call.task_id].append(call)

    for task_id in ids:
        snap = tasks[task_id]
        state = snap.state.value if at_end is None else at_end.get(task_id, snap.state.value)
        if state not in TERMINAL:
            last = snap.attempts[-1] if snap.attempts else None
            at = end if last is None else (_since(last.assigned_at, started_wall) or end)
            out.append(
                Violation(
                    "not terminal",
                    task_id,
                    None if last is None else last.attempt_id,
                    None if last is None else last.number,
                    f"still {state} when the run's time limit passed",
                    faults_before(fired, at),
                )
            )

    for attempt_id, runs in by_attempt.items():
        if len(runs) > 1:
            first = runs[0]
            out.append(
                Violation(
                    "ran twice",
                    first.task_id,
                    attempt_id,
                    first.attempt,
                    f"its handler ran {len(runs)} times",
                    faults_before(fired, runs[1].started, first.started),
                )
            )

    for task_id, runs in by_task.items():
        ordered = sorted(runs, key=lambda c: c.started)
        for i, a in enumerate(ordered):
            a_end = end if a.ended is None else a.ended
            for b in ordered[i + 1 :]:
                if b.attempt_id != a.attempt_id and b.started < a_end:
                    out.append(
                        Violation(
                            "overlapping attempts",
                            task_id,
                            b.attempt_id,
                            b.attempt,
                            f"started at {b.started:.2f}s while attempt {a.attempt} "
                            f"({a.attempt_id}) still ran (until {a_end:.2f}s)",
                            faults_before(fired, b.started, a.started),
                        )
                    )

    for call in calls:
        if call.ended is not None and not call.cancelled and call.past_deadline is not None:
            late = call.ended - call.past_deadline
            if late > LEASE_SLACK:
                out.append(
                    Violation(
                        "ran past its lease",
                        call.task_id,
                        call.attempt_id,
                        call.attempt,
                        f"ran {late:.2f}s past its lease deadline and was never cancelled",
                        faults_before(fired, call.past_deadline, call.started),
                    )
                )
        if call.ended is None:
            continue
        stored = tasks.get(call.task_id)
        if stored is not None and not _stored(stored, call):
            what = "its result" if call.returned else f"its outcome ({call.raised})"
            out.append(
                Violation(
                    "result missing",
                    call.task_id,
                    call.attempt_id,
                    call.attempt,
                    f"{what} is on the server neither as the result nor as evidence",
                    faults_before(fired, call.ended, call.started),
                )
            )

    seen: dict[tuple[str, str], list[tuple[int, str, float]]] = collections.defaultdict(list)
    for task_id, attempt_id, key, number, at in effects:
        seen[(task_id, key)].append((number, attempt_id, at))
    dupes = [
        DuplicateEffect(
            task_id,
            key,
            tuple((n, a) for n, a, _ in happened),
            faults_before(fired, happened[1][2], happened[0][2]),
        )
        for (task_id, key), happened in seen.items()
        if len(happened) > 1
    ]
    return out, dupes


def _stored(snap: TaskSnapshot, call: Invocation) -> bool:
    """Whether what *call* ended with reached the server: its attempt's own outcome (for a
    return, the same result), or a finish of that attempt kept as evidence."""
    for evidence in snap.evidence:
        if evidence.attempt_id == call.attempt_id and (
            not call.returned or not _plain(call.value) or evidence.result == call.value
        ):
            return True
    for attempt in snap.attempts:
        if attempt.attempt_id != call.attempt_id or attempt.outcome is None:
            continue
        if not call.returned:
            return True
        if attempt.state is AttemptState.SUCCEEDED:
            return not _plain(call.value) or attempt.result == call.value
    return False


def _plain(value: Any) -> bool:
    """JSON as the handler returned it, comparable with what the server stored (anything else
    goes through the worker's result converter first)."""
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
