"""The client side of ``pulse.worker.v1`` as a pure state machine: no threads, no sockets.

:class:`ClientProtocol` owns every rule a connection enforces between sending bytes and
receiving them (PROTOCOL §6, §10, §11):

* the call table: at most :data:`MAX_IN_FLIGHT` requests in flight, one per ``message_id``;
* each call's deadline (default and cap :data:`CALL_TIMEOUT`) and the read-idle deadline
  (:data:`READ_IDLE_TIMEOUT`), read off an injected clock;
* routing of every server frame: an answer to its call, a push to the caller's queue or callback;
* the assignment-buffer rule (:data:`ASSIGNMENT_BUFFER` unread assignments);
* fatal error codes (the answer is delivered, then the connection ends);
* lease deadline math (each answered lease is anchored at the moment its request was sent).

It is not thread-safe by itself: :class:`orbit_sync.connection.WorkerConnection`, the threaded
shell, serializes every mutating call under one lock, moves bytes, and runs completion callbacks
outside that lock. Decoding (:meth:`ClientProtocol.decode`) only reads the call table and runs
outside the lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final

from . import _codec
from .errors import (
    CallTimeout,
    OrbitError,
    WorkerBusy,
    WorkerDisconnected,
    WorkerError,
    WorkerProtocolError,
)
from .models import ID_RE, MAX_CAPACITY, CommandResult, Lease, anchor_lease, new_message_id

__all__ = [
    "ASSIGNMENT_BUFFER",
    "CALL_TIMEOUT",
    "CANCEL_BUFFER",
    "MAX_IN_FLIGHT",
    "READ_IDLE_TIMEOUT",
    "Call",
    "ClientProtocol",
    "Done",
    "check_message_id",
    "check_wait",
]

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

#: ``on_done(value, error)``: called exactly once per sent request, with the answer's value
#: (``error`` is ``None``) or with the error that ended the call (bound to its ``message_id``).
Done = Callable[[Any, "OrbitError | None"], None]


def check_message_id(message_id: object) -> str:
    """*message_id* if it is 32 lowercase hex characters, else ValueError."""
    if type(message_id) is not str or not ID_RE.fullmatch(message_id):
        raise ValueError("message_id must be 32 lowercase hex characters")
    return message_id


def check_wait(timeout: object, name: str = "timeout") -> float | None:
    """A wait in seconds: ``None`` (or infinity) waits without a bound; negatives and NaN raise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"{name} must be a number of seconds or None")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"{name} must be >= 0")
    if math.isinf(timeout):
        return None  # wait without a bound (threading rejects an infinite timeout)
    return float(timeout)


class Call:
    """One request in flight: its deadline, when it was sent, and who to tell."""

    __slots__ = ("bound", "deadline", "message_id", "on_done", "request_type", "t_sent")

    def __init__(
        self,
        request_type: str,
        message_id: str,
        bound: float,
        deadline: float,
        t_sent: float,
        on_done: Done,
    ) -> None:
        self.request_type = request_type
        self.message_id = message_id
        self.bound = bound
        self.deadline = deadline
        #: On the lease clock, taken before the frame is sent, so the local deadline computed
        #: from it never outlives the server's lease.
        self.t_sent = t_sent
        self.on_done = on_done


