"""``WorkerConnection``: one ``pulse.worker.v1`` session over one WebSocket.

No reconnects, renewals or handlers here (that is :mod:`orbit_sync.worker`): a thread-safe,
bounded, blocking client of the protocol, mirroring the reference Go ``WorkerConnection``.

Two daemon threads per connection, both joined by :meth:`WorkerConnection.close`:

* the **reader** decodes every server frame, answers the waiting caller, queues pushes (or hands
  them to the ``on_assignment`` / ``on_cancel`` callbacks) and never blocks (a full assignment
  queue closes the connection with ``WorkerBackpressure``);
* the **deadline thread** enforces the read-idle bound (60 s) and every call's bound (10 s, write
  queueing included) and tears the socket down when one passes. It exists because neither bound may
  rely on socket timeouts (over TLS they break concurrent read + send, LIBRARY-NOTES), and a caller
  stuck in a blocked write cannot time itself out.

On any failure the connection records one error (``err``), releases every waiting caller at once
with that error bound to the caller's own ``message_id``, and sets ``done`` once the reader exited.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

import attrs

from . import _codec
from ._transport import Transport
from .errors import (
    CallTimeout,
    OrbitError,
    WorkerBackpressure,
    WorkerBusy,
    WorkerClosed,
    WorkerDisconnected,
    WorkerProtocolError,
)
from .models import (
    ID_RE,
    MAX_CAPACITY,
    Assignment,
    AttemptRef,
    CancelNotice,
    CapacityReport,
    CommandResult,
    Finish,
    Lease,
    Registration,
    Welcome,
    new_message_id,
)

__all__ = [
    "ASSIGNMENT_BUFFER",
    "CALL_TIMEOUT",
    "CANCEL_BUFFER",
    "MAX_IN_FLIGHT",
    "READ_IDLE_TIMEOUT",
    "WorkerConnection",
]

log = logging.getLogger("orbit_sync.connection")

#: In-flight control requests per connection; one more raises WorkerBusy before encoding (§10).
MAX_IN_FLIGHT: Final = 32
#: Unread assignments buffered when no ``on_assignment`` callback is set; one more closes the
#: connection with WorkerBackpressure (§10).
ASSIGNMENT_BUFFER: Final = 8
#: Unread cancel notices buffered when no ``on_cancel`` callback is set: at most one per held
#: attempt is expected, and a process holds at most 256 attempts.
CANCEL_BUFFER: Final = MAX_CAPACITY
#: Default and maximum bound of one request, from call to answer, write queueing included (§10).
CALL_TIMEOUT: Final = 10.0
#: Default and maximum read-idle bound (§10).
READ_IDLE_TIMEOUT: Final = 60.0

_CLOSED: Final = object()  # wakes queue readers when the connection fails
T = TypeVar("T")


class _Slot:
    """One in-flight request: who waits, until when, and the answer once it came."""

    __slots__ = ("deadline", "event", "message_id", "reply", "request_type")

    def __init__(self, request_type: str, message_id: str, deadline: float) -> None:
        self.request_type = request_type
        self.message_id = message_id
        self.deadline = deadline
        self.event = threading.Event()
        self.reply: _codec.Reply | None = None


def _check_message_id(message_id: object) -> str:
    if type(message_id) is not str or not ID_RE.fullmatch(message_id):
        raise ValueError("message_id must be 32 lowercase hex characters")
    return message_id


def _check_wait(timeout: object, name: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{name} must be a number of seconds or None")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"{name} must be >= 0")
    if math.isinf(timeout):
        return None  # wait without a bound (threading rejects an infinite timeout)
    return float(timeout)


class WorkerConnection:
    """One worker session. Create it with :meth:`orbit_sync.Client.dial_worker`.

    Thread-safe: any thread may call any method. Every request method blocks for at most its
    ``timeout`` (default and cap 10 s); an error raised once the frame may have been sent carries
    ``.message_id`` so the same operation can be re-sent on a new connection after ``resume``.
    ``close()`` ends the transport; it never cancels a business effect.

    Pushes go to ``on_assignment`` / ``on_cancel`` when given (on the reader thread, see
    :meth:`orbit_sync.Client.dial_worker`), else to :meth:`next_assignment` / :meth:`next_cancel`.
    """

    def __init__(
        self,
        transport: Transport,
        welcome: Welcome,
        registration: Registration,
        *,
        on_cancel: Callable[[CancelNotice], None] | None = None,
        on_assignment: Callable[[Assignment], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_call_timeout: float = CALL_TIMEOUT,
        read_idle_timeout: float = READ_IDLE_TIMEOUT,
    ) -> None:
        self._transport = transport
        self._welcome = welcome
        self._registration = registration
        self._ctx = _codec.SessionContext(welcome.session_id, welcome.epoch, registration)
        self._on_cancel = on_cancel
        self._on_assignment = on_assignment
        self._clock = clock
        self._max_call = max_call_timeout
        self._idle = read_idle_timeout
        self._cond = threading.Condition(threading.Lock())
        self._pending: dict[str, _Slot] = {}
        self._err: OrbitError | None = None
        self._wake_at = math.inf  # when the deadline thread next wakes on its own
        self._assignments: queue.Queue[Any] = queue.Queue(ASSIGNMENT_BUFFER)
        self._cancels: queue.Queue[Any] = queue.Queue(CANCEL_BUFFER)
        self._done = threading.Event()
        tag = welcome.session_id[:8]
        self._deadlines = threading.Thread(
            target=self._watch, name=f"orbit-sync-deadlines-{tag}", daemon=True
        )
        self._reader = threading.Thread(
            target=self._read_loop, name=f"orbit-sync-reader-{tag}", daemon=True
        )
        self._deadlines.start()
        self._reader.start()  # last: it may fail the connection at once

    # ------------------------------------------------------------------ state

    @property
    def welcome(self) -> Welcome:
        """The ``worker.welcome`` of this session (the latest one is what ``capacity`` returns)."""
        return self._welcome

    @property
    def session_id(self) -> str:
        """This session's id; every frame in both directions carries it."""
        return self._welcome.session_id

    @property
    def registration(self) -> Registration:
        """The registration sent in ``worker.hello``."""
        return self._registration

    @property
    def err(self) -> OrbitError | None:
        """Why the connection ended (``WorkerClosed`` after ``close()``); ``None`` while open."""
        with self._cond:
            return self._err

    @property
    def done(self) -> threading.Event:
        """Set once the connection has ended and its reader thread has exited."""
        return self._done

    def close(self) -> None:
        """Close the transport at once and wait for the reader to exit. Idempotent, any thread.

        Waiting callers are released with ``WorkerClosed``. Called from the ``on_cancel`` or
        ``on_assignment`` callback (the reader thread), it does not wait for the reader.
        """
        self._fail(WorkerClosed("the connection was closed by close()"))
        if threading.current_thread() not in (self._reader, self._deadlines):
            self._reader.join()

    def __enter__(self) -> WorkerConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        err = self.err
        state = "open" if err is None else f"closed ({type(err).__name__})"
        return (
            f"<WorkerConnection session_id={self._welcome.session_id} "
            f"epoch={self._welcome.epoch} {state}>"
        )

    # ------------------------------------------------------------------ pushes

    def next_assignment(self, timeout: float | None = None) -> Assignment:
        """The next ``task.assign``, when no ``on_assignment`` callback was given: a reservation.
        Only ``start`` grants the right to run.

        Waits at most *timeout* seconds (``None``: until one arrives or the connection ends) and
        raises the built-in ``TimeoutError`` if none arrived, leaving the connection open. Once the
        connection has ended it raises the connection's error (``err``) instead; that error may be
        a ``CallTimeout``, itself a ``TimeoutError``: check ``done`` before waiting again. At most
        8 unread assignments are kept; one more closes the connection with ``WorkerBackpressure``
        (PROTOCOL §10): a consumer that cannot keep up with bursts of up to its capacity should
        pass ``on_assignment`` instead.
        """
        if self._on_assignment is not None:
            raise RuntimeError("assignments go to the on_assignment callback of this connection")
        item = self._take(self._assignments, _check_wait(timeout), "assignment")
        assert isinstance(item, Assignment)
        return item

    def next_cancel(self, timeout: float | None = None) -> CancelNotice:
        """The next ``task.cancel`` push, when no ``on_cancel`` callback was given.

        Only for a registration with ``cancellation_notifications=True``. Same waiting rules as
        :meth:`next_assignment`. At most 256 unread notices are kept; one more closes the
        connection with ``WorkerBackpressure``. A notice is advisory: the lease returned by
        ``renew`` (``cancel_requested_at``) is the authority.
        """
        if not self._registration.cancellation_notifications:
            raise RuntimeError("the registration did not ask for cancellation notifications")
        if self._on_cancel is not None:
            raise RuntimeError("cancel notices go to the on_cancel callback of this connection")
        item = self._take(self._cancels, _check_wait(timeout), "cancel notice")
        assert isinstance(item, CancelNotice)
        return item

    def _take(self, source: queue.Queue[Any], timeout: float | None, what: str) -> object:
        err = self.err
        if err is not None:
            raise err.with_message_id(None)
        try:
            item = source.get(timeout=timeout) if timeout != 0 else source.get_nowait()
        except queue.Empty:
            err = self.err
            if err is not None:
                raise err.with_message_id(None) from None
            raise TimeoutError(f"no {what} within {timeout:g} s") from None
        if item is _CLOSED:
            _wake(source)  # pass the wake-up on to the next waiting reader
        err = self.err
        if err is not None:
            # A reservation on a dead session grants nothing; the server reclaims it.
            raise err.with_message_id(None)
        return item

    # ------------------------------------------------------------------ requests

    def capacity(
        self, report: CapacityReport, *, message_id: str | None = None, timeout: float | None = None
    ) -> Welcome:
        """Report the absolute capacity (``worker.capacity``); also renews the session.

        The first acknowledged report enables assignments. Returns the ack's Welcome.
        """
        if not isinstance(report, CapacityReport):
            raise TypeError("report must be a CapacityReport")
        value, _ = self._call("worker.capacity", report, message_id, timeout)
        return _expect(value, Welcome)

    def resume(
        self, ref: AttemptRef, *, message_id: str | None = None, timeout: float | None = None
    ) -> Lease:
        """Reconcile an attempt of an earlier session and move it to this one.

        Creates nothing, renews nothing and never grants a second run. The returned lease carries
        its local ``deadline``.
        """
        _check_ref(ref)
        value, t_sent = self._call("worker.resume", ref, message_id, timeout)
        return _expect(value, Lease).with_deadline(t_sent)

    def start(
        self, ref: AttemptRef, *, message_id: str | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Start the attempt. Run the handler once, only if ``result.lease.may_run()``."""
        _check_ref(ref)
        return self._command("task.start", ref, message_id, timeout)

    def renew(
        self, ref: AttemptRef, *, message_id: str | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Extend a running attempt's lease. A new ``message_id`` renews again; repeating one only
        returns the original receipt."""
        _check_ref(ref)
        return self._command("task.renew", ref, message_id, timeout)

    def finish(
        self, finish: Finish, *, message_id: str | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Store the outcome. After an ambiguous failure, re-send the same ``Finish`` with the same
        ``message_id`` on a new connection (after ``resume``): the answer is ``deduplicated``.

        A late result is kept as ``EVIDENCE_ONLY``; it does not change the task's outcome.
        """
        if not isinstance(finish, Finish):
            raise TypeError("finish must be a Finish")
        _check_ref(finish.ref)
        return self._command("task.finish", finish, message_id, timeout)

    def _command(
        self, request_type: str, body: Any, message_id: str | None, timeout: float | None
    ) -> CommandResult:
        value, t_sent = self._call(request_type, body, message_id, timeout)
        result = _expect(value, CommandResult)
        return attrs.evolve(result, lease=result.lease.with_deadline(t_sent))

    def _bound(self, timeout: float | None) -> float:
        wait = _check_wait(timeout)
        if wait is None:
            return self._max_call
        if wait <= 0:
            raise ValueError("timeout must be > 0")
        return min(wait, self._max_call)

    def _call(
        self, request_type: str, body: Any, message_id: str | None, timeout: float | None
    ) -> tuple[Any, float]:
        # t_sent precedes the send, so the local deadline never outlives the server's lease.
        t_sent = self._clock()
        if threading.current_thread() is self._reader:
            # From on_cancel or on_assignment: the answer could only be read by this very thread.
            raise RuntimeError(
                "requests cannot be made from the on_cancel or on_assignment callback"
            )
        mid = new_message_id() if message_id is None else _check_message_id(message_id)
        bound = self._bound(timeout)
        slot = _Slot(request_type, mid, time.monotonic() + bound)
        with self._cond:
            if self._err is not None:
                raise self._err.with_message_id(None)  # nothing was sent
            if len(self._pending) >= MAX_IN_FLIGHT:
                raise WorkerBusy(f"{MAX_IN_FLIGHT} requests already in flight; nothing was sent")
            if mid in self._pending:
                raise ValueError("message_id is already in flight on this connection")
            self._pending[mid] = slot
            if slot.deadline < self._wake_at:
                self._cond.notify_all()
        try:
            # Encoded only once a slot is held: a caller over the limit copies nothing.
            text = _codec.encode_request(request_type, mid, self._welcome.session_id, body)
        except BaseException:
            self._forget(slot)
            raise
        try:
            self._transport.send_text(text)
        except Exception:
            # Failed first, forgotten second: a reply to a half-sent frame is then ignored, not
            # mistaken for a protocol violation.
            self._fail(WorkerDisconnected("connection lost while sending"))
            self._forget(slot)
            raise self._error_for(mid) from None
        log.debug("sent %s message_id=%s", request_type, mid)
        slot.event.wait(max(0.0, slot.deadline - time.monotonic()))
        timed_out = False
        with self._cond:
            reply = slot.reply
            if self._pending.get(mid) is slot:
                del self._pending[mid]
            if reply is None and self._err is None:
                self._err = CallTimeout(
                    f"no answer to {request_type} within {bound:g} s; the connection is closed",
                    message_id=mid,
                )
                self._cond.notify_all()
                timed_out = True
            err = self._err
        if timed_out:
            assert err is not None
            self._teardown(err)
        if reply is None:
            raise self._error_for(mid)
        if reply.error is not None:
            raise reply.error.with_message_id(mid)
        return reply.value, t_sent

    def _forget(self, slot: _Slot) -> None:
        with self._cond:
            if self._pending.get(slot.message_id) is slot:
                del self._pending[slot.message_id]

    def _error_for(self, message_id: str | None) -> OrbitError:
        with self._cond:
            err = self._err
        assert err is not None
        return err.with_message_id(message_id)

    # ------------------------------------------------------------------ failure

    def _fail(self, err: OrbitError) -> bool:
        """Record *err* as the connection's error (first one wins) and tear down."""
        with self._cond:
            if self._err is not None:
                return False
            self._err = err
            self._cond.notify_all()
        self._teardown(err)
        return True

    def _teardown(self, err: OrbitError) -> None:
        log.debug("connection %s ended: %s: %s", self.session_id, type(err).__name__, err)
        with self._cond:
            waiting = list(self._pending.values())
        for slot in waiting:
            slot.event.set()
        if isinstance(err, WorkerDisconnected):
            close_code = None  # the transport is gone or untrusted; nothing to say
        elif isinstance(err, WorkerProtocolError):
            close_code = 1002
        else:
            close_code = 1000
        self._transport.abort(close_code)
        _wake(self._assignments)
        _wake(self._cancels)

    # ------------------------------------------------------------------ threads

    def _watch(self) -> None:
        """Deadline thread: read-idle and per-call bounds, on the monotonic clock."""
        while True:
            with self._cond:
                if self._err is not None:
                    return
                now = time.monotonic()
                due = self._transport.last_rx + self._idle
                late: _Slot | None = None
                for slot in self._pending.values():
                    if slot.deadline < due:
                        due, late = slot.deadline, slot
                if now < due:
                    self._wake_at = due
                    self._cond.wait(due - now)
                    self._wake_at = math.inf
                    continue
                err: OrbitError
                if late is not None:
                    err = CallTimeout(
                        f"no answer to {late.request_type} in time; the connection is closed",
                        message_id=late.message_id,
                    )
                else:
                    err = WorkerDisconnected(
                        f"nothing received from the Orbit server for {self._idle:g} s"
                    )
                self._err = err
                self._cond.notify_all()
            self._teardown(err)
            return

    def _read_loop(self) -> None:
        try:
            while True:
                try:
                    raw = self._transport.recv_message()
                except OrbitError as exc:
                    self._fail(exc)
                    return
                except Exception:
                    self._fail(WorkerDisconnected("connection to the Orbit server lost"))
                    return
                if not self._dispatch(raw):
                    return
        finally:
            self._fail(WorkerDisconnected("connection reader stopped"))  # no-op when already set
            self._deadlines.join()
            self._transport.close()
            self._done.set()

    def _pending_type(self, message_id: str) -> str | None:
        with self._cond:
            slot = self._pending.get(message_id)
        return None if slot is None else slot.request_type

    def _dispatch(self, raw: bytes) -> bool:
        """Handle one server frame; False once the connection has ended."""
        if self._err is not None:
            return False
        try:
            event = _codec.decode_server_frame(raw, self._ctx, self._pending_type)
        except WorkerProtocolError as exc:
            self._fail(exc)
            return False
        if isinstance(event, _codec.Reply):
            return self._deliver(event)
        if isinstance(event, _codec.AssignPush):
            a = event.assignment
            log.debug("assignment task_id=%s attempt_id=%s", a.task.task_id, a.attempt_id)
            # Unstarted, a dropped reservation returns to the queue when its lease expires.
            return self._push(
                a, self._on_assignment, "on_assignment", "assignment", self._assignments
            )
        if isinstance(event, _codec.CancelPush):
            return self._cancel(event.notice)
        log.debug("server ended the session: %s", event.error.code)
        self._fail(event.error)
        return False

    def _deliver(self, reply: _codec.Reply) -> bool:
        with self._cond:
            if self._err is not None:
                return False
            slot = self._pending.pop(reply.reply_to, None)
            if slot is not None:
                slot.reply = reply
        if slot is None:
            self._fail(
                WorkerProtocolError("invalid server frame: reply_to names no pending request")
            )
            return False
        slot.event.set()
        if reply.error is not None:
            log.debug("error %s answering message_id=%s", reply.error.code, reply.reply_to)
            if reply.error.fatal:
                # Delivered to its caller first (above), then the connection ends (§11).
                self._fail(reply.error)
                return False
        else:
            log.debug("answer to message_id=%s", reply.reply_to)
        return True

    def _cancel(self, notice: CancelNotice) -> bool:
        log.debug("cancel requested task_id=%s attempt_id=%s", notice.task_id, notice.attempt_id)
        return self._push(notice, self._on_cancel, "on_cancel", "cancel notice", self._cancels)

    def _push(
        self,
        item: Any,
        callback: Callable[[Any], None] | None,
        name: str,
        what: str,
        source: queue.Queue[Any],
    ) -> bool:
        """Hand a push to its callback, or queue it; False once the connection has ended."""
        if callback is not None:
            try:
                callback(item)
            except Exception:
                log.exception("%s callback raised; the %s is dropped", name, what)
            return self._err is None  # the callback may have closed the connection
        try:
            source.put_nowait(item)
        except queue.Full:
            self._fail(
                WorkerBackpressure(
                    f"more than {source.maxsize} {what}s left unread; the connection is closed"
                )
            )
            return False
        return True


def _wake(source: queue.Queue[Any]) -> None:
    # A full queue has no blocked reader, so a failed put wakes nobody who needs it.
    with contextlib.suppress(queue.Full):
        source.put_nowait(_CLOSED)


def _check_ref(ref: object) -> None:
    if not isinstance(ref, AttemptRef):
        raise TypeError("ref must be an AttemptRef (assignment.attempt)")


def _expect(value: object, cls: type[T]) -> T:
    if not isinstance(value, cls):  # the codec maps each request type to its body; defensive
        raise WorkerProtocolError(f"invalid server frame: expected a {cls.__name__} body")
    return value
