"""The ``orbit-worker-supervisor`` thread: wait for a stop request, then shut down in bounded
phases and report.

Drain, cancel, abandon and flush act on the attempts (:mod:`._shutdown`); the last phase, close,
is here: it closes the link (kept requests are given up, a dial in progress is cut, the
connection ends), then stops the watchdog, the handler pool and the child processes, joins the
worker's threads and closes the outbox, each within :data:`~._shutdown.CLOSE_ALLOWANCE`. The
whole shutdown takes at most drain + cancel_grace + flush_timeout plus that allowance, on the
worker's clock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..client import DialCut
from ..clock import Clock
from ._attempts import Attempt, Registry
from ._clock import Wakeup
from ._link import Link
from ._outbox import Outbox
from ._pool import DaemonPool
from ._registration import Handlers
from ._report import ShutdownReport
from ._shutdown import CLOSE_ALLOWANCE, AttemptPhases
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
        # plus the close allowance.
        phases = self._phases
        # 1. Drain: meanwhile the connection thread tells the server (drain: true) so it assigns
        #    nothing more. Once nothing runs, the close below ends the session anyway: the drain
        #    report's answer is not waited for.
        drained = phases.drain(self._drain_deadline)
        # 2. Cancel what is still running, and give it a grace period to return.
        cancelled = phases.cancel(self._cancel_grace)
        # 3. Abandon handlers that ignore cancellation: finished UNKNOWN.
        gave_up = phases.abandon()
        # 4. Flush: finishes waiting for a connection get a bounded time to be delivered.
        phases.settled(self._time.now() + self._flush_timeout)
        # 5. Close.
        self._close(gave_up)
        with self._reg.cond:
            unreported = tuple(self._reg.unreported)
        return ShutdownReport(
            drained=drained,
            cancelled=tuple(a.info for a in cancelled if a not in gave_up),
            abandoned=tuple(a.info for a in gave_up),
            unreported=unreported,
            error=self._error(),
        )

    def _close(self, gave_up: list[Attempt]) -> None:
        """Every remaining waiter gives up (a dial in progress is cut); the threads, woken by
        that, wind down within the close allowance (the pool does not wait for the handlers of
        *gave_up* still running)."""
        close_end = self._time.now() + CLOSE_ALLOWANCE
        current = self._link.current()
        for job in self._link.close():
            job()  # a kept request: it finds the link closed and gives up (unreported)
        self._dial_cut.cut()
        self._wake.set()
        if current is not None:
            current[0].close()
        self._phases.settled(close_end)
        self._watchdog.stop(timeout=max(0.0, close_end - self._time.now()))
        self._pool.shutdown(close_end, stuck=self._phases.stuck(gave_up))
        if self._handlers.processes is not None:
            self._handlers.processes.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, close_end - self._time.now()))
        if self.outbox is not None:
            self.outbox.close()  # after the replay thread: it writes to the file
