"""Admission: the server's pushes fed to the attempts' machines: :meth:`Admission.dispatch`
each ``task.assign`` on the handler thread that took it, :meth:`Admission.on_cancel` each
``task.cancel`` on the reader. A stopping worker starts what reaches it too: it cannot hand an
assignment back (§5.7), so past the drain it starts with its context cancelled.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from ...models import Assignment, CancelNotice, new_message_id
from .._context import TaskContext, worker_log
from ..core._machine import AttemptMachine, Skipped
from ..runtime._registry import Attempt, attempt_event
from ..runtime._shell import AttemptShell

__all__ = ["SEEN_LIMIT", "Admission"]

#: Attempt ids remembered to refuse a repeated assignment (a handler runs once per attempt).
SEEN_LIMIT = 65_536


class Admission:
    """The intake of the worker's connections and their ``on_cancel`` callback."""

    def __init__(self, shell: AttemptShell) -> None:
        self._shell = shell
        self._reg = shell.registry
        self._log = shell.options.logger
        #: Attempt ids seen, oldest first (under the registry's lock).
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    def on_cancel(self, notice: CancelNotice) -> None:
        """A ``task.cancel`` push (on the reader)."""
        att = self._reg.get(notice.attempt_id)
        if att is None or att.ref.epoch != notice.epoch:
            return
        worker_log(att.ctx).info("cancel requested by the server")
        self._shell.step(att, AttemptMachine.cancel_pushed)

    def dispatch(self, assignment: Assignment, recorded: Callable[[], None]) -> None:
        """A ``task.assign`` push: its machine decides under the registry's lock, where the
        attempt is recorded (then *recorded* is told); its actions are performed on this thread."""
        task = assignment.task
        key = (task.handler, task.handler_version, task.payload_version)
        with self._reg.lock:
            again = assignment.attempt_id in self._seen
            if not again:
                self._seen[assignment.attempt_id] = None
                if len(self._seen) > SEEN_LIMIT:
                    self._seen.popitem(last=False)
            # Not one of this process's capabilities (the connection checks them, §6.1):
            # nothing can run it; the reservation returns to the queue at its lease's end.
            found = None if again else self._shell.handlers.find(key)
            machine = AttemptMachine(
                assignment.attempt,
                new_id=new_message_id,
                retry_delay=self._shell.options.renew_retry_delay,
                time_limit=None if found is None else found[2],
                encoder=self._shell.encoder,
            )
            actions = machine.assigned(
                again=again, runnable=found is not None, stopping=self._reg.drain_over
            )
            att = None
            if found is not None:
                handler, task_log, _ = found
                ctx = TaskContext(
                    task,
                    assignment.attempt_id,
                    clock=self._shell.options.clock,
                    logger=task_log,
                    worker_logger=self._log,
                )
                att = Attempt(assignment, ctx, handler, machine)
                self._reg.attempts[att.id] = att
            recorded()
            if self._reg.stop_requested:  # the drain waits for what was assigned before it
                self._reg.cond.notify_all()
        if att is None:
            for skipped in actions:
                assert isinstance(skipped, Skipped)
                if skipped.count is not None:
                    with self._reg.lock:
                        self._reg.counts[skipped.count] += 1
                self._log.warning("%s", skipped.why)
            return
        worker_log(att.ctx).debug(
            "assigned (%s, attempt %d/%d)", task.handler, task.attempt, task.max_attempts
        )
        if self._shell.hooks.listeners:
            self._shell.hooks.emit("attempt_received", attempt_event(att))
        # Decided as it was recorded (above); performed like any other event's actions.
        self._shell.step(att, lambda _machine: actions)
