"""The client side of ``pulse.worker.v1`` as a pure state machine: no threads, no sockets.

:class:`ClientProtocol` owns every rule a connection enforces between sending bytes and
receiving them (PROTOCOL §6, §10, §11):

* the call table: at most :data:`MAX_IN_FLIGHT` requests in flight, one per ``message_id``;
* each call's deadline (default and cap :data:`CALL_TIMEOUT`) and the read-idle deadline
  (:data:`READ_IDLE_TIMEOUT`), read off an injected clock;
* routing of every server frame: an answer to its call, a push to the caller's queue or callback;
* the assignment-buffer rule: a ``queue.Queue`` of :data:`ASSIGNMENT_BUFFER` unread assignments
  (one that finds it full is :class:`Full`: the reader waits up to :data:`ASSIGNMENT_WAIT` for
  room, then the connection ends with ``WorkerBackpressure``);
* fatal error codes (the answer is delivered, then the connection ends);
* lease deadline math (each answered lease is anchored at the moment its request was sent).

Like a sans-I/O protocol, it answers each input (a request to open, a decoded frame, the time)
with *events* the shell acts on: :class:`Answered` (complete a call), :class:`Pushed` (run a push
callback), :class:`Queued` (wake a thread waiting for a push), :class:`Full` (wait for room on
a push's queue) and :class:`Ended` (tear the socket
down, release the calls). It is not thread-safe by itself:
:class:`orbit_sync.connection.WorkerConnection`, the threaded shell, serializes every mutating
call under one lock, moves bytes, wakes threads and runs callbacks outside that lock. Decoding
(:meth:`ClientProtocol.decode`) only reads the call table and runs outside the lock.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final, NamedTuple, Union

from . import _codec
from ._seconds import seconds
from .errors import (
    CallTimeout,
    FrameError,
    OrbitError,
    WorkerBackpressure,
    WorkerBusy,
    WorkerDisconnected,
    WorkerError,
    WorkerProtocolError,
)
from .models import ID_RE, MAX_CAPACITY, CommandResult, Lease, new_message_id

__all__ = [
    "ASSIGNMENT",
    "ASSIGNMENT_BUFFER",
    "ASSIGNMENT_WAIT",
    "CALL_TIMEOUT",
    "CANCEL",
    "CANCEL_BUFFER",
    "MAX_IN_FLIGHT",
    "READ_IDLE_TIMEOUT",
    "Answered",
    "Call",
    "ClientProtocol",
    "Done",
    "Ended",
    "Event",
    "Full",
    "Pushed",
    "Queued",
    "Submission",
    "call_timeout",
    "check_message_id",
]

#: In-flight control requests per connection; one more raises WorkerBusy before encoding (§10).
MAX_IN_FLIGHT: Final = 32
#: Unread assignments buffered when no ``on_assignment`` callback is set; one more that finds
#: no room within :data:`ASSIGNMENT_WAIT` closes the connection with WorkerBackpressure (§10).
ASSIGNMENT_BUFFER: Final = 8
#: How long the reader waits for room on a full push queue before it ends the connection with
#: WorkerBackpressure. The reader decodes a burst of assignments from one TCP read faster than
#: a waiting consumer thread is scheduled (the GIL), so a consumer that keeps up may still find
#: the 9th of a burst ahead of it; a consumer that stopped taking loses the session within it.
ASSIGNMENT_WAIT: Final = 1.0
#: Unread cancel notices buffered when no ``on_cancel`` callback is set: at most one per held
#: attempt is expected, and a process holds at most 256 attempts.
CANCEL_BUFFER: Final = MAX_CAPACITY
#: Default and maximum bound of one request, from call to answer, write queueing included (§10).
CALL_TIMEOUT: Final = 10.0
#: Default and maximum read-idle bound (§10).
READ_IDLE_TIMEOUT: Final = 60.0

#: The two kinds of push, and how many unread ones of each are buffered without a callback.
ASSIGNMENT: Final = "assignment"
CANCEL: Final = "cancel notice"
_BUFFERS: Final = {ASSIGNMENT: ASSIGNMENT_BUFFER, CANCEL: CANCEL_BUFFER}

#: ``on_done(value, error)``: called exactly once per sent request, with the answer's value
#: (``error`` is ``None``) or with the error that ended the call (bound to its ``message_id``).
Done = Callable[[Any, "OrbitError | None"], None]


def check_message_id(message_id: object) -> str:
    """*message_id* if it is 32 lowercase hex characters, else ValueError."""
    if type(message_id) is not str or not ID_RE.fullmatch(message_id):
        raise ValueError("message_id must be 32 lowercase hex characters")
    return message_id


def call_timeout(value: object, name: str = "timeout", cap: float = CALL_TIMEOUT) -> float:
    """The bound of a call: seconds > 0, at most *cap* (the protocol's, or a connection's own
    tighter maximum); ``None`` or infinity mean the cap."""
    return cap if value is None else seconds(value, name, positive=True, cap=cap)


class _NewestFirst(threading.Condition):
    """A condition whose ``notify`` wakes the thread that began waiting last."""

    def notify(self, n: int = 1) -> None:
        # threading.Condition.notify of Python 3.10-3.13, waking from the other end of the same
        # deque of waiters (Condition.wait appends to it, and removes its own on a timeout).
        if not self._is_owned():  # type: ignore[attr-defined]
            raise RuntimeError("cannot notify on un-acquired lock")
        waiters = self._waiters  # type: ignore[attr-defined]
        while waiters and n > 0:
            waiter = waiters[-1]
            try:
                waiter.release()
            except RuntimeError:  # released by an interrupted notify (as in Condition.notify)
                pass
            else:
                n -= 1
            with contextlib.suppress(ValueError):  # removed by its own timeout meanwhile
                waiters.remove(waiter)


class NewestTakerFirst(queue.Queue[Any]):
    """A ``queue.Queue`` whose next item goes to the taker that began waiting last: the Worker's
    handler thread that just finished an attempt takes the next assignment, so the same few
    threads stay busy (their thread-local state, a database connection say, is reused) and the
    others reach their idle timeout and retire. A plain ``Queue`` wakes the longest waiter."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self.not_empty = _NewestFirst(self.mutex)


