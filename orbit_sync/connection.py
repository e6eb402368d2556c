"""``WorkerConnection``: one ``pulse.worker.v1`` session over one WebSocket.

No reconnects, renewals or handlers here (that is :mod:`orbit_sync.worker`): a thread-safe,
bounded client of the protocol. The rules live in a pure protocol core, without threads (see
docs/architecture.md); this module is its threaded shell: it moves frames, holds the one lock
around the protocol's state and wakes whoever waits.

Two daemon threads per connection, both joined by :meth:`WorkerConnection.close`:

* the **reader** only reads: it decodes every server frame, sets the slot of the call it
  answers (waking the caller that waits on it), puts pushes on
  their bounded ``queue.Queue`` (or hands them to the ``on_assignment`` / ``on_cancel``
  callbacks), answers pings, and blocks on nothing but a full push queue, for at most
  ``ASSIGNMENT_WAIT`` (1 s: past it the connection closes with ``WorkerBackpressure``). It is
  the only thread that reads the socket: every call in flight holds one of at most 32 slots,
  each a reused ``threading.Event`` the reader sets; a blocking caller waits on its own slot
  until its deadline, so an
  interrupted or timed-out caller abandons its slot and never leaves a frame half read. Code
  running on a reader (a push callback) neither blocks nor writes: a request or a queue wait
  made from it raises ``RuntimeError`` at once, and ``close()`` from it does not wait for the
  reader;
* the **deadline thread** enforces the read-idle bound (60 s) and every call's bound (10 s, write
  queueing included) and tears the socket down when one passes. It exists because neither bound may
  rely on socket timeouts (over TLS they break concurrent read + send), and a caller
  stuck in a blocked write cannot time itself out.

On any failure the connection records one error (``err``), releases every call in flight at once
with that error bound to the call's own ``message_id``, and sets ``done`` once the reader exited.

Several requests may go out in one write (:meth:`WorkerConnection.send_many`): each still has
its own slot, and the caller waits on each (:class:`PendingCall`).

This module holds the public request methods, the one lock and the send path, read together to
check that no wait can outlive its deadline. The two threads' loops, the failure path and the
handling of the protocol's events (outside the lock: no callback runs under it) are a base
class of ``WorkerConnection``; the call slots, the push queues' end marker and the request
checks have modules of their own (docs/architecture.md names each).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from . import _codec
from ._codec import check_ref, check_request
from ._protocol import (
    ASSIGNMENT,
    ASSIGNMENT_BUFFER,
    ASSIGNMENT_WAIT,
    CALL_TIMEOUT,
    CANCEL,
    CANCEL_BUFFER,
    MAX_IN_FLIGHT,
    READ_IDLE_TIMEOUT,
    Call,
    ClientProtocol,
    Submission,
)
from ._pushes import ENDED, end_queue
from ._reader import ConnectionThreads, on_reader_thread
from ._realtime import monotonic
from ._seconds import wait_seconds
from ._slots import Settable, Slot, unset
from ._transport import FrameTransport
from .errors import OrbitError, WorkerClosed
from .models import (
    Assignment,
    AttemptRef,
    CancelNotice,
    CapacityReport,
    CommandResult,
    Finish,
    Lease,
    Registration,
    Welcome,
)

__all__ = [
    "ASSIGNMENT_BUFFER",
    "ASSIGNMENT_WAIT",
    "CALL_TIMEOUT",
    "CANCEL_BUFFER",
    "MAX_IN_FLIGHT",
    "READ_IDLE_TIMEOUT",
    "BatchCall",
    "FrameTransport",
    "PendingCall",
    "Settable",
    "WorkerConnection",
]

log = logging.getLogger("orbit_sync.connection")

#: How long ``close()`` waits for the reader thread. Once the socket is shut down the reader
#: ends at once, unless a callback of the connection is blocking it (callbacks must not block);
#: then ``close()`` returns without it, and ``done`` is set when the callback returns.
READER_EXIT_WAIT = 5.0

T = TypeVar("T")


class BatchCall(NamedTuple):
    """One request of :meth:`WorkerConnection.send_many`: its type (``"task.renew"``, ...), its
    body (the model the matching method takes), and optionally its ``message_id`` and timeout."""

    request_type: str
    body: Any
    message_id: str | None = None
    timeout: float | None = None


class PendingCall:
    """A request :meth:`WorkerConnection.send_many` sent, and its answer: the caller waits on
    its slot with :meth:`result` (read each one: its slot is reused only then)."""

    __slots__ = ("_call", "_conn", "_error", "_slot", "message_id", "request_type")

    def __init__(
        self,
        conn: WorkerConnection,
        request_type: str,
        message_id: str | None,
        call: Any = None,
        slot: Any = None,
        error: OrbitError | None = None,
    ) -> None:
        # Made by send_many (call and slot: the connection's own, for one sent request).
        self._conn = conn
        self.request_type = request_type
        #: ``None`` for a request that was refused before the wire.
        self.message_id = message_id
        self._call = call
        self._slot = slot
        self._error = error

    def done(self) -> bool:
        """Has its answer (or failure) arrived? Never blocks."""
        slot = self._slot
        return slot is None or slot.event.is_set()

    def result(self) -> Any:
        """Wait for the answer on the call's slot, at most until its deadline, and return it;
        raise the server's error, the connection's, or why it was not sent. Once only."""
        slot, call = self._slot, self._call
        if slot is None or call is None:
            error, self._error = self._error, None
            if error is None:
                raise RuntimeError("this call's result was already read")
            raise error
        self._slot = None
        return self._conn._wait(call, slot)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<PendingCall {self.request_type} message_id={self.message_id} {state}>"


class WorkerConnection(ConnectionThreads):
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
        transport: FrameTransport,
        welcome: Welcome,
        registration: Registration,
        *,
        on_cancel: Callable[[CancelNotice], None] | None = None,
        on_assignment: Callable[[Assignment], None] | None = None,
        clock: Callable[[], float] = monotonic,
        max_call_timeout: float = CALL_TIMEOUT,
        read_idle_timeout: float = READ_IDLE_TIMEOUT,
    ) -> None:
        self._transport = transport
        self._welcome = welcome
        self._registration = registration
        self._callbacks: dict[str, Callable[[Any], None]] = {}
        if on_assignment is not None:
            self._callbacks[ASSIGNMENT] = on_assignment
        if on_cancel is not None:
            self._callbacks[CANCEL] = on_cancel
        # Deadlines are waited for in real time; *clock* only anchors the leases it returns.
        self._core = ClientProtocol(
            _codec.SessionContext(welcome.session_id, welcome.epoch, registration),
            clock=monotonic,
            lease_clock=clock,
            max_call_timeout=max_call_timeout,
            read_idle_timeout=read_idle_timeout,
            callbacks=self._callbacks,
        )
        self._lock = threading.Lock()
        #: Idle call slots (see :class:`Slot`): created on demand, so never more than the most
        #: calls ever in flight at once (at most MAX_IN_FLIGHT), and reused.
        self._slots: list[Slot] = []
        # The deadline thread sleeps on this; it is woken only for a call due before that.
        self._timer = threading.Condition(self._lock)
        self._wake_at = math.inf
        self._done = threading.Event()
        #: Set once the connection has ended (see wake_on_end).
        self._on_end: list[Settable] = []
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
        return self._core.err

    @property
    def done(self) -> threading.Event:
        """Set once the connection has ended and its reader thread has exited."""
        return self._done

    def wake_on_end(self, wake: Settable) -> None:
        """Set *wake* as the connection ends (at once if it has ended): a thread waiting for
        something else as well learns of the end without polling ``done``."""
        with self._lock:
            ended = self._core.err is not None
            if not ended:
                self._on_end.append(wake)
        if ended:
            wake.set()

    def close(self) -> None:
        """Close the transport at once and wait for the reader to exit. Idempotent, any thread.

        Waiting callers are released with ``WorkerClosed``. Called from the ``on_cancel`` or
        ``on_assignment`` callback (the reader thread), it does not wait for the reader; from
        another thread it waits at most :data:`READER_EXIT_WAIT` seconds (only a blocking
        callback keeps the reader that long; ``done`` is set once it has exited).
        """
        self._fail(WorkerClosed("the connection was closed by close()"))
        if threading.current_thread() not in (self._reader, self._deadlines):
            self._reader.join(READER_EXIT_WAIT)
            if self._reader.is_alive():
                log.warning(
                    "connection %s: its reader is still inside a callback %g s after close(); "
                    "not waiting for it (callbacks must not block)",
                    self.session_id,
                    READER_EXIT_WAIT,
                )

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

    def next_assignment(
        self, timeout: float | None = None, *, after_end: bool = False
    ) -> Assignment:
        """The next ``task.assign``, when no ``on_assignment`` callback was given: a reservation.
        Only ``start`` grants the right to run.

        Waits at most *timeout* seconds (``None``: until one arrives or the connection ends) and
        raises the built-in ``TimeoutError`` if none arrived, leaving the connection open. Once the
        connection has ended it raises the connection's error (``err``) instead; that error may be
        a ``CallTimeout``, itself a ``TimeoutError``: check ``done`` before waiting again. At most
        8 unread assignments are kept; for one more the reader waits up to ``ASSIGNMENT_WAIT``
        (1 s) for room, reading nothing meanwhile, then closes the connection with
        ``WorkerBackpressure`` (PROTOCOL §10): a consumer that takes each assignment as it comes
        keeps up with bursts of any size.

        *after_end*: also return the assignments received before the connection ended, in order,
        before raising its error. Such a reservation can no longer be started on this session:
        ``resume`` it on the next one first (the Worker does), or leave it to the server, which
        reclaims it when its lease ends.
        """
        if ASSIGNMENT in self._callbacks:
            raise RuntimeError("assignments go to the on_assignment callback of this connection")
        item = self._take(ASSIGNMENT, wait_seconds(timeout), after_end=after_end)
        assert isinstance(item, Assignment)
        return item

    @property
    def assignments_received(self) -> int:
        """How many ``task.assign`` pushes this connection has received so far (taken or not):
        after an answer, every assignment the server made before it is counted."""
        return self._core.received[ASSIGNMENT]

    def next_cancel(self, timeout: float | None = None) -> CancelNotice:
        """The next ``task.cancel`` push, when no ``on_cancel`` callback was given.

        Only for a registration with ``cancellation_notifications=True``. Same waiting rules as
        :meth:`next_assignment`. At most 256 unread notices are kept; one more closes the
        connection with ``WorkerBackpressure``. A notice is advisory: the lease returned by
        ``renew`` (``cancel_requested_at``) is the authority.
        """
        if not self._registration.cancellation_notifications:
            raise RuntimeError("the registration did not ask for cancellation notifications")
        if CANCEL in self._callbacks:
            raise RuntimeError("cancel notices go to the on_cancel callback of this connection")
        item = self._take(CANCEL, wait_seconds(timeout))
        assert isinstance(item, CancelNotice)
        return item

    def _take(self, kind: str, timeout: float | None, *, after_end: bool = False) -> object:
        """The next unread push of *kind*, waiting at most *timeout* seconds (None: no bound);
        *after_end*: also one received before the connection ended."""
        if timeout != 0:
            self._refuse_on_reader("waiting for the next %s", kind)
        unread = self._core.unread[kind]
        # Once ended, the end marker is on the queue: a get never blocks past what is left.
        if after_end or self._core.err is None:
            try:
                item = unread.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no {kind} within {timeout:g} s") from None
            if item is ENDED:
                end_queue(unread)  # for the next taker
            elif after_end or self._core.err is None:
                return item
        # A reservation on a dead session grants nothing; the server reclaims it.
        err = self._core.err
        assert err is not None
        raise err.with_message_id(None)

    # ------------------------------------------------------------------ requests

    def capacity(
        self, report: CapacityReport, *, message_id: str | None = None, timeout: float | None = None
    ) -> Welcome:
        """Report the absolute capacity (``worker.capacity``); also renews the session.

        The first acknowledged report enables assignments. Returns the ack's Welcome.
        """
        if not isinstance(report, CapacityReport):
            raise TypeError("report must be a CapacityReport")
        value: Welcome = self._call("worker.capacity", report, message_id, timeout)
        return value

    def resume(
        self, ref: AttemptRef, *, message_id: str | None = None, timeout: float | None = None
    ) -> Lease:
        """Reconcile an attempt of an earlier session and move it to this one.

        Creates nothing, renews nothing and never grants a second run. The returned lease carries
        its local ``deadline``.
        """
        check_ref(ref)
        value: Lease = self._call("worker.resume", ref, message_id, timeout)
        return value

    def start(
        self, ref: AttemptRef, *, message_id: str | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Start the attempt. Run the handler once, only if ``result.lease.may_run()``."""
        check_ref(ref)
        value: CommandResult = self._call("task.start", ref, message_id, timeout)
        return value

    def renew(
        self, ref: AttemptRef, *, message_id: str | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Extend a running attempt's lease. A new ``message_id`` renews again; repeating one only
        returns the original receipt."""
        check_ref(ref)
        value: CommandResult = self._call("task.renew", ref, message_id, timeout)
        return value

    def finish(
        self, finish: Finish, *, message_id: str | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Store the outcome. After an ambiguous failure, re-send the same ``Finish`` with the same
        ``message_id`` on a new connection (after ``resume``): the answer is ``deduplicated``.

        A late result is kept as ``EVIDENCE_ONLY``; it does not change the task's outcome.
        """
        if not isinstance(finish, Finish):
            raise TypeError("finish must be a Finish")
        check_ref(finish.ref)
        value: CommandResult = self._call("task.finish", finish, message_id, timeout)
        return value

    def _call(
        self, request_type: str, body: Any, message_id: str | None, timeout: float | None
    ) -> Any:
        self._refuse_on_reader("a %s request", request_type)
        call, slot = self._send(request_type, body, message_id, timeout)
        return self._wait(call, slot)

    def _wait(self, call: Call, slot: Slot) -> Any:
        """Wait on *slot* for *call*'s answer, at most until its deadline; return it or raise."""
        # The slot is freed only after a completed wait: after an exception (Ctrl-C while the
        # call may be in flight) it is left to the late answer, and never reused.
        if not slot.event.wait(max(0.0, call.deadline - monotonic())):
            # Normally the deadline thread ends the connection first; if it did not, do it here.
            with self._lock:
                events = self._core.give_up(call)
            self._handle(events)
            slot.event.wait()  # completed (by the answer or the failure) just now
        value, error = slot.value, slot.error
        slot.release()
        if error is not None:
            raise error
        return value

    def send_many(
        self, calls: Sequence[BatchCall], *, wake: Settable | None = None
    ) -> list[PendingCall]:
        """Send several requests in one socket write, each in its own slot, without waiting;
        wait for each answer with :meth:`PendingCall.result` (the lease watchdog of a Worker
        renews every lease due at once this way).

        Wrong arguments (an unknown type, a wrong body, a bad or repeated ``message_id`` or
        timeout) raise before anything is sent, for the whole batch. A request the connection
        cannot take (it has ended, or :data:`MAX_IN_FLIGHT` are in flight) is not sent: its
        ``result()`` raises why, its ``message_id`` is ``None`` and *wake* is not set for it.
        *wake*, if given, is also set as each answer arrives (on the
        reader thread: it must only record and wake), so one thread can wait for the first
        answer of many, or for something else beside them.
        """
        self._refuse_on_reader("a batch of requests")
        for c in calls:
            if not isinstance(c, BatchCall):
                raise TypeError("calls must be BatchCall tuples")
            check_request(c.request_type, c.body)
        submissions = [
            Submission(c.request_type, c.body, unset, c.message_id, c.timeout) for c in calls
        ]
        pending: list[PendingCall] = []
        with self._lock:
            texts, ids, refused = self._core.open_batch(submissions)
            errors = {id(r): err for r, err in refused}
            table = self._core.calls
            earliest = math.inf
            for c, sub, mid in zip(calls, submissions, ids, strict=True):
                if mid is None:
                    pending.append(PendingCall(self, c.request_type, None, error=errors[id(sub)]))
                    continue
                call = table[mid]
                slot = self._take_slot()
                slot.wake = wake
                call.on_done = slot.complete
                earliest = min(earliest, call.deadline)
                pending.append(PendingCall(self, c.request_type, mid, call, slot))
            # Only a deadline before the deadline thread's wake-up needs it woken (see _send):
            # waking it for every batch made it contend for the GIL and this lock each time.
            if earliest < self._wake_at:
                self._timer.notify()
        # A failure completes every call of the batch with its error.
        if texts and self._write(self._transport.send_texts, texts):
            log.debug("sent %d requests in one write", len(texts))
        return pending

    def _refuse_on_reader(self, what: str, *args: str) -> None:
        """Fail at once on a connection's reader thread: it only reads (a wait there could only
        be ended by itself, and it writes no request). *what* % *args* names the refused call,
        formatted only then: this check is on every request's path."""
        if on_reader_thread():
            raise RuntimeError(
                f"{what % args} cannot be made on a connection's reader thread (a callback of a "
                "connection: on_assignment or on_cancel); make it from another thread"
            )

    def _send(
        self, request_type: str, body: Any, message_id: str | None, timeout: float | None
    ) -> tuple[Call, Slot]:
        with self._lock:
            call, text = self._core.open(request_type, body, message_id, timeout, unset)
            # A slot only for a call that goes out: a refused one never makes a new slot.
            slot = self._take_slot()
            call.on_done = slot.complete
            if call.deadline < self._wake_at:  # before what the deadline thread sleeps until
                self._timer.notify()
        if self._write(self._transport.send_text, text):
            log.debug("sent %s message_id=%s", request_type, call.message_id)
        return call, slot

    def _take_slot(self) -> Slot:
        """An idle slot (a new one while fewer than the calls in flight exist)."""
        return self._slots.pop() if self._slots else Slot(self._slots)

    def _write(self, send: Callable[[T], None], data: T) -> bool:
        """``send(data)``; False once a failed write ended the connection."""
        try:
            send(data)
        except Exception as exc:
            # Failed first: a reply to a half-sent frame is then ignored, not mistaken for a
            # protocol violation; the failure completes the calls in flight with its error.
            self._send_failed(exc)
            return False
        return True
