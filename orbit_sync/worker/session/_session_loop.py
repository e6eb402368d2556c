"""What the ``orbit-worker-connection`` thread does with each connection (docs/architecture.md,
``_session_loop``): dial (:meth:`SessionLoop.run`), reconcile (:meth:`SessionLoop._reconcile`),
serve (:meth:`SessionLoop._serve`), and after a failed dial or a lost session dial again.

Errors: a network or protocol failure reconnects; credentials the server refuses, or a server
that never spoke the protocol, stop the worker; an unexpected exception (a bug of ours) is
logged with its traceback and, when it ends :data:`SESSION_BUG_LIMIT` sessions in a row, stops
the worker with that error. Every wait of this thread has a deadline (its own requests: their
call timeout plus :data:`~._shutdown.CLOSE_ALLOWANCE`) or ends when the link is closed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from ...client import Client
from ...errors import CallTimeout, OrbitError, WorkerProtocolError
from ...models import Assignment
from .._listeners import DisconnectEvent, SessionEvent
from ..core._errors import (
    FirstContact,
    NotConnected,
    is_fatal_dial_error,
    is_link_failure,
    is_transient,
)
from ..core._machine import AttemptMachine, retry_delay
from ..core._redial import Redial
from ..runtime._link import Connection, Dialer, Intake
from ..runtime._shell import AttemptShell
from ..runtime._shutdown import CLOSE_ALLOWANCE
from ..runtime._window import SentReport
from ._admission import Admission
from ._resumes import ResumeBatch

__all__ = ["SESSION_BUG_LIMIT", "SessionLoop"]

#: Sessions in a row ended by an unexpected error (a bug of ours) after which the worker stops
#: (``run()`` raises it; the CLI exits 1) instead of reconnecting in a loop.
SESSION_BUG_LIMIT = 2


class SessionLoop:
    """The connection thread's work for one Worker (see the module's docstring)."""

    def __init__(
        self,
        client: Dialer,
        shell: AttemptShell,
        intake: Intake,
        *,
        fail: Callable[[BaseException], None],
    ) -> None:
        self._client = client
        #: For log lines (a Client's base_url carries no credentials).
        url = getattr(client, "base_url", None)
        self._server = url if isinstance(url, str) else "the Orbit server"
        self._admission = Admission(shell)
        self._resumes = ResumeBatch(shell)
        self._intake = intake
        self._shell = shell
        self._opts = shell.options
        self._clock = shell.options.clock.now
        self._log = shell.options.logger
        self._call_timeout = shell.options.request_timeout
        self._link = shell.controls.link
        #: Wakes this thread: a new capacity report, a request kept, the connection ended, stop.
        self._serve_wake = shell.controls.wake
        self._reg = shell.registry
        self._hooks = shell.hooks
        # Every report's answer is read by this thread, so the heartbeat needs no lock.
        self._window = shell.window
        self._next_heartbeat = 0.0
        self._fail = fail
        self.ready = threading.Event()
        self._session_bugs = 0
        #: The drain report's connection, once answered: its assignments must all be recorded.
        self._drain_on: Connection | None = None
        #: A report without drain was answered on a live connection: the server may assign.
        self._assigning = False

    def report_drain(self) -> None:
        """Queue a capacity report with ``drain: true`` (from any thread; sent by this one)."""
        self._window.request_drain()
        self._serve_wake.set()

    def take(self, conn: Connection, assignment: Assignment) -> None:
        """A handler thread took *assignment* from *conn*'s queue: record it and run it here."""
        self._admission.dispatch(assignment, partial(self._intake.recorded, conn))

    def assignments_over(self) -> bool:
        """True once the server will assign nothing more and every assignment is recorded
        (docs/architecture.md, "Threads and their owners"); read under the registry's condition."""
        drained = self._drain_on
        if drained is not None and self._intake.all_recorded(drained):
            return True
        return not self._assigning

    def run(self) -> None:
        """The connection thread: dial, serve, reconnect, until the link is closed."""
        opts = self._opts
        redial = Redial(opts.reconnect_backoff)
        contact = FirstContact(self._clock, opts.first_connect_timeout)
        on_cancel = self._admission.on_cancel if opts.cancellation_notifications else None
        # Our own client: shutdown can cut a dial in progress, and leases are anchored on the
        # worker's clock.
        own: dict[str, Any] = (
            {"clock": opts.clock, "cut": self._shell.controls.dial_cut}
            if isinstance(self._client, Client)
            else {}
        )
        while not self._link.is_closed():
            try:
                conn: Connection = self._client.dial_worker(
                    self._shell.handlers.registration(),
                    timeout=opts.dial_timeout,
                    on_cancel=on_cancel,
                    **own,
                )
            except Exception as exc:
                if self._link.is_closed() or not self._dial_failed(exc, redial, contact):
                    return  # shutdown cut the dial, or the worker stops on its error
            else:
                # Welcomed: the next reconnect starts from the shortest delay, so a link that
                # keeps cutting sessions does not push the delay to its cap.
                redial.welcomed()
                contact.connected()
                self._session(conn)
            if not self._link.is_closed():
                # Never past the moment to give up on a server never reached.
                self._link.pause(min(redial.delay(), contact.remaining()))

    def _dial_failed(self, exc: Exception, redial: Redial, contact: FirstContact) -> bool:
        """Count and log a failed dial: True to dial again, False once the worker stopped."""
        server = self._server
        # A server that never once spoke the protocol is the wrong server (or version).
        wrong_server = isinstance(exc, WorkerProtocolError) and not self.ready.is_set()
        wrong_url = contact.wrong_endpoint(exc, server)
        if is_fatal_dial_error(exc) or wrong_server or wrong_url:
            # Bad credentials or a misconfiguration: retrying cannot help; run() raises it.
            exc = wrong_url or exc
            self._log.error("worker cannot connect to %s: %s", server, exc)
            self._fail(exc)
            return False
        if not isinstance(exc, OrbitError | OSError):
            self._log.exception("worker cannot connect: unexpected error")
            self._fail(exc)
            return False
        redial.failed(exc)
        with self._reg.cond:
            self._reg.counts["dial_failures"] += 1
        if self._hooks:
            self._hooks.emit("dial_failed", DisconnectEvent(type(exc).__name__))
        # Where and why (errors never carry the token), not only the type.
        what = (server, type(exc).__name__, exc)
        if contact.reached:
            self._log.warning("cannot connect to %s (%s: %s); retrying", *what)
            return True
        gave_up = contact.failed(exc, server)
        if gave_up is not None:
            self._log.error("worker stopped: %s", gave_up)
            self._fail(gave_up)
            return False
        if contact.failures == 1:
            # At ERROR the first time: most likely a wrong URL or a missing route, not an outage.
            self._log.error(
                "cannot connect to %s (%s: %s): not reached once since this worker started;"
                " retrying (check the URL, DNS, the network and that the server is up)",
                *what,
            )
        else:
            self._log.warning(
                "cannot connect to %s (%s: %s); not reached once since the start, %.1f s ago"
                " (%d dials); retrying",
                *what,
                contact.waited(),
                contact.failures,
            )
        return True

    def _session(self, conn: Connection) -> None:
        gen: int | None = None
        reason = "closed"
        try:
            if self._link.is_closed():
                return
            gen = self._link.open(conn)
            conn.wake_on_end(self._serve_wake)
            # Nothing is assigned before the first report's answer (PROTOCOL §5.5): the handler
            # threads may wait on its queue from now on.
            self._intake.offer(conn)
            first, again = self._reconcile(conn, gen)
            while not self._report_acked(conn, first):  # a transient error, waited out
                first = self._submit_report(conn)
            self.ready.set()
            self._log.info("session %s established", conn.session_id)
            if self._hooks:
                event = SessionEvent(conn.session_id, again, self._window.offered)
                self._hooks.emit("connected", event)
            self._serve(conn)
            self._session_bugs = 0
        except OrbitError as exc:  # the connection failed: reconnect
            reason = type(exc).__name__
            self._session_bugs = 0
            if not self._link.is_closed():
                if is_fatal_dial_error(exc):
                    self._log.error("worker rejected by the server: %s", exc)
                    self._fail(exc)
                else:
                    self._log.warning(
                        "connection to %s lost (%s: %s); reconnecting",
                        self._server,
                        type(exc).__name__,
                        exc,
                    )
        except Exception as exc:  # a bug of ours: loud, and fatal if it happens again
            reason = type(exc).__name__
            self._session_bugs += 1
            if self._session_bugs >= SESSION_BUG_LIMIT:
                self._log.exception(
                    "worker error in the session loop, %d sessions in a row; stopping",
                    self._session_bugs,
                )
                self._fail(exc)
            else:
                self._log.exception("worker error in the session loop; reconnecting once")
        finally:
            if gen is not None:
                self._link.retract(gen)
            conn.close()  # fails what is still in flight on it
            self._resumes.take_answered()  # resumes it failed end now, not on a later connection
            # The handler threads record what the connection left unread before the next
            # session's resumes, which then include those attempts.
            if not self._intake.all_recorded(conn):  # every handler thread may hold one
                self._shell.threads.pool.ensure_taker()
            recorded = self._intake.wait_recorded(conn, self._call_timeout + CLOSE_ALLOWANCE)
            if not recorded and not self._link.is_closed():
                self._log.error("assignments of session %s left unrecorded", conn.session_id)
            with self._reg.cond:  # nothing more is assigned through this connection
                self._assigning = False
                self._reg.cond.notify_all()
        if not self._link.is_closed() and self._hooks:
            self._hooks.emit("disconnected", DisconnectEvent(reason))

    def _reconcile(self, conn: Connection, gen: int) -> tuple[SentReport, bool]:
        """Resume every held attempt on *conn* in one write; once all went out, publish *conn*,
        have the renewals due sent and send the first report (PROTOCOL §5.5; docs/architecture.md,
        "One attempt"); return once every resume is over, with that report and whether this
        session is a reconnect."""
        with self._reg.cond:
            held = list(self._reg.attempts.values())
        resumes = self._shell.resumes
        resumes.begin()
        for att in held:
            self._shell.step(att, AttemptMachine.reconnected)
        self._drive_resumes(conn, gen, resumes.all_sent)
        self._link.publish(conn)
        self._shell.threads.watchdog.core.connected()  # its thread sends the renewals due
        first = self._submit_report(conn)
        self._drive_resumes(conn, gen, resumes.all_over)
        with self._reg.cond:
            # Counted before ready is set, so whoever waited for it reads the count.
            again = self._reg.counts["sessions"] > 0
            self._reg.counts["sessions"] += 1
            self._reg.counts["reconnects"] += again
        return first, again

    def _drive_resumes(self, conn: Connection, gen: int, done: Callable[[], bool]) -> None:
        """Send the resumes, step their outcomes and re-send those due until *done*; raise if
        the connection ends first or nothing moves for a call timeout plus the close allowance.

        A connection that ended after every resume was answered is established all the same:
        the reader sets each answer's slot before it reads the next frame, so the outcomes taken
        after the end was seen hold every answer before it."""
        batch = self._resumes
        resumes = self._shell.resumes
        limit = self._call_timeout + CLOSE_ALLOWANCE
        quiet_until = self._clock() + limit
        while True:
            self._serve_wake.clear()  # before the checks: a wake-up after them is not lost
            ended = conn.err is not None  # before the outcomes are taken (see above)
            moved = batch.take_answered()
            jobs, next_resend = self._link.take_due()
            for job in jobs:
                job()
            batch.flush(conn, gen)
            # A resume whose connection failed is over too (and broke the connection): cut.
            if self._link.is_closed() or resumes.cut() or (ended and not resumes.all_over()):
                raise conn.err or NotConnected("the connection ended during its resumes")
            if ended or done():
                return
            now = self._clock()
            if moved:
                quiet_until = now + limit
            if next_resend < math.inf:
                quiet_until = max(quiet_until, next_resend + limit)
            if now >= quiet_until:
                raise CallTimeout("a resume of the connection thread was never completed")
            self._serve_wake.wait(min(next_resend, quiet_until) - now)

    def _serve(self, conn: Connection) -> None:
        """Until the connection ends: report capacity changes and the heartbeat. A report in
        flight holds back only a repeat of itself: a newer one goes out at once behind it."""
        sent: SentReport | None = None
        while True:
            self._serve_wake.clear()  # before the checks: a wake-up after them is not lost
            if self._link.is_closed():
                return
            if (err := conn.err) is not None:
                raise err
            if self._resumes.take_answered():  # a late answer of an older connection's resume
                continue
            if sent is not None and sent.over:
                self._report_acked(conn, sent)  # raises what ends the session
                sent = None
            if sent is None:
                due = self._window.unacked() or self._clock() >= self._next_heartbeat
            else:  # only a newer report than the one in flight
                due = self._window.report().sequence > sent.report.sequence
            if due:
                newer = self._submit_report(conn)
                if sent is not None:  # superseded: its answer is read now, in order
                    self._report_answered(sent)
                sent = newer
                continue
            # While a report is in flight its answer wakes this thread (the heartbeat it is).
            self._serve_wake.wait(None if sent else self._next_heartbeat - self._clock())

    def _submit_report(self, conn: Connection) -> SentReport:
        """Send the report in force without waiting (under the window's lock, so reports reach
        the wire in sequence order); its answer wakes this thread."""
        window = self._window
        with window.lock:
            return SentReport(
                conn, window.report(), self._clock(), self._call_timeout, self._serve_wake
            )

    def _report_acked(self, conn: Connection, sent: SentReport) -> bool:
        """Wait for *sent*'s answer: True if acknowledged; raise an error that ends the session;
        after a transient one, wait out the retry delay and return False."""
        self._report_answered(sent)
        error = sent.error
        if error is None:
            return True
        if (
            is_link_failure(error)
            or not is_transient(error)
            or self._link.is_closed()
            or conn.err is not None
        ):
            raise error
        self._log.info(
            "request answered %s; retrying on the same connection",
            getattr(error, "code", type(error).__name__),
        )
        self._link.pause(retry_delay(error, self._opts.renew_retry_delay))
        return False

    def _report_answered(self, sent: SentReport) -> None:
        """Wait for *sent*'s answer; the window and the heartbeat follow an acknowledged one. A
        drain's answer means every assignment made before it is on the connection's queue."""
        sent.wait()
        if sent.error is not None:
            return
        report = sent.report
        self._window.acked(report)
        # PROTOCOL §5.6: repeat the report at least every third of the session window.
        heartbeat = max(0.1, sent.value.session_window / 3)
        self._next_heartbeat = max(self._next_heartbeat, sent.sent_at + heartbeat)
        if not report.drain:
            self._assigning = True
        elif self._drain_on is None:
            self._drain_on = sent.conn
            self._log.info("drain reported to the server (sequence %d)", report.sequence)
            with self._reg.cond:
                self._reg.cond.notify_all()
