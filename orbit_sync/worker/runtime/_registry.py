"""The attempts the worker holds and the parts its threads share: :class:`Attempt` (one
assignment as tracked, with its machine), :class:`Registry` (the live attempts, counters and the
stop request), :class:`LinkControls` (the link and the connection thread that drives it) and
:class:`WorkerThreads` (the worker's own threads)."""

from __future__ import annotations

import collections
import threading

import attrs

from ...client import DialCut
from ...models import Assignment, AttemptRef
from .._context import Handler, TaskContext
from .._listeners import AttemptEvent, AttemptInfo
from ..core._machine import AttemptMachine, Phase
from ..core._time_limits import Interruptible
from ._link import Link, Wakeup
from ._pool import HandlerThreads
from ._watchdog import Timers, WatchdogThread

__all__ = ["Attempt", "LinkControls", "Registry", "WorkerThreads", "attempt_event"]


class Attempt:
    """One assignment as the worker tracks it: its context, its handler, and its state machine
    (:class:`._machine.AttemptMachine`), which is read and changed only under ``lock``."""

    __slots__ = (
        "ctx",
        "handler",
        "limit_at",
        "lock",
        "machine",
        "ref",
        "running_on",
        "task",
    )

    def __init__(
        self, assignment: Assignment, ctx: TaskContext, handler: Handler, machine: AttemptMachine
    ) -> None:
        self.task = assignment.task
        self.ref: AttemptRef = machine.ref  # the one the machine sends (built once)
        self.ctx = ctx
        self.handler = handler
        self.machine = machine
        time_limit = machine.time_limit
        self.lock = threading.Lock()
        #: The handler's thread, to interrupt at its time limit (thread handlers with one).
        self.running_on = (
            None if time_limit is None or time_limit.in_process else Interruptible(self.lock)
        )
        #: When the handler reaches its time limit (clock time; set as it starts).
        self.limit_at = 0.0

    @property
    def id(self) -> str:
        return self.ref.attempt_id

    @property
    def info(self) -> AttemptInfo:
        return AttemptInfo(self.task.task_id, self.ref.attempt_id, self.task.handler)

    def phase(self) -> Phase:
        with self.lock:
            return self.machine.phase


class Registry:
    """The attempts the worker holds, its counters and its stop request, under one condition
    variable (which the shutdown thread waits on once a stop was requested). Attempt locks are
    taken after it, never before."""

    def __init__(self) -> None:
        #: Entered directly where nothing waits: the condition's ``__enter__`` is Python code.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.attempts: dict[str, Attempt] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.unreported: list[AttemptInfo] = []
        self.running = 0
        #: Attempts finished UNKNOWN while their handler still runs: each holds a slot.
        self.stuck: dict[str, AttemptInfo] = {}
        self.stop_requested = False
        #: When the drain ends (clock time), once a stop was requested.
        self.drain_deadline = 0.0
        self.error: BaseException | None = None
        #: The shutdown's drain is over (its cancel phase began): an assignment arriving now
        #: starts with its context cancelled (docs/architecture.md, "Threads and their owners").
        self.drain_over = False

    def get(self, attempt_id: str) -> Attempt | None:
        with self.lock:
            return self.attempts.get(attempt_id)


@attrs.frozen
class LinkControls:
    """The link and the connection thread that drives it: *wake* wakes that thread (a request
    was kept, a capacity report is due, the worker stops); *dial_cut* ends its dial in progress."""

    link: Link
    wake: Wakeup
    dial_cut: DialCut

    def close_link(self) -> None:
        """Close the link: each request it kept runs now and gives up."""
        for job in self.link.close():
            job()


@attrs.frozen
class WorkerThreads:
    """The worker's own threads: the handler threads (*pool*); the lease *watchdog*'s thread,
    which also fires the handlers' time limits (*timers*); and those ``Worker.start`` starts
    (*started*: connection, shutdown, outbox replay)."""

    pool: HandlerThreads
    watchdog: WatchdogThread
    timers: Timers
    started: list[threading.Thread] = attrs.field(factory=list)

    def owns_current(self) -> bool:
        """Is this one of the worker's own threads?"""
        return threading.current_thread() in self.started or self.pool.owns_current_thread()


def attempt_event(att: Attempt) -> AttemptEvent:
    task = att.task
    return AttemptEvent(task.task_id, att.id, task.handler, task.attempt, task.max_attempts)
