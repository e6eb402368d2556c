"""The reader and deadline threads of a :class:`~orbit_sync.connection.WorkerConnection`, and how
it ends.

:class:`ConnectionThreads` is the base of ``WorkerConnection`` that runs on them: the reader's
loop (decode each server frame, route it under the connection's one lock, act on what the
protocol core says outside it), the deadline thread's loop, the reader's wait for room on a full
push queue, and the one failure path every thread ends the connection through. It holds no
state of its own: ``WorkerConnection.__init__`` sets everything declared here and starts the
threads.

* the **reader** only reads: it sets the slot of the call each frame answers, puts pushes on
  their bounded queue (or hands them to the ``on_assignment`` / ``on_cancel`` callbacks),
  answers pings, and blocks on nothing but a full push queue, for at most ``ASSIGNMENT_WAIT``;
* the **deadline thread** enforces the read-idle bound and every call's bound and tears the
  socket down when one passes (neither bound may rely on socket timeouts: over TLS they break
  concurrent read + send).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._protocol import (
    ASSIGNMENT,
    ASSIGNMENT_WAIT,
    Answered,
    ClientProtocol,
    Ended,
    Event,
    Full,
    Pushed,
    Queued,
)
from ._pushes import end_queue, put_before_end
from ._realtime import monotonic
from ._slots import Settable, run_done
from ._transport import FrameTransport
from .errors import OrbitError, WorkerDisconnected, WorkerProtocolError
from .models import Welcome

# The connection's logger: these records are the connection's, as they were before the split.
log = logging.getLogger("orbit_sync.connection")


class ConnectionThreads:
    """The threads of a :class:`~orbit_sync.connection.WorkerConnection` and its end: the base
    class that runs the reader, the deadline thread and the failure path on the connection's
    state (set by ``WorkerConnection.__init__``)."""

    if TYPE_CHECKING:
        # Set by WorkerConnection.__init__, where each is described; declared for the type
        # checker only, so that they are no annotations of the public class.
        _welcome: Welcome
        _transport: FrameTransport
        _callbacks: dict[str, Callable[[Any], None]]
        _core: ClientProtocol
        _lock: threading.Lock
        _timer: threading.Condition
        _wake_at: float
        _done: threading.Event
        _on_end: list[Settable]
        _deadlines: threading.Thread

    # ------------------------------------------------------------------ failure

    def _send_failed(self, exc: Exception) -> None:
        """A write failed: end the connection. The transport raises WorkerDisconnected for the
        network; anything else is a bug, logged with its traceback instead of hidden."""
        if not isinstance(exc, OrbitError):
            log.error("unexpected error while sending; closing the connection", exc_info=exc)
        self._fail(_caused(WorkerDisconnected("connection lost while sending"), exc))

    def _fail(self, err: OrbitError) -> None:
        """End the connection with *err* unless it has already ended (the first error wins)."""
        with self._lock:
            events = self._core.fail(err)
        self._handle(events)

    def _teardown(self, err: OrbitError) -> None:
        log.debug("connection %s ended: %s: %s", self._welcome.session_id, type(err).__name__, err)
        if isinstance(err, WorkerDisconnected):
            close_code = None  # the transport is gone or untrusted; nothing to say
        elif isinstance(err, WorkerProtocolError):
            close_code = 1002
        else:
            close_code = 1000
        self._transport.abort(close_code)

    # ------------------------------------------------------------------ threads

    def _watch(self) -> None:
        """Deadline thread: read-idle and per-call bounds, on the protocol's clock."""
        core = self._core
        with self._lock:
            while core.err is None:
                due, _ = core.next_deadline(self._transport.last_rx)
                now = core.clock()
                if now < due:
                    # Asleep one call bound at most: a call opened meanwhile (its deadline at
                    # least that bound away unless it asked for less) then needs no wake-up,
                    # which would otherwise cost one per call whenever none was in flight.
                    wake = min(due, now + core.max_call)
                    self._wake_at = wake
                    self._timer.wait(wake - now)
                    self._wake_at = math.inf
                    continue
                # Data may have arrived since: then nothing has expired and the wait goes on.
                events = core.expire(self._transport.last_rx)
                if events:
                    break
            else:
                return
        self._handle(events)

    def _read_one(self) -> bool:
        """Read and handle one server message; False once the connection has ended."""
        try:
            return self._dispatch(self._transport.recv_message())
        except OrbitError as exc:  # the transport's failures, typed
            self._fail(exc)
        except Exception as exc:
            # The transport types every network failure: this is a bug. Logged with its
            # traceback, and kept as the cause of the error every caller gets.
            log.error("connection reader failed; closing the connection", exc_info=exc)
            self._fail(_caused(WorkerDisconnected("connection reader failed"), exc))
        return False

    def _read_loop(self) -> None:
        _READER.active = True
        try:
            while self._read_one():
                pass
        finally:
            self._reader_exit()

    def _reader_exit(self) -> None:
        self._fail(WorkerDisconnected("connection reader stopped"))  # no-op when already set
        self._deadlines.join()
        self._transport.close()
        self._done.set()

    def _dispatch(self, raw: bytes) -> bool:
        """Handle one server frame; False once the connection has ended."""
        core = self._core
        if core.err is not None:
            return False
        try:
            event = core.decode(raw)  # unlocked: it only reads the call table
        except WorkerProtocolError as exc:
            self._fail(exc)
            return False
        with self._lock:
            events = core.route(event)  # a push without a callback is put on its queue
        return self._handle(events)

    def _handle(self, events: list[Event]) -> bool:
        """Act on the protocol's events, outside the lock; False once the connection ended."""
        for event in events:
            if type(event) is Answered:
                call = event.call
                run_done(call.on_done, event.value, event.error, call.request_type)
                if event.error is not None:
                    log.debug("error %s answering message_id=%s", event.error.code, call.message_id)
            elif type(event) is Pushed:
                try:
                    self._callbacks[event.kind](event.item)
                except Exception:
                    # Unstarted, a dropped reservation returns to the queue when its lease expires.
                    name = "on_assignment" if event.kind == ASSIGNMENT else "on_cancel"
                    log.exception("%s callback raised; the %s is dropped", name, event.kind)
            elif type(event) is Ended:
                self._ended(event)
            elif type(event) is Queued:
                log.debug("%s queued", event.kind)
            elif type(event) is Full:
                self._wait_for_room(event.kind, event.item)
        return self._core.err is None  # a callback may have closed the connection

    def _wait_for_room(self, kind: str, item: object) -> None:
        """The reader found *kind*'s queue full: wait (reading nothing meanwhile, so the frames'
        order is kept) until a consumer makes room, at most ``ASSIGNMENT_WAIT`` seconds, then
        put *item* there; past the bound the connection ends with backpressure. Should it end
        otherwise meanwhile, *item* is put ahead of the end marker: it was received before the
        end, and a consumer that takes what a connection left (the Worker) loses nothing."""
        unread = self._core.unread[kind]
        deadline = monotonic() + ASSIGNMENT_WAIT
        log.debug("%s queue full: waiting up to %g s for room", kind, ASSIGNMENT_WAIT)
        with unread.not_full:
            while len(unread.queue) >= unread.maxsize and self._core.err is None:
                left = deadline - monotonic()
                if left <= 0:
                    break
                unread.not_full.wait(left)
            if self._core.err is not None:
                put_before_end(unread, item)
                return
            if len(unread.queue) < unread.maxsize:
                unread.queue.append(item)
                unread.unfinished_tasks += 1
                unread.not_empty.notify()
                log.debug("%s queued after waiting for room", kind)
                return
        with self._lock:
            events = self._core.backpressure(kind)
        self._handle(events)

    def _ended(self, event: Ended) -> None:
        err = event.error
        with self._lock:
            self._timer.notify()
            on_end, self._on_end = self._on_end, []
        for unread in self._core.unread.values():
            end_queue(unread)  # wakes every thread waiting for a push
        self._teardown(err)
        for call in event.calls:
            run_done(call.on_done, None, err.with_message_id(call.message_id), call.request_type)
        for wake in on_end:
            try:
                wake.set()
            except Exception:  # one faulty wake-up must not keep the others from theirs
                log.exception("a wake_on_end wake-up raised")


#: Marks the reader threads of every connection (a thread-local flag, set as a reader starts).
_READER = threading.local()


def on_reader_thread() -> bool:
    """Is the calling thread a connection's reader? It only reads: it makes no request and
    never waits for one (internal: the Worker hands such work to another thread)."""
    return getattr(_READER, "active", False)


def _caused(err: OrbitError, cause: BaseException) -> OrbitError:
    """*err* with *cause* as its ``__cause__`` (as ``raise err from cause`` would set it)."""
    err.__cause__ = cause
    return err
