"""The ``orbit-worker-shutdown`` thread: wait for a stop request, then shut down and report. The
phases drain, cancel, abandon and flush act on the attempts, on the worker's clock, each ending
early once what it waits for has happened; the close stops the worker's threads in real time, and
an alarm bounds the phases in real time too (docs/architecture.md, "Threads and their owners").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from ...clock import Clock, SystemClock
from .._listeners import AttemptInfo, ShutdownReport
from ..core._machine import Action, AttemptMachine, Event, Phase, UntrackLease
from ._registry import Attempt
from ._shell import AttemptShell

__all__ = ["CLOSE_ALLOWANCE", "Shutdown"]

#: How long (real seconds) the worker's threads get to exit once all they wait on was closed (in
#: milliseconds; this bounds a stuck one). Also a thread's slack for its request past its timeout.
CLOSE_ALLOWANCE = 0.5

#: The close runs in real time, whatever the worker's clock.
REAL_TIME: Clock = SystemClock()


class Shutdown:
    """The shutdown thread's work for one Worker (see the module's docstring)."""

    def __init__(
        self,
        shell: AttemptShell,
        *,
        assignments_over: Callable[[], bool],
        stopped: Callable[[ShutdownReport], None],
    ) -> None:
        self._reg = shell.registry
        self._options = shell.options
        self._time = shell.options.clock
        self._shell = shell
        #: True once the server will assign nothing more (notifies the registry's condition).
        self._assignments_over = assignments_over
        self._stopped = stopped
        #: Set by overdue() (under the condition).
        self._overdue = False

    def bound(self, window: float) -> float:
        """The real seconds the phases may take: drain *window*, cancel grace, flush, allowance."""
        return window + self._options.cancel_grace + self._options.flush_timeout + CLOSE_ALLOWANCE

    def overdue(self) -> None:
        """The phases overran their real-time bound: the one waiting ends, the next do not wait."""
        with self._reg.lock:
            self._overdue = True
            self._reg.cond.notify_all()

    def wait_until(
        self, done: Callable[[], bool], deadline: float, *, real_time: bool = False
    ) -> None:
        """Wait until *done()* or *deadline* (worker's clock, or :meth:`overdue`; or real time)."""
        clock = REAL_TIME if real_time else self._time
        with self._reg.lock:
            while not done() and clock.now() < deadline and (real_time or not self._overdue):
                clock.wait(self._reg.cond, deadline)

    def drain(self) -> bool:
        """Until the drain deadline (a later request_stop may bring it forward), wait for the server
        to assign nothing more, then for every attempt held to end; True when nothing is left."""
        reg = self._reg
        with reg.lock:
            while (
                (reg.attempts or not self._assignments_over())
                and not self._overdue
                and self._time.now() < reg.drain_deadline
            ):
                self._time.wait(reg.cond, reg.drain_deadline)
            return not reg.attempts

    def cancel(self, grace: float) -> list[Attempt]:
        """Cancel what is starting or running, give it *grace* seconds; return those running."""
        with self._reg.lock:
            # Before the attempts are listed: one admitted after the list starts cancelled.
            self._reg.drain_over = True
        # A starting attempt is cancelled too; one whose lease is untracked was running.
        stepped = self._step_each(AttemptMachine.shutdown_cancel)
        cancelled = [att for att, actions in stepped if UntrackLease in map(type, actions)]
        # Under the registry's condition (a wait_until predicate); attempt locks come after it.
        self.wait_until(
            lambda: all(a.phase() is not Phase.RUNNING for a in self._reg.attempts.values()),
            self._time.now() + grace,
        )
        return cancelled

    def abandon(self) -> list[Attempt]:
        """Finish handlers that ignore cancellation UNKNOWN (their threads are counted stuck)."""
        return [att for att, actions in self._step_each(AttemptMachine.abandon) if actions]

    def _step_each(self, event: Event) -> list[tuple[Attempt, list[Action]]]:
        """Step *event* on every live attempt; return each with the actions its machine returned."""
        stepped: list[tuple[Attempt, list[Action]]] = []
        for att in self._live():

            def noted(machine: AttemptMachine, att: Attempt = att) -> list[Action]:
                actions = event(machine)
                stepped.append((att, actions))
                return actions

            self._shell.step(att, noted)
        return stepped

    def _settled(self) -> bool:
        """Is every attempt's finish delivered, refused or given up?"""
        return not self._reg.attempts

    def _live(self) -> list[Attempt]:
        with self._reg.lock:
            return list(self._reg.attempts.values())

    def await_report(
        self, window: float, done: threading.Event, published: Callable[[], ShutdownReport | None]
    ) -> ShutdownReport:
        """What ``stop()`` returns: the *published* report once *done*, waited for in real time at
        most the bound plus an allowance; then the phases are cut short (this stop may have
        shortened the drain, before the alarm), and two allowances later it is :meth:`stuck`."""
        bound = self.bound(window) + CLOSE_ALLOWANCE
        if not done.wait(bound):
            self.overdue()
            if not done.wait(2 * CLOSE_ALLOWANCE):
                return self.stuck(published(), bound + 2 * CLOSE_ALLOWANCE)
        report = published()
        assert report is not None
        return report

    def stuck(self, report: ShutdownReport | None, waited: float) -> ShutdownReport:
        """Not over within *waited* real seconds: log it; return *report* (published, a listener
        not returned) or one of the attempts still live, with a ``TimeoutError``."""
        if report is None:
            with self._reg.lock:
                left = (*self._reg.unreported, *(a.info for a in self._reg.attempts.values()))
            report = ShutdownReport(
                drained=False,
                unreported=left,
                error=TimeoutError(f"worker shutdown did not finish within {waited:.1f}s"),
            )
        self._options.logger.error(
            "worker shutdown is stuck after %.1fs (a listener or a worker thread does not "
            "return); unreported: %s",
            waited,
            _named(report.unreported),
        )
        return report

    def run(self) -> None:
        """The thread: wait for a stop request, shut down, hand the report to *stopped*."""
        with self._reg.lock:
            while not self._reg.stop_requested:
                self._reg.cond.wait()
        try:
            report = self._shutdown()
        except BaseException as exc:  # never leave stop() waiting forever
            self._options.logger.exception("worker shutdown failed")
            report = ShutdownReport(drained=False, error=exc)
        # Each task a stop cut short, by id: what an operator looks up on the server.
        cut = [
            f"; {what}: {_named(infos)}"
            for what, infos in (
                ("cancelled", report.cancelled),
                ("abandoned, finished UNKNOWN SHUTDOWN_TIMEOUT", report.abandoned),
                ("unreported", report.unreported),
            )
            if infos
        ]
        self._options.logger.log(
            logging.WARNING if cut else logging.INFO,
            "worker stopped: drained=%s cancelled=%d abandoned=%d unreported=%d%s",
            report.drained,
            len(report.cancelled),
            len(report.abandoned),
            len(report.unreported),
            "".join(cut),
        )
        # Logged first: once stopped, stop() returns and the process may exit.
        self._stopped(report)

    def _shutdown(self) -> ShutdownReport:
        with self._reg.lock:
            window = max(0.0, self._reg.drain_deadline - self._time.now())
        bound = self.bound(window)
        alarm = threading.Timer(bound, self.overdue)
        alarm.name = "orbit-worker-shutdown-alarm"
        alarm.daemon = True
        alarm.start()
        try:
            # 1. Drain (why it also runs what arrives meanwhile: docs/architecture.md).
            drained = self.drain()
            if not drained:
                held = [a.info for a in self._live()]
                self._options.logger.warning(
                    "drain ended with %d attempt(s) still held, cancelling them: %s",
                    len(held),
                    _named(held),
                )
            # 2. Cancel what is still running, and give it a grace period to return.
            cancelled = self.cancel(self._options.cancel_grace)
            # 3. Abandon handlers that ignore cancellation: finished UNKNOWN.
            gave_up = self.abandon()
            # 4. Flush: finishes waiting for a connection get a bounded time to be delivered.
            self.wait_until(self._settled, self._time.now() + self._options.flush_timeout)
        finally:
            alarm.cancel()
            alarm.join()  # at once: cancelled, or done firing
        with self._reg.lock:
            overran, left = self._overdue, len(self._reg.attempts)
        if overran:
            self._options.logger.error(
                "worker shutdown overran its bound of %.1fs in real time (the worker's clock "
                "did not reach its deadlines): closing now with %d attempt(s) unsettled; what is "
                "not delivered is reported unreported",
                bound,
                left,
            )
        # 5. Close.
        self._close()
        with self._reg.lock:
            unreported, error = tuple(self._reg.unreported), self._reg.error
        return ShutdownReport(
            drained=drained,
            cancelled=tuple(a.info for a in cancelled if a not in gave_up),
            abandoned=tuple(a.info for a in gave_up),
            unreported=unreported,
            error=error,
        )

    def _close(self) -> None:
        """Close what every thread waits on; give them the close allowance (real time) to end."""
        close_end = REAL_TIME.now() + CLOSE_ALLOWANCE
        controls, threads = self._shell.controls, self._shell.threads
        current = controls.link.current()
        controls.close_link()
        controls.dial_cut.cut()
        controls.wake.set()
        if current is not None:
            current[0].close()
        self.wait_until(self._settled, close_end, real_time=True)
        threads.watchdog.stop(timeout=max(0.0, close_end - REAL_TIME.now()))
        with self._reg.lock:  # handlers finished UNKNOWN that still run: not waited for
            stuck = len(self._reg.stuck)
        threads.pool.shutdown(max(0.0, close_end - REAL_TIME.now()), stuck=stuck)
        if self._shell.handlers.processes is not None:
            self._shell.handlers.processes.close()
        for thread in threads.started:
            if thread is not threading.current_thread():
                thread.join(max(0.0, close_end - REAL_TIME.now()))
        if self._shell.outbox is not None:
            self._shell.outbox.close()  # after the replay thread: it writes to the file


def _named(infos: Iterable[AttemptInfo]) -> str:
    """Attempts for a log line, by task and attempt id."""
    return ", ".join(f"task {a.task_id} (attempt {a.attempt_id})" for a in infos) or "nothing"