#: The answers that carry a lease, anchored at the moment their request was sent.
_ANCHORED: Final = frozenset({CommandResult, Lease})


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


class Submission(NamedTuple):
    """One request of a batch (:meth:`ClientProtocol.open_batch`)."""

    request_type: str
    body: Any
    on_done: Done
    message_id: str | None = None
    timeout: float | None = None


class Answered(NamedTuple):
    """An answer arrived: complete *call* with ``(value, error)``."""

    call: Call
    value: Any
    error: WorkerError | None


class Pushed(NamedTuple):
    """A push of a *kind* that has a callback: hand *item* to it."""

    kind: str
    item: Any


class Queued(NamedTuple):
    """A push of a *kind* without a callback was buffered: wake one thread waiting for it."""

    kind: str


class Full(NamedTuple):
    """A push of a *kind* without a callback found its queue full: the reader waits (a bounded
    time, outside the lock) for room to put *item* there, before it reads the next frame."""

    kind: str
    item: Any


class Ended(NamedTuple):
    """The session ended with *error*: tear down, and release each of *calls* with the error
    bound to its own ``message_id``."""

    error: OrbitError
    calls: list[Call]


Event = Union[Answered, Pushed, Queued, Full, Ended]  # noqa: UP007 (a runtime alias)


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
        callbacks: Collection[str] = (),
    ) -> None:
        self.ctx = ctx
        self.clock = clock
        self.lease_clock = lease_clock or clock
        self.max_call = max_call_timeout
        self.idle = read_idle_timeout
        self.calls: dict[str, Call] = {}
        #: Why the session ended (the first error wins); ``None`` while it is open.
        self.err: OrbitError | None = None
        #: Unread pushes of each kind that has no callback (*callbacks* names those that do):
        #: a bounded ``queue.Queue`` each, which the reader fills without ever blocking.
        #: Pushes received so far, per kind (queued, held for room, or handed to a callback).
        self.received: dict[str, int] = dict.fromkeys(_BUFFERS, 0)
        self.unread: dict[str, queue.Queue[Any]] = {
            kind: NewestTakerFirst(_BUFFERS[kind]) for kind in _BUFFERS if kind not in callbacks
        }

    # ------------------------------------------------------------------ requests

    def bound(self, timeout: float | None) -> float:
        """The bound of one call: *timeout* capped at the connection's maximum."""
        return call_timeout(timeout, cap=self.max_call)

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
        bound = self.max_call if timeout is None else self.bound(timeout)
        if self.err is not None:
            raise self.err.with_message_id(None)  # nothing was sent
        calls = self.calls
        if len(calls) >= MAX_IN_FLIGHT:
            raise WorkerBusy(f"{MAX_IN_FLIGHT} requests already in flight; nothing was sent")
        if mid in calls:
            raise ValueError("message_id is already in flight on this connection")
        t_sent = self.lease_clock()
        # One reading serves both when the leases are on the protocol's own clock (real time).
        now = t_sent if self.lease_clock is self.clock else self.clock()
        call = Call(request_type, mid, bound, now + bound, t_sent, on_done)
        # Encoded only once a slot is held: a caller over the limit copies nothing.
        text = _codec.encode_request(request_type, mid, self.ctx.session_id, body)
        calls[mid] = call
        return call, text

    def open_batch(
        self, requests: Sequence[Submission]
    ) -> tuple[list[str], list[str | None], list[tuple[Submission, OrbitError]]]:
        """Open every request of a batch: ``(texts to send in order, the message_id of each
        request or None, the refused requests with their error)``.

        Wrong arguments (a bad or repeated ``message_id`` or timeout, a body that cannot be
        encoded) raise for the whole batch before any slot is kept. A request the session
        cannot take (it has ended, or too many are in flight) is refused, not sent.
        """
        ids = []
        for r in requests:
            self.bound(r.timeout)  # raises for a bad timeout
            ids.append(new_message_id() if r.message_id is None else check_message_id(r.message_id))
        if len(set(ids)) != len(ids):
            raise ValueError("a message_id is repeated in the batch")
        if any(mid in self.calls for mid in ids):
            raise ValueError("message_id is already in flight on this connection")
        opened: list[Call] = []
        texts: list[str] = []
        sent: list[str | None] = []
        refused: list[tuple[Submission, OrbitError]] = []
        for r, mid in zip(requests, ids, strict=True):
            try:
                call, text = self.open(r.request_type, r.body, mid, r.timeout, r.on_done)
            except FrameError:
                for c in opened:  # a body that cannot be encoded: give every slot back
                    del self.calls[c.message_id]
                raise
            except OrbitError as exc:  # ended, or too many in flight: not sent
                refused.append((r, exc))
                sent.append(None)
                continue
            opened.append(call)
            texts.append(text)
            sent.append(mid)
        return texts, sent, refused

    def pending(self, call: Call) -> bool:
        """True while *call* waits for its answer."""
        return self.calls.get(call.message_id) is call

    def request_type(self, message_id: str) -> str | None:
        """The type of the request in flight under *message_id* (read-only: safe unlocked)."""
        call = self.calls.get(message_id)
        return None if call is None else call.request_type

    # ------------------------------------------------------------------ frames

    def decode(self, raw: bytes | str) -> _codec.ServerEvent:
        """Decode one server frame against the session (raises WorkerProtocolError)."""
        # The codec reads the frame, then the body its request calls for: the request is looked
        # up here between the two, so the codec never calls back into the protocol.
        event = _codec.read_server_frame(raw, self.ctx)
        if isinstance(event, _codec.Addressed):
            return _codec.answer_of(event, self.request_type(event.reply_to), self.ctx)
        return event

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
            if expected in _ANCHORED:
                value = value.with_deadline(call.t_sent)
        del self.calls[reply.reply_to]
        return call, value, reply.error

    @staticmethod
    def is_fatal(error: WorkerError | None) -> bool:
        """True when the session is dead after this answer (PROTOCOL §11)."""
        return error is not None and error.fatal

    def route(self, event: _codec.ServerEvent) -> list[Event]:
        """What one decoded server frame does (nothing once the session has ended)."""
        if self.err is not None:
            return []
        if isinstance(event, _codec.Reply):
            try:
                call, value, error = self.answer(event)
            except WorkerProtocolError as exc:
                return self._end(exc)
            if self.is_fatal(error):
                assert error is not None
                # Delivered to its caller first, then the session ends (§11).
                return [Answered(call, value, error), *self._end(error)]
            return [Answered(call, value, error)]
        if isinstance(event, _codec.AssignPush):
            return self._push(ASSIGNMENT, event.assignment)
        if isinstance(event, _codec.CancelPush):
            return self._push(CANCEL, event.notice)
        return self._end(event.error)  # the server ended the session

    def _push(self, kind: str, item: Any) -> list[Event]:
        self.received[kind] += 1
        unread = self.unread.get(kind)
        if unread is None:
            return [Pushed(kind, item)]
        try:
            unread.put_nowait(item)
        except queue.Full:
            # Waited for by the shell, which ends the session with backpressure() past the bound.
            return [Full(kind, item)]
        return [Queued(kind)]

    def backpressure(self, kind: str) -> list[Event]:
        """A push of *kind* found no room within :data:`ASSIGNMENT_WAIT`: a consumer that fell
        behind loses the session (§10)."""
        maxsize = self.unread[kind].maxsize
        return self.fail(
            WorkerBackpressure(f"more than {maxsize} {kind}s left unread; the connection is closed")
        )

    def take(self, kind: str) -> Any:
        """The oldest unread push of *kind*, or ``None`` (always once the session has ended: a
        reservation on a dead session grants nothing)."""
        if self.err is not None:
            return None
        try:
            return self.unread[kind].get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------------ failure and deadlines

    def fail(self, err: OrbitError) -> list[Event]:
        """End the session with *err*: ``[Ended]``, or nothing when it had already ended (the
        first error wins)."""
        if self.err is not None:
            return []
        return self._end(err)

    def _end(self, err: OrbitError) -> list[Event]:
        self.err = err
        calls = list(self.calls.values())
        self.calls.clear()
        # The unread pushes stay queued: the worker still takes the assignments that reached it
        # (its intake resumes them on the next session); take() no longer returns them.
        return [Ended(err, calls)]

    def next_deadline(self, last_rx: float) -> tuple[float, Call | None]:
        """The next moment something is due: the earliest call deadline or the read-idle one."""
        due = last_rx + self.idle
        late: Call | None = None
        for call in self.calls.values():
            if call.deadline < due:
                due, late = call.deadline, call
        return due, late

    def expire(self, last_rx: float) -> list[Event]:
        """``[Ended]`` if a deadline has passed now (a call's bound, or the read-idle bound
        counted from *last_rx*), else nothing."""
        if self.err is not None:
            return []
        due, late = self.next_deadline(last_rx)
        if self.clock() < due:
            return []
        if late is not None:
            return self._end(self.timeout_error(late))
        return self._end(
            WorkerDisconnected(f"nothing received from the Orbit server for {self.idle:g} s")
        )

    def give_up(self, call: Call) -> list[Event]:
        """A caller's own wait for *call* passed its bound: ``[Ended]`` with its timeout if the
        call is still unanswered (the deadline thread may have ended the session first)."""
        if not self.pending(call):
            return []
        return self._end(self.timeout_error(call))

    @staticmethod
    def timeout_error(call: Call) -> CallTimeout:
        """The error of a call whose bound passed (the connection is then closed)."""
        return CallTimeout(
            f"no answer to {call.request_type} within {call.bound:g} s; the connection is closed",
            message_id=call.message_id,
        )
