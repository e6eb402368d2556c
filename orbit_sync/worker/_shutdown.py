"""Shutdown's attempt phases, over the worker's clock: drain, cancel, abandon, flush.

Each phase ends at its deadline, or as soon as what it waits for has happened; the next phase's
budget starts from there, so the whole shutdown takes at most drain + cancel_grace +
flush_timeout (plus the close allowance of the last phase, close, in :mod:`._supervisor`,
which closes the link, the pool and the worker's threads). Run by the supervisor thread only;
every wait here is on the registry's condition with a deadline.

The phases also have a bound in real time (:func:`real_time_bound`): a clock that does not reach
their deadlines (a test's clock that nobody moves) must not keep a process from exiting. Past it,
:meth:`AttemptPhases.overdue` ends every phase at once; the close then runs (in real time, see
:mod:`._supervisor`) and what was not delivered is reported unreported, its finish kept in the
outbox when there is one.
"""

from __future__ import annotations

from collections.abc import Callable

from ..clock import Clock, WorkerClock
from ._attempt import Phase
from ._attempts import Attempt, AttemptShell, Registry

__all__ = ["CLOSE_ALLOWANCE", "AttemptPhases", "real_time_bound"]

#: After the last shutdown phase: how long (real seconds) the worker's own threads get to exit
#: once everything they wait on was closed (they end on those events, in milliseconds; this only
#: bounds a stuck one). Also the slack a thread gives its own request past its call timeout.
CLOSE_ALLOWANCE = 0.5

#: The real-time clock of what runs in real time whatever the worker's clock: the close.
REAL_TIME: Clock = WorkerClock()


def real_time_bound(window: float, cancel_grace: float, flush_timeout: float) -> float:
    """The real seconds the phases of a shutdown may take: their budget on the worker's clock
    (a drain *window*, *cancel_grace*, *flush_timeout*), plus the close allowance as slack for
    their own work, so that on a real clock the bound never cuts a phase short."""
    return window + cancel_grace + flush_timeout + CLOSE_ALLOWANCE


class AttemptPhases:
    """The phases of shutdown that act on the attempts (see the module's docstring)."""

    def __init__(
        self,
        registry: Registry,
        time: Clock,
        shell: AttemptShell,
        *,
        assignments_over: Callable[[], bool],
    ) -> None:
        self._reg = registry
        self._time = time
        self._shell = shell
        #: True once the server will assign nothing more (read under the registry's
        #: condition, which is notified when it becomes true).
        self._assignments_over = assignments_over
        #: Set by overdue(): the phases overran their real-time bound (under the condition).
        self._overdue = False

    def overdue(self) -> None:
        """The phases overran their real-time bound (the worker's clock did not reach their
        deadlines in time): the phase waiting now ends, and those to come do not wait."""
        with self._reg.cond:
            self._overdue = True
            self._reg.cond.notify_all()

    @property
    def overran(self) -> bool:
        """True once :meth:`overdue` was called."""
        with self._reg.cond:
            return self._overdue

    def wait_until(
        self, done: Callable[[], bool], deadline: float, *, real_time: bool = False
    ) -> bool:
        """Wait (on the registry's condition) until *done()* or *deadline* (on the worker's
        clock, ended early by :meth:`overdue`; with *real_time*, on a real clock and never
        ended early: the close's wait); return *done()*."""
        clock = REAL_TIME if real_time else self._time
        with self._reg.cond:
            while not done():
                if clock.now() >= deadline or (self._overdue and not real_time):
                    return False
                clock.wait(self._reg.cond, deadline)
            return True

    def drain(self, deadline: Callable[[], float]) -> bool:
        """Until *deadline()* (a later request_stop may shorten it): wait for the server to
        assign nothing more (the drain report answered), then for every attempt held, those
        that arrived meanwhile included, to end; running handlers keep their leases renewed.
        True when nothing is left."""
        reg = self._reg
        with reg.cond:
            while (
                (reg.attempts or not self._assignments_over())
                and not self._overdue
                and self._time.now() < deadline()
            ):
                self._time.wait(reg.cond, deadline())
            return not reg.attempts

    def cancel(self, grace: float) -> list[Attempt]:
        """Cancel what is starting or running (``shutdown``); give it *grace* seconds to return.
        Return the attempts that were running."""
        with self._reg.cond:
            # Before the attempts are listed: one admitted after the list starts cancelled.
            self._reg.drain_over = True
        cancelled: list[Attempt] = []
        for att in self._live():
            with att.lock:
                running = att.machine.phase is Phase.RUNNING
                self._shell.lease_actions(att, att.machine.shutdown_cancel())
            if running:
                cancelled.append(att)
        self.wait_until(lambda: not self._any_running(), self._time.now() + grace)
        return cancelled

    def abandon(self) -> list[Attempt]:
        """Finish handlers that ignore cancellation UNKNOWN (their effect is uncertain). The
        finish is sent from here (it never blocks); the handler's thread is counted stuck, and
        the pool's shutdown does not wait for it."""
        gave_up: list[Attempt] = []
        for att in self._live():
            with att.lock:
                actions = self._shell.lease_actions(att, att.machine.abandon())
            if not actions:
                continue
            gave_up.append(att)
            self._shell.perform(att, actions)
        return gave_up

    def settled(self, deadline: float, *, real_time: bool = False) -> bool:
        """Wait until every attempt is settled (its finish delivered, refused or given up), or
        *deadline* (see :meth:`wait_until` for *real_time*)."""
        return self.wait_until(lambda: not self._reg.attempts, deadline, real_time=real_time)

    def stuck(self) -> int:
        """How many handlers finished UNKNOWN still run (at shutdown or past a time limit):
        the pool's shutdown does not wait for their threads."""
        with self._reg.cond:
            return len(self._reg.stuck)

    def _live(self) -> list[Attempt]:
        with self._reg.cond:
            return list(self._reg.attempts.values())

    def _any_running(self) -> bool:
        # Under the registry's condition (a wait_until predicate); attempt locks come after it.
        return any(a.phase() is Phase.RUNNING for a in self._reg.attempts.values())