class ClientProtocol:
    """The rules of one worker session, driven by frames and an injected clock."""

    def __init__(
        self,
        ctx: _codec.SessionContext,
        *,
        clock: Callable[[], float],
        lease_clock: Callable[[], float] | None = None,
        max_call_timeout: float = CALL_TIMEOUT,
        read_idle_timeout: float = READ_IDLE_TIMEOUT,
    ) -> None:
        self.ctx = ctx
        self.clock = clock
        self.lease_clock = lease_clock or clock
        self.max_call = max_call_timeout
        self.idle = read_idle_timeout
        self.calls: dict[str, Call] = {}
        #: Why the session ended (the first error wins); ``None`` while it is open.
        self.err: OrbitError | None = None

    # ------------------------------------------------------------------ requests

    def bound(self, timeout: float | None) -> float:
        """The bound of one call: *timeout* capped at the connection's maximum."""
        wait = check_wait(timeout)
        if wait is None:
            return self.max_call
        if wait <= 0:
            raise ValueError("timeout must be > 0")
        return min(wait, self.max_call)

    def open(
        self,
        request_type: str,
        body: Any,
        message_id: str | None,
        timeout: float | None,
        on_done: Done,
    ) -> tuple[Call, str]:
        """Take a slot for one request and encode its frame; the caller sends the text.

        Raises before anything is sent: the session's error, ``WorkerBusy`` past
        :data:`MAX_IN_FLIGHT`, ``ValueError`` for a bad or duplicate ``message_id`` or timeout,
        ``FrameError`` for a body that cannot be encoded (the slot is then given back).
        """
        mid = new_message_id() if message_id is None else check_message_id(message_id)
        bound = self.bound(timeout)
        if self.err is not None:
            raise self.err.with_message_id(None)  # nothing was sent
        calls = self.calls
        if len(calls) >= MAX_IN_FLIGHT:
            raise WorkerBusy(f"{MAX_IN_FLIGHT} requests already in flight; nothing was sent")
        if mid in calls:
            raise ValueError("message_id is already in flight on this connection")
        t_sent = self.lease_clock()
        call = Call(request_type, mid, bound, self.clock() + bound, t_sent, on_done)
        # Encoded only once a slot is held: a caller over the limit copies nothing.
        text = _codec.encode_request(request_type, mid, self.ctx.session_id, body)
        calls[mid] = call
        return call, text

    def request_type(self, message_id: str) -> str | None:
        """The type of the request in flight under *message_id* (read-only: safe unlocked)."""
        call = self.calls.get(message_id)
        return None if call is None else call.request_type

    # ------------------------------------------------------------------ frames

    def decode(self, raw: bytes | str) -> _codec.ServerEvent:
        """Decode one server frame against the session (raises WorkerProtocolError)."""
        return _codec.decode_server_frame(raw, self.ctx, self.request_type)

    def answer(self, reply: _codec.Reply) -> tuple[Call, Any, WorkerError | None]:
        """Match *reply* to its call and remove the call: (call, value, error).

        A value is final: a lease in it carries its local deadline. A fatal error is returned to
        its caller first; the shell then ends the session with it (:meth:`is_fatal`).
        """
        call = self.calls.get(reply.reply_to)
        if call is None:
            raise WorkerProtocolError("invalid server frame: reply_to names no pending request")
        value = reply.value
        if reply.error is None:
            # The codec maps each request type to its body; checked, not assumed. A frame that
            # fails here leaves the call in the table, to be released with the protocol error.
            expected = _codec.ACK_BODIES[call.request_type]
            if not isinstance(value, expected):
                raise WorkerProtocolError(
                    f"invalid server frame: expected a {expected.__name__} body"
                )
            if isinstance(value, CommandResult):
                anchor_lease(value.lease, call.t_sent)
            elif isinstance(value, Lease):
                anchor_lease(value, call.t_sent)
        del self.calls[reply.reply_to]
        return call, value, reply.error

    @staticmethod
    def is_fatal(error: WorkerError | None) -> bool:
        """True when the session is dead after this answer (PROTOCOL §11)."""
        return error is not None and error.fatal

    # ------------------------------------------------------------------ failure and deadlines

    def fail(self, err: OrbitError) -> list[Call]:
        """End the session with *err* (the first error wins) and hand back every call in flight,
        each to be released with the error bound to its own ``message_id``."""
        if self.err is not None:
            return []
        self.err = err
        calls = list(self.calls.values())
        self.calls.clear()
        return calls

    def forget(self, call: Call) -> bool:
        """Drop *call* without an answer (its frame was never sent); True if it was in flight."""
        if self.calls.get(call.message_id) is call:
            del self.calls[call.message_id]
            return True
        return False

    def next_deadline(self, last_rx: float) -> tuple[float, Call | None]:
        """The next moment something is due: the earliest call deadline or the read-idle one."""
        due = last_rx + self.idle
        late: Call | None = None
        for call in self.calls.values():
            if call.deadline < due:
                due, late = call.deadline, call
        return due, late

    def expired(self, last_rx: float) -> OrbitError | None:
        """The error that ends the session if a deadline has passed now, else ``None``."""
        due, late = self.next_deadline(last_rx)
        if self.clock() < due:
            return None
        if late is not None:
            return self.timeout_error(late)
        return WorkerDisconnected(f"nothing received from the Orbit server for {self.idle:g} s")

    @staticmethod
    def timeout_error(call: Call) -> CallTimeout:
        """The error of a call whose bound passed (the connection is then closed)."""
        return CallTimeout(
            f"no answer to {call.request_type} within {call.bound:g} s; the connection is closed",
            message_id=call.message_id,
        )
