"""The ``orbit-worker-supervisor`` thread: wait for a stop request, then shut down in bounded
phases and report.

Drain, cancel, abandon and flush act on the attempts (:mod:`._shutdown`), on the worker's clock;
the last phase, close, is here: it closes the link (kept requests are given up, a dial in
progress is cut, the connection ends), then stops the watchdog, the handler pool and the child
processes, joins the worker's threads and closes the outbox, each within
:data:`~._shutdown.CLOSE_ALLOWANCE` of real time (threads end on events, whatever the clock).
The whole shutdown takes at most drain + cancel_grace + flush_timeout plus that allowance, on
the worker's clock; and, whatever the clock does, at most
:func:`~._shutdown.real_time_bound` plus the allowance in real time: an alarm thread
(``orbit-worker-shutdown-alarm``, started with the shutdown, cancelled and joined at its end)
cuts the phases short when the clock does not get there in time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..client import DialCut
from ..clock import Clock
from ._attempts import Registry
from ._clock import Wakeup
from ._link import Link
from ._outbox import Outbox
from ._pool import DaemonPool
from ._registration import Handlers
from ._report import ShutdownReport
from ._shutdown import CLOSE_ALLOWANCE, REAL_TIME, AttemptPhases, real_time_bound
from ._watchdog import WatchdogThread

__all__ = ["Supervisor"]


class Supervisor:
    """The supervisor thread's work for one Worker (see the module's docstring)."""

    def __init__(
        self,
        registry: Registry,
        phases: AttemptPhases,
        time: Clock,
        *,
        link: Link,
        dial_cut: DialCut,
        wake: Wakeup,
        watchdog: WatchdogThread,
        pool: DaemonPool,
        handlers: Handlers,
        threads: list[threading.Thread],
        drain_deadline: Callable[[], float],
        cancel_grace: float,
        flush_timeout: float,
        error: Callable[[], BaseException | None],
        log: logging.Logger,
        stopped: Callable[[ShutdownReport], None],
    ) -> None:
        self._reg = registry
        self._phases = phases
        self._time = time
        self._link = link
        self._dial_cut = dial_cut
        self._wake = wake
        self._watchdog = watchdog
        self._pool = pool
        self._handlers = handlers
        #: The worker's threads (this one among them), joined by the close phase.
        self._threads = threads
        self._drain_deadline = drain_deadline
        self._cancel_grace = cancel_grace
        self._flush_timeout = flush_timeout
        self._error = error
        self._log = log
        self._stopped = stopped
        #: Set by Worker.start when the worker has an outbox; closed last.
        self.outbox: Outbox | None = None

    def overdue(self) -> None:
        """Cut the shutdown's phases short now (its waiter's bound in real time passed)."""
        self._phases.overdue()

    def await_report(
        self,
        window: float,
        done: threading.Event,
        published: Callable[[], ShutdownReport | None],
    ) -> ShutdownReport:
        """What ``stop()`` returns: the *published* report once *done*, waited for in real
        time at most the shutdown's bound (a drain of *window* seconds) plus the close
        allowance; then the phases are cut short (the alarm may not have fired yet: this stop
        shortened the drain), and past two more allowances the shutdown is :meth:`stuck`."""
        bound = real_time_bound(window, self._cancel_grace, self._flush_timeout) + CLOSE_ALLOWANCE
        if not done.wait(bound):
            self.overdue()
            if not done.wait(2 * CLOSE_ALLOWANCE):
                return self.stuck(published(), bound + 2 * CLOSE_ALLOWANCE)
        report = published()
        assert report is not None
        return report

    def stuck(self, report: ShutdownReport | None, waited: float) -> ShutdownReport:
        """The shutdown did not end within *waited* real seconds: log what is left unreported
        and return *report* (published, but a listener's ``stopped`` has not returned) or, when
        there is none, one made from the attempts still live, with a ``TimeoutError``."""
        if report is None:
            with self._reg.cond:
                left = (*self._reg.unreported, *(a.info for a in self._reg.attempts.values()))
            report = ShutdownReport(
                drained=False,
                unreported=left,
                error=TimeoutError(f"worker shutdown did not finish within {waited:.1f}s"),
            )
        self._log.error(
            "worker shutdown is stuck after %.1fs (a listener or a worker thread does not "
            "return); unreported: %s",
            waited,
            ", ".join(f"task {a.task_id} (attempt {a.attempt_id})" for a in report.unreported)
            or "nothing",
        )
        return report

    def run(self) -> None:
        """The thread: wait for a stop request, shut down, hand the report to *stopped* (which
        publishes it and tells the listeners)."""
        with self._reg.cond:
            while not self._reg.stop_requested:
                self._reg.cond.wait()
        try:
            report = self._shutdown()
        except BaseException as exc:  # never leave stop() waiting forever
            self._log.exception("worker shutdown failed")
            report = ShutdownReport(drained=False, error=exc)
        self._stopped(report)
        self._log.info(
            "worker stopped: drained=%s cancelled=%d abandoned=%d unreported=%d",
            report.drained,
            len(report.cancelled),
            len(report.abandoned),
            len(report.unreported),
        )

    def _shutdown(self) -> ShutdownReport:
        # A plan over the clock (see ._shutdown): at most drain + cancel_grace + flush_timeout,
        # plus the close allowance; the alarm bounds the same plan in real time.
        phases = self._phases
        bound = real_time_bound(
            max(0.0, self._drain_deadline() - self._time.now()),
            self._cancel_grace,
            self._flush_timeout,
        )
        alarm = threading.Timer(bound, phases.overdue)
        alarm.name = "orbit-worker-shutdown-alarm"
        alarm.daemon = True
        alarm.start()
        try:
            # 1. Drain: meanwhile the connection thread tells the server (drain: true) so it
            #    assigns nothing more. What it assigned before reaches us ahead of that
            #    report's answer and runs here too (nothing hands it back, and its claim spent
            #    an attempt): the drain waits for the answer, then for every attempt.
            drained = phases.drain(self._drain_deadline)
            # 2. Cancel what is still running, and give it a grace period to return.
            cancelled = phases.cancel(self._cancel_grace)
            # 3. Abandon handlers that ignore cancellation: finished UNKNOWN.
            gave_up = phases.abandon()
            # 4. Flush: finishes waiting for a connection get a bounded time to be delivered.
            phases.settled(self._time.now() + self._flush_timeout)
        finally:
            alarm.cancel()
            alarm.join()  # at once: cancelled, or done firing
        if phases.overran:
            with self._reg.cond:
                left = len(self._reg.attempts)
            self._log.error(
                "worker shutdown overran its bound of %.1fs in real time (the worker's clock "
                "did not reach its deadlines): closing now with %d attempt(s) unsettled; what is "
                "not delivered is reported unreported",
                bound,
                left,
            )
        # 5. Close.
        self._close()
        with self._reg.cond:
            unreported = tuple(self._reg.unreported)
        return ShutdownReport(
            drained=drained,
            cancelled=tuple(a.info for a in cancelled if a not in gave_up),
            abandoned=tuple(a.info for a in gave_up),
            unreported=unreported,
            error=self._error(),
        )

    def _close(self) -> None:
        """Every remaining waiter gives up (a dial in progress is cut); the threads, woken by
        that, wind down within the close allowance (the pool does not wait for the stuck
        handlers: abandoned ones still running)."""
        # Real time: what is waited for here are threads ending on the events closing sets.
        close_end = REAL_TIME.now() + CLOSE_ALLOWANCE
        current = self._link.current()
        for job in self._link.close():
            job()  # a kept request: it finds the link closed and gives up (unreported)
        self._dial_cut.cut()
        self._wake.set()
        if current is not None:
            current[0].close()
        self._phases.settled(close_end, real_time=True)
        self._watchdog.stop(timeout=max(0.0, close_end - REAL_TIME.now()))
        self._pool.shutdown(max(0.0, close_end - REAL_TIME.now()), stuck=self._phases.stuck())
        if self._handlers.processes is not None:
            self._handlers.processes.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, close_end - REAL_TIME.now()))
        if self.outbox is not None:
            self.outbox.close()  # after the replay thread: it writes to the file
