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
        #: The server's URL for log lines (a Client's base_url carries no credentials).
        url = getattr(client, "base_url", None)
        self._server = url if isinstance(url, str) else "the Orbit server"
        #: Takes each connection's pushes: cancel notices on its reader, assignments on the
        #: handler thread that takes each (:meth:`take`).
        self._admission = Admission(shell)
        #: A new connection's resumes, sent and stepped by this thread.
        self._resumes = ResumeBatch(shell)
        #: The connection whose assignments the handler threads take.
        self._intake = intake
        self._opts = opts = shell.options
        self._clock = opts.clock.now
        self._log = opts.logger
        self._call_timeout = opts.request_timeout
        self._link = shell.controls.link
        #: Wakes this thread: a new capacity report, a request kept, the connection ended, stop.
        self._serve_wake = shell.controls.wake
        self._reg = shell.registry
        self._shell = shell
        self._watchdog = shell.threads.watchdog.core
        self._hooks = shell.hooks
        self._fail = fail
        #: Set once the first session is established (``Worker.wait_ready``).
        self.ready = threading.Event()
        #: Sessions in a row ended by an unexpected error (this thread only).
        self._session_bugs = 0
        # Capacity reports: built by the window, under whose lock each one is written; every
        # answer is read by this thread (_report_answered).
        self._window = shell.window
        #: Once the drain report was answered: its connection, whose assignments received by
        #: then must all be recorded before the drain may end.
        self._drain_on: Connection | None = None
        #: A session's capacity report without drain was answered and its connection has not
        #: ended yet: the server may be assigning to this process (see assignments_over).
        self._assigning = False
        self._beat_lock = threading.Lock()
        self._next_heartbeat = 0.0

    def report_drain(self) -> None:
        """Queue a capacity report with ``drain: true`` (from any thread; sent by this one)."""
        self._window.request_drain()
        self._serve_wake.set()

    def take(self, conn: Connection, assignment: Assignment) -> None:
        """A handler thread took *assignment* from *conn*'s queue: record it and run its
        attempt to the end on this thread."""
        self._admission.dispatch(assignment, partial(self._intake.recorded, conn))

    def assignments_over(self) -> bool:
        """True once the server will assign this process nothing more and every assignment it
        made is recorded (docs/architecture.md, "Threads and their owners"; a new session gets
        none before its first report, the drain one, is answered: PROTOCOL §5.5). Read under the
        registry's condition, which is notified when it may have become true."""
        drained = self._drain_on
        if drained is not None and self._intake.all_recorded(drained):
            return True
        return not self._assigning

    def _assignments_changed(self) -> None:
        with self._reg.cond:
            self._reg.cond.notify_all()

    # ------------------------------------------------------------------ dial, reconnect

    def _connect(self) -> Connection:
        """A new connection, welcomed (raise if the dial fails)."""
        opts = self._opts
        on_cancel = self._admission.on_cancel if opts.cancellation_notifications else None
        # Our own client: shutdown can cut a dial in progress, and leases are anchored on the
        # worker's clock.
        own: dict[str, Any] = {"clock": opts.clock, "cut": self._shell.controls.dial_cut}
        conn: Connection = self._client.dial_worker(
            self._shell.handlers.registration(),
            timeout=opts.dial_timeout,
            on_cancel=on_cancel,
            **(own if isinstance(self._client, Client) else {}),
        )
        return conn

    def run(self) -> None:
        """The connection thread: dial, serve, reconnect, until the link is closed."""
        redial = Redial(self._opts.reconnect_backoff)
        # Started with the thread, i.e. by Worker.start().
        contact = FirstContact(self._clock, self._opts.first_connect_timeout)
        server = self._server
        first = True
        while not self._link.is_closed():
            if not first:
                # Never past the moment to give up on a server never reached.
                self._link.pause(min(redial.delay(), contact.remaining()))
                if self._link.is_closed():
                    break
            first = False
            try:
                conn = self._connect()
            except Exception as exc:
                if self._link.is_closed():
                    break  # shutdown cut the dial
                # Bad credentials, or a bug/misconfiguration (not a network problem): retrying
                # cannot help, so the worker stops and run() raises it.
                # A server that never once spoke the protocol is the wrong server (or version).
                wrong_server = isinstance(exc, WorkerProtocolError) and not self.ready.is_set()
                wrong_url = contact.wrong_endpoint(exc, server)
                if is_fatal_dial_error(exc) or wrong_server or wrong_url:
                    exc = wrong_url or exc
                    self._log.error("worker cannot connect to %s: %s", server, exc)
                    self._fail(exc)
                    return
                if not isinstance(exc, OrbitError | OSError):
                    self._log.exception("worker cannot connect: unexpected error")
                    self._fail(exc)
                    return
                redial.failed(exc)
                with self._reg.cond:
                    self._reg.counts["dial_failures"] += 1
                if self._hooks:
                    self._hooks.emit("dial_failed", DisconnectEvent(type(exc).__name__))
                if contact.reached:
                    # Where and why (errors never carry the token), not only the type.
                    self._log.warning(
                        "cannot connect to %s (%s: %s); retrying", server, type(exc).__name__, exc
                    )
                    continue
                gave_up = contact.failed(exc, server)
                if gave_up is not None:
                    self._log.error("worker stopped: %s", gave_up)
                    self._fail(gave_up)
                    return
                self._never_reached(contact, exc)
                continue
            # A welcome arrived: the server is reachable and accepts us. Whatever ends this
            # session, the next reconnect starts again from the shortest delay, so a link that
            # keeps cutting sessions does not push the delay to its cap.
            redial.welcomed()
            contact.connected()
            self._session(conn)

    def _never_reached(self, contact: FirstContact, exc: BaseException) -> None:
        """Log a failed dial of a worker that has not reached its server once since it started,
        at ERROR the first time (most likely a wrong URL or a missing route, not an outage)."""
        if contact.failures == 1:
            self._log.error(
                "cannot connect to %s (%s: %s): not reached once since this worker started;"
                " retrying (check the URL, DNS, the network and that the server is up)",
                self._server,
                type(exc).__name__,
                exc,
            )
            return
        self._log.warning(
            "cannot connect to %s (%s: %s); not reached once since the start, %.1f s ago"
            " (%d dials); retrying",
            self._server,
            type(exc).__name__,
            exc,
            contact.waited(),
            contact.failures,
        )

    # ------------------------------------------------------------------ one session

    def _session(self, conn: Connection) -> None:
        """Reconcile, publish and serve one connection until it ends."""
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
            self._report_capacity(conn, first)
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
            # session's resumes, which then include those attempts. Quick: each is taken by an
            # idle thread (the server assigns no more than the threads there are).
            if not self._intake.all_recorded(conn):  # every handler thread may hold one
                self._shell.threads.pool.ensure_taker()
            recorded = self._intake.wait_recorded(conn, self._call_timeout + CLOSE_ALLOWANCE)
            if not recorded and not self._link.is_closed():
                self._log.error("assignments of session %s left unrecorded", conn.session_id)
            # Nothing more is assigned through this connection.
            self._assigning = False
            self._assignments_changed()
        if not self._link.is_closed() and self._hooks:
            self._hooks.emit("disconnected", DisconnectEvent(reason))

    def _reconcile(self, conn: Connection, gen: int) -> tuple[SentReport, bool]:
        """Resume every held attempt on *conn*, in one write; once every resume went out,
        publish *conn* (each kept start or finish then goes out from its own thread, behind
        them), have the renewals due sent and send the first capacity report, without waiting
        (PROTOCOL §5.5; why one burst: docs/architecture.md, "One attempt"); return once every
        resume is over, with that report and whether this session is a reconnect."""
        with self._reg.cond:
            held = list(self._reg.attempts.values())
        resumes = self._shell.resumes
        resumes.begin()
        for att in held:
            # Its machine decides: a transient answer is re-sent on this connection after the
            # retry delay; a link failure ends the session, and the next one resumes again.
            self._shell.step(att, AttemptMachine.reconnected)
        self._drive_resumes(conn, gen, resumes.all_sent)
        self._link.publish(conn)
        self._watchdog.connected()  # the renewals due, sent from the watchdog's thread
        first = self._submit_report(conn)
        self._drive_resumes(conn, gen, resumes.all_over)
        with self._reg.cond:
            # A reconnect is a session established (its resumes over) after an earlier one,
            # not a dial. Counted before ready is set, so whoever waited for it reads the count.
            again = self._reg.counts["sessions"] > 0
            self._reg.counts["sessions"] += 1
            self._reg.counts["reconnects"] += again
        return first, again

    def _drive_resumes(self, conn: Connection, gen: int, done: Callable[[], bool]) -> None:
        """Send the resumes (as many at once as the request slots take), step their outcomes
        and re-send those due (a transient answer's retry) until *done*; raise if the connection
        ends first, or if nothing moves for a call timeout plus the close allowance (each resume
        completes by its own call timeout).

        A connection that ended after the server answered every resume is established all the
        same (its finishes may already be acknowledged): the reader sets each answer's slot
        before it reads the next frame, so the outcomes taken after the end was seen hold every
        answer that came before it."""
        batch = self._resumes
        resumes = self._shell.resumes
        limit = self._call_timeout + CLOSE_ALLOWANCE
        quiet_until = self._clock() + limit
        while True:
            self._serve_wake.clear()  # before the checks: a wake-up after them is not lost
            ended = conn.err is not None  # before the outcomes are taken (see above)
            moved = batch.take_answered()
            next_resend = batch.resend_due()
            # None of ours in flight: wait for a request slot (held by others only briefly).
            batch.flush(conn, gen, wait=not batch.in_flight())
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
        """Until the connection ends: report capacity changes (a raise, a drain) and the
        heartbeat, else sleep until the next or a wake-up.

        A report in flight holds back only a repeat of itself: a newer one (a drain, a raise)
        goes out at once behind it, never after an unanswered heartbeat's call bound."""
        sent: SentReport | None = None
        while True:
            self._serve_wake.clear()  # before the checks: a wake-up after them is not lost
            if self._link.is_closed() or conn.err is not None:
                break
            if self._resumes.take_answered():  # a late answer of an older connection's resume
                continue
            if sent is not None and sent.over:
                sent.wait()
                self._report_answered(sent)
                self._check_report(conn, sent)  # raises what ends the session
                sent = None
            with self._beat_lock:
                next_heartbeat = self._next_heartbeat
            if sent is None:
                due = self._window.unacked() or self._clock() >= next_heartbeat
            else:  # only a newer report than the one in flight
                due = self._window.report().sequence > sent.report.sequence
            if due:
                newer = self._submit_report(conn)
                if sent is not None:  # superseded: its answer is read now, in order
                    sent.wait()
                    self._report_answered(sent)
                sent = newer
                continue
            # While a report is in flight its answer wakes this thread (the heartbeat it is).
            until = math.inf if sent is not None else next_heartbeat
            self._serve_wake.wait(None if until == math.inf else until - self._clock())
        err = conn.err
        if err is not None and not self._link.is_closed():
            raise err

    # ------------------------------------------------------------------ capacity reports

    def _submit_report(self, conn: Connection) -> SentReport:
        """Send the report in force without waiting (under the window's lock, so reports reach
        the wire in sequence order); its answer wakes this thread. A report the connection
        refuses is answered with that error."""
        window = self._window
        with window.lock:
            return SentReport(
                conn, window.report(), self._clock(), self._call_timeout, self._serve_wake
            )

    def _report_capacity(self, conn: Connection, sent: SentReport) -> None:
        """Wait for *sent*'s answer (its own call timeout ends the wait at the latest); after a
        transient error answer, wait out the retry delay and send the report then in force
        again."""
        while True:
            sent.wait()
            self._report_answered(sent)
            if sent.error is None:
                return
            self._check_report(conn, sent)
            sent = self._submit_report(conn)

    def _check_report(self, conn: Connection, sent: SentReport) -> None:
        """*sent* was answered: raise its error when it ends the session; after a transient one,
        wait out the retry delay (the caller then sends the report in force)."""
        error = sent.error
        if error is None:
            return
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

    def _report_answered(self, sent: SentReport) -> None:
        """Every report's answer: the window and the heartbeat follow an acknowledged one; a
        drain's answer means every assignment made before it is on the connection's queue."""
        if sent.error is not None:
            return
        report = sent.report
        self._window.acked(report)
        with self._beat_lock:
            # PROTOCOL §5.6: repeat the report at least every third of the session window.
            heartbeat = max(0.1, sent.value.session_window / 3)
            self._next_heartbeat = max(self._next_heartbeat, sent.sent_at + heartbeat)
        if not report.drain:
            self._assigning = True
        elif self._drain_on is None:
            self._drain_on = sent.conn
            self._log.info("drain reported to the server (sequence %d)", report.sequence)
            self._assignments_changed()
