"""The connection thread: dial, reconcile, resume, report capacity, serve, reconnect.

:class:`SessionLoop` owns the ``orbit-worker-connection`` thread's work and the capacity reports.
One session: open the connection on the link and let every held attempt's machine resume its lease
there (:meth:`~._shell.AttemptShell.resume_all`: the machines decide, the resumes take the one
request path), publish the connection once they went out (handler requests may use it from then on;
the starts and finishes kept for it go out first, right behind the resumes), send the first capacity
report behind them, step the resumes' outcomes until every one is over (then renew what they asked
for), then repeat the report before the session expires and re-send kept requests when they are due,
until the connection ends. On loss, back off with jitter (:mod:`._redial`) and start again with the
same registration.

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

from ..client import Client, DialCut
from ..clock import Clock
from ..errors import CallTimeout, OrbitError, WorkerProtocolError
from ..models import CancelNotice, CapacityReport, Registration, Welcome
from ._clock import Wakeup
from ._errors import (
    EndpointCheck,
    FirstContact,
    NotConnected,
    is_fatal_dial_error,
    is_link_failure,
    is_transient,
)
from ._link import Connection, Dialer, Link
from ._listeners import DisconnectEvent, Hooks, SessionEvent
from ._machine import retry_delay
from ._pool import woken_without_preempting
from ._redial import Backoff, Redial
from ._shell import AttemptShell, Registry
from ._shutdown import CLOSE_ALLOWANCE
from ._watchdog import LeaseWatchdog
from ._window import CapacityWindow

__all__ = ["SESSION_BUG_LIMIT", "SessionLoop"]

#: Sessions in a row ended by an unexpected error (a bug of ours) after which the worker stops
#: (``run()`` raises it; the CLI exits 1) instead of reconnecting in a loop.
SESSION_BUG_LIMIT = 2


class _ReportAnswer:
    """A capacity report this thread sent (the session's first goes behind the resumes), and
    its answer."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.report: CapacityReport | None = None
        self.sent_at = 0.0
        self.value: Any = None
        self.error: OrbitError | None = None
        #: Run on the reader as a drain report is acknowledged (see SessionLoop._drain_answered).
        self.on_drain_ack: Callable[[], None] | None = None

    def answered(self, value: Any, error: OrbitError | None) -> None:
        # Runs on the connection's reader (or deadline) thread: it only records and wakes.
        self.value, self.error = value, error
        if error is None and self.on_drain_ack is not None:
            self.on_drain_ack()
        self.event.set()


class SessionLoop:
    """The connection thread's work for one Worker (see the module's docstring)."""

    def __init__(
        self,
        client: Dialer,
        *,
        registration: Callable[[], Registration],
        notifications: bool,
        dial_timeout: float,
        call_timeout: float,
        retry_delay: float,
        backoff: Backoff,
        time: Clock,
        link: Link,
        registry: Registry,
        shell: AttemptShell,
        watchdog: LeaseWatchdog,
        hooks: Hooks,
        log: Any,
        wake: Wakeup,
        ready: threading.Event,
        dial_cut: DialCut,
        on_cancel: Callable[[CancelNotice], None],
        take_assignments: Callable[[Connection], None],
        window: CapacityWindow,
        fail: Callable[[BaseException], None],
        first_connect_timeout: float | None = None,
    ) -> None:
        self._client = client
        self._first_connect_timeout = first_connect_timeout
        self._registration = registration
        self._notifications = notifications
        self._dial_timeout = dial_timeout
        self._call_timeout = call_timeout
        self._retry_delay = retry_delay
        self._backoff = backoff
        self._time = time
        self._clock = time.now
        self._link = link
        self._reg = registry
        self._shell = shell
        self._watchdog = watchdog
        self._hooks = hooks
        self._log = log
        #: Wakes this thread: a new capacity report, a request kept, the connection ended, stop.
        self._serve_wake = wake
        self._ready = ready
        self._dial_cut = dial_cut
        self._on_cancel = on_cancel
        #: The intake: takes a connection's assignments until its queue ends (see _session).
        self._take_assignments = take_assignments
        self._fail = fail
        #: Tells a wrong URL (nothing there ever spoke the protocol) from a server that is down.
        self._endpoint = EndpointCheck(time.now)
        #: Sessions in a row ended by an unexpected error (this thread only).
        self._session_bugs = 0
        # Capacity reports: built by the window, under whose lock each one is written; this
        # thread waits for their answers (a finish may send a lowering one ahead of it).
        self._window = window
        window.answered = self._report_answered
        self._drain_acked = threading.Event()
        #: A session's capacity report without drain was answered and its connection has not
        #: ended yet: the server may be assigning to this process (see assignments_over).
        self._assigning = False
        self._beat_lock = threading.Lock()
        self._heartbeat = 15.0
        self._next_heartbeat = 0.0

    def report_drain(self) -> None:
        """Queue a capacity report with ``drain: true`` (from any thread; sent by this one)."""
        self._window.request_drain()
        self._serve_wake.set()

    def assignments_over(self) -> bool:
        """True once the server will assign this process nothing more: its drain report was
        answered, or no session that could receive assignments is left (PROTOCOL §5.5: a new
        session gets none before its first report, the drain one, is answered).

        The answer comes after every assignment the server made before it applied the drain
        (they are ahead of it on the connection, whose reader hands each to the admission
        before it reads the next frame), so by then each of them is in the registry: a drain
        waits for this, then for the attempts (§5.7: a drain releases nothing already held).
        Read under the registry's condition, which is notified when it becomes true."""
        return self._drain_acked.is_set() or not self._assigning

    def _assignments_changed(self) -> None:
        with self._reg.cond:
            self._reg.cond.notify_all()

    def run(self) -> None:
        """The connection thread: dial, serve, reconnect, until the link is closed."""
        redial = Redial(self._backoff)
        # Started with the thread, i.e. by Worker.start().
        contact = FirstContact(self._clock, self._first_connect_timeout)
        first = True
        while not self._link.is_closed():
            if not first:
                # Never past the moment to give up on a server never reached.
                self._link.pause(min(redial.delay(), contact.remaining()))
                if self._link.is_closed():
                    break
            first = False
            try:
                conn = self._dial()
            except Exception as exc:
                if self._link.is_closed():
                    break  # shutdown cut the dial
                # Bad credentials, or a bug/misconfiguration (not a network problem): retrying
                # cannot help, so the worker stops and run() raises it.
                # A server that never once spoke the protocol is the wrong server (or version).
                wrong_server = isinstance(exc, WorkerProtocolError) and not self._ready.is_set()
                wrong_url = self._endpoint.failed(exc, self._server)
                if is_fatal_dial_error(exc) or wrong_server or wrong_url:
                    exc = wrong_url or exc
                    self._log.error("worker cannot connect to %s: %s", self._server, exc)
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
                        "cannot connect to %s (%s: %s); retrying",
                        self._server,
                        type(exc).__name__,
                        exc,
                    )
                    continue
                gave_up = contact.failed(exc, self._server)
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
            self._endpoint.connected()
            contact.connected()
            self._session(conn)

    def _never_reached(self, contact: FirstContact, exc: BaseException) -> None:
        """Log a failed dial of a worker that has not reached its server once since it started:
        at ERROR the first time (most likely a wrong URL or a missing route, not an outage),
        then at WARNING, each line saying so, unlike the retries of a server that went away."""
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

    def _dial(self) -> Connection:
        if isinstance(self._client, Client):
            # Our own client: shutdown can cut a dial in progress, and leases are anchored on
            # the worker's clock.
            conn: Connection = self._client.dial_worker(
                self._registration(),
                timeout=self._dial_timeout,
                on_cancel=self._on_cancel if self._notifications else None,
                clock=self._time,
                cut=self._dial_cut,
            )
            return conn
        conn = self._client.dial_worker(
            self._registration(),
            timeout=self._dial_timeout,
            on_cancel=self._on_cancel if self._notifications else None,
        )
        return conn

    @property
    def _server(self) -> str:
        """The server's URL for log lines (a Client's base_url carries no credentials)."""
        url = getattr(self._client, "base_url", None)
        return url if isinstance(url, str) else "the Orbit server"

    def _session(self, conn: Connection) -> None:
        """Reconcile, publish and serve one connection until it ends."""
        gen: int | None = None
        reason = "closed"
        intake = threading.Thread(
            target=self._intake, args=(conn,), name="orbit-worker-intake", daemon=True
        )
        intake.start()
        try:
            if self._link.is_closed():
                return
            # Everything a reconnect must send goes out in one burst, without waiting for an
            # answer: the resumes, then the starts and finishes kept for this connection, the
            # renewals due and the first capacity report (the server answers a connection's
            # frames in order, so each resume is applied before its attempt's re-send or
            # renewal, and every kept finish frees its slot before assignments are enabled). On a
            # link that keeps cutting, each round trip a session must survive before it delivers
            # a finish or a renewal is lost work.
            gen = self._link.open(conn)
            first, again = self._reconcile(conn)
            self._first_capacity(conn, first)
            self._ready.set()
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
            conn.close()  # completes what is still in flight on it
            self._step_resumes()  # resumes it failed end now, not on a later connection
            # The intake has dispatched what the connection left unread (before the next
            # session's resumes, which then include those attempts). Quick: each start finds
            # the connection gone and is kept, or the link closed and gives up.
            intake.join(self._call_timeout + CLOSE_ALLOWANCE)
            if intake.is_alive():
                self._log.error("the intake of session %s did not end", conn.session_id)
            # Its reader has exited and its intake has taken what it left: nothing more is
            # assigned through this connection.
            self._assigning = False
            self._assignments_changed()
        if not self._link.is_closed() and self._hooks:
            self._hooks.emit("disconnected", DisconnectEvent(reason))

    def _intake(self, conn: Connection) -> None:
        """The session's intake thread: takes the connection's assignments and sends each start
        until the connection has ended and none is left unread; then wakes this thread."""
        woken_without_preempting()  # the reader wakes it for assignments
        try:
            self._take_assignments(conn)
        except Exception:  # a bug of ours: the session cannot take assignments any more
            self._log.exception("worker error in the intake; closing the connection")
            conn.close()
        finally:
            self._serve_wake.set()

    def _pause_to_retry_in_place(self, conn: Connection, error: OrbitError) -> None:
        """Raise *error* unless it is a transient answer on a live session; else log it and
        wait before the request is re-sent on this same connection."""
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
        self._retry_pause(error)

    def _retry_pause(self, error: OrbitError) -> None:
        """Wait before re-sending after a transient error (longer for our own busy gate)."""
        self._link.pause(retry_delay(error, self._retry_delay))

    def _reconcile(self, conn: Connection) -> tuple[_ReportAnswer, bool]:
        """Resume every held attempt on *conn* (opened, not yet published); once every resume
        went out, publish *conn* (the starts and finishes kept for it go out right behind the
        resumes, and the renewals due, see :meth:`LeaseWatchdog.connected`) and send the
        session's first capacity report, all without waiting for an answer (PROTOCOL §5.5);
        return once every resume is over, with whether this session is a reconnect.

        Each attempt's machine decides its resume and what its outcome means (the lease holds,
        is cancelled or lost; a transient answer is re-sent on this connection after the retry
        delay; a link failure ends the session, and the next connection resumes again). The
        resumes take the gate's request slots like every request of the attempts (the reserve
        keeps one for the report): past them a resume goes out when an answer frees a slot, so
        reconnecting costs one round trip per that many attempts. The re-sends, renewals and
        report follow the last resume on the wire: the server handles a connection's frames in
        order, so every resume is applied before its attempt's re-send or renewal, and before
        assignments can start.
        """
        with self._reg.cond:
            held = list(self._reg.attempts.values())
        resumes = self._shell.resumes
        resumes.begin()
        for att in held:  # each machine resumes its lease, within the gate's request slots
            self._shell.step(att, lambda m: m.reconnected())
        self._drive_resumes(conn, resumes.all_sent)
        self._link.publish(conn)
        self._shell.resend_due()  # the kept starts and finishes, behind their resumes
        self._watchdog.connected()  # the renewals due, sent from the watchdog's thread
        first = self._submit_report(conn)
        self._drive_resumes(conn, resumes.all_over)
        with self._reg.cond:
            # A reconnect is a session established (its resumes over) after an earlier one,
            # not a dial. Counted before ready is set, so whoever waited for it reads the count.
            again = self._reg.counts["sessions"] > 0
            self._reg.counts["sessions"] += 1
            self._reg.counts["reconnects"] += again
        return first, again

    def _drive_resumes(self, conn: Connection, done: Callable[[], bool]) -> None:
        """Step the resumes' outcomes and re-send those due (a transient answer's retry) until
        *done*; raise if the connection ends first, or if nothing moves for a call timeout plus
        the close allowance (each resume completes by its own call timeout: past that, the
        connection is broken).

        A connection that ended after the server answered every resume has still done so: the
        session is established (what the server answered decides, not how soon this thread
        looked; its finishes may already be acknowledged). The reader hands over each answer
        before it reads the next frame, so once the end is seen, the outcomes taken after it
        hold every answer that came before it."""
        resumes = self._shell.resumes
        limit = self._call_timeout + CLOSE_ALLOWANCE
        quiet_until = self._clock() + limit
        while True:
            self._serve_wake.clear()  # before the checks: a wake-up after them is not lost
            ended = conn.err is not None  # before the outcomes are taken (see above)
            moved = self._step_resumes()
            next_resend = self._shell.resend_due()
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

    def _step_resumes(self) -> bool:
        """Step the resumes' queued outcomes; True if there were any."""
        taken = self._shell.resumes.take()
        for att, event in taken:
            self._shell.step(att, event)
        return bool(taken)

    def _submit_report(self, conn: Connection) -> _ReportAnswer:
        """Send the report in force without waiting (under the window's lock, so reports reach
        the wire in sequence order); its answer lands in the returned object."""
        pending = _ReportAnswer()
        with self._window.lock:
            pending.report = self._window.report()
            pending.sent_at = self._clock()
            if pending.report.drain:
                pending.on_drain_ack = partial(self._drain_answered, conn, pending.report)
            try:
                conn._submit(
                    "worker.capacity", pending.report, pending.answered, timeout=self._call_timeout
                )
            except OrbitError as exc:  # nothing was sent (busy, or the connection ended)
                pending.answered(None, exc)
        return pending

    def _await_report(self, conn: Connection, pending: _ReportAnswer) -> bool:
        """Wait for *pending*'s answer (its own call timeout completes it at the latest): True
        once acknowledged, False after a transient error answer (waited out: send again);
        anything else raises."""
        if not pending.event.wait(self._call_timeout + CLOSE_ALLOWANCE):
            raise CallTimeout("a capacity report was never completed")
        error = pending.error
        if error is None:
            # The connection checked the ack's body: a capacity ack carries a Welcome.
            assert isinstance(pending.value, Welcome) and pending.report is not None
            self._capacity_acked(pending.report, pending.sent_at, pending.value)
            return True
        self._pause_to_retry_in_place(conn, error)
        return False

    def _first_capacity(self, conn: Connection, first: _ReportAnswer) -> None:
        """Wait for the answer of the first report sent by :meth:`_reconcile`; a transient error
        answer is retried in place, like any later report."""
        if not self._await_report(conn, first):
            self._send_capacity(conn)

    def _send_capacity(self, conn: Connection) -> None:
        """Send the report in force and wait for its answer; a transient error answer is
        retried on this connection (with the report then in force)."""
        while not self._await_report(conn, self._submit_report(conn)):
            pass

    def _report_answered(
        self,
        conn: Connection,
        report: CapacityReport,
        sent_at: float,
        value: Any,
        error: OrbitError | None,
    ) -> None:
        """The answer to a report a finish sent ahead of itself (on the reader: records only);
        after an error this thread sends the report in force again."""
        if error is None:
            if report.drain:
                self._drain_answered(conn, report)
            self._capacity_acked(report, sent_at, value)
        else:
            self._serve_wake.set()

    def _drain_answered(self, conn: Connection, report: CapacityReport) -> None:
        """A drain report was acknowledged (on the reader): the server assigns nothing more
        after it, and the assignments it made before are on the connection's queue ahead of
        this answer. The drain counts as answered once the intake has taken all of them."""
        conn._after_assignments(partial(self._drain_taken, report))

    def _drain_taken(self, report: CapacityReport) -> None:
        """On the intake, behind every assignment made before the drain report was applied:
        each of them is in the registry now."""
        if not self._drain_acked.is_set():
            self._drain_acked.set()
            self._log.info("drain reported to the server (sequence %d)", report.sequence)
            self._assignments_changed()

    def _capacity_acked(self, report: CapacityReport, sent_at: float, welcome: Welcome) -> None:
        self._window.acked(report)
        with self._beat_lock:
            # PROTOCOL §5.6: repeat the report at least every third of the session window.
            self._heartbeat = max(0.1, welcome.session_window / 3)
            self._next_heartbeat = max(self._next_heartbeat, sent_at + self._heartbeat)
        if not report.drain:
            self._assigning = True

    def _serve(self, conn: Connection) -> None:
        # Assignments are taken by the session's intake; this thread keeps the session alive,
        # reports capacity changes (a raise the intake asked for, a drain) and re-sends the kept
        # starts and finishes until the connection ends. It sleeps until the next heartbeat or
        # re-send unless woken (new report, a request kept, connection ended, shutdown).
        while True:
            self._serve_wake.clear()  # before the checks: a wake-up after them is not lost
            if self._link.is_closed() or conn.err is not None:
                break
            next_resend = self._shell.resend_due()
            with self._beat_lock:
                next_heartbeat = self._next_heartbeat
            if self._window.unacked() or self._clock() >= next_heartbeat:
                self._send_capacity(conn)
                continue
            self._serve_wake.wait(min(next_heartbeat, next_resend) - self._clock())
        err = conn.err
        if err is not None and not self._link.is_closed():
            raise err
