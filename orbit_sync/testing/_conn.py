"""One accepted worker WebSocket of the mock server: its session binding and bounded outbox.

Every byte for the socket goes through a :class:`Conn`, in order: answers and pushes from any
thread, pongs and the close frame from the connection's reader. A frame that finds the outbox
empty and the writer idle is written at once, without blocking, by the thread that produced it
(most frames: a hand-off to another thread costs more CPU than the rest of an answer); what the
socket does not take at once, and everything behind it, goes through the connection's writer
thread. The outbox policy (PROTOCOL §10):

* an answer finding the outbox full waits for room up to the write deadline, then the client
  is a slow consumer;
* assignments are dispatched only while fewer than ``PUSH_ROOM`` frames wait (they pause, never
  block), and the writer asks for dispatch again once it drained below that mark;
* pushes that cannot wait (cancel notices) may go ``SPILL_FRAMES`` past a full outbox while the
  writer keeps taking frames.
"""

from __future__ import annotations

import collections
import socket
import threading
from collections.abc import Callable

from websockets.server import ServerProtocol

from .._realtime import monotonic
from ..models import MAX_CAPACITY
from ._wire import ServerWire, text_frame

__all__ = ["OUTBOX_FRAMES", "PUSH_ROOM", "SPILL_FRAMES", "Conn"]

#: Frames a connection may have waiting to be written (PROTOCOL §10). An answer finding no room
#: waits for it up to the write deadline; assignments pause before it fills (``PUSH_ROOM``).
OUTBOX_FRAMES = 8
#: Pushes stop while this many frames wait, keeping room for answers to requests.
PUSH_ROOM = 4
#: How far pushes that cannot wait may go past a full outbox while its writer keeps up: one
#: cancel notice per attempt a session can hold.
SPILL_FRAMES = MAX_CAPACITY


class _End:
    """The last item of an outbox: the close frame with *code* (``None``: the peer's close was
    already answered, so only what is queued before it is written)."""

    __slots__ = ("code", "reason")

    def __init__(self, code: int | None, reason: str) -> None:
        self.code = code
        self.reason = reason


class Conn:
    """One accepted WebSocket: its session binding, its reader and its bounded outbox."""

    def __init__(
        self,
        sock: socket.socket,
        protocol: ServerProtocol,
        token: str,
        write_timeout: float,
        kick: Callable[[], None],
    ) -> None:
        #: Read by the connection's handler thread only.
        self.wire = ServerWire(sock, protocol, self._control)
        self._sock = sock
        self._dontwait = self.wire.nonblocking_writes
        #: Runs dispatch again once a full outbox drained below ``PUSH_ROOM``.
        self._kick = kick
        self.token = token
        self.session_id: str | None = None
        self._write_timeout = write_timeout
        self._cv = threading.Condition()
        # (encoded bytes, delay before writing, whether it counts as a frame), then an _End.
        self._items: collections.deque[tuple[bytes, float, bool] | _End] = collections.deque()
        self._frames = 0
        # When the writer last took a frame, or was last handed one while idle (monotonic s).
        self._took = monotonic()
        self._idle = False
        # The writer holds an item it took and has not finished writing.
        self._busy = False
        self.closing = False
        self._aborted = False
        self._want_kick = False
        self._kick_due = False
        self._writer = threading.Thread(
            target=self._write_loop, name="orbit-mock-writer", daemon=True
        )

    def start(self) -> None:
        self._writer.start()

    # ------------------------------------------------------------------ producer side

    def offer(self, text: str, delay: float = 0.0) -> bool:
        """Queue one frame if the outbox has room now; False when it is full."""
        with self._cv:
            return self._put(text, delay, OUTBOX_FRAMES)

    def put(self, text: str, delay: float = 0.0) -> bool:
        """Queue one answer, waiting for room up to the write deadline; False when none came."""
        with self._cv:
            self._cv.wait_for(
                lambda: self.closing or self._frames < OUTBOX_FRAMES, self._write_timeout
            )
            return self._put(text, delay, OUTBOX_FRAMES)

    def spill(self, text: str) -> bool:
        """Queue one push that cannot wait: past a full outbox too (up to ``SPILL_FRAMES``
        more) while the writer keeps up, i.e. took a frame within the write deadline. False
        when the writer is stuck on a socket that accepts no data, or too far behind."""
        with self._cv:
            keeping_up = monotonic() - self._took < self._write_timeout
            return self._put(text, 0.0, OUTBOX_FRAMES + (SPILL_FRAMES if keeping_up else 0))

    def _put(self, text: str, delay: float, limit: int) -> bool:
        if self.closing:
            return True  # the connection is going away; nothing more is delivered
        if self._frames >= limit:
            return False
        data = text_frame(text)
        if not delay and self._write_now(data):
            return True
        self._queue(data, delay)
        return True

    def _write_now(self, data: bytes) -> bool:
        """Write *data* at once when nothing is ahead of it; False when it must be queued.
        What the socket took in part is queued as the rest (the caller holds the lock)."""
        if self._items or self._busy or not self._dontwait:
            return False
        try:
            sent = self._sock.send(data, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True  # the connection is failing: its reader sees the end and closes it
        if sent == len(data):
            self._took = monotonic()
            if self._want_kick and self._frames < PUSH_ROOM:
                # Dispatch paused for room that never filled: the writer runs it again (not
                # this thread, which may be inside dispatch).
                self._want_kick = False
                self._kick_due = True
                self._cv.notify_all()
            return True
        self._queue(data[sent:], 0.0)
        return True

    def _queue(self, data: bytes, delay: float, counted: bool = True) -> None:
        if self._idle:
            self._idle = False
            self._took = monotonic()  # the writer had nothing to do: its clock starts now
        self._items.append((data, delay, counted))
        if counted:
            self._frames += 1
        self._cv.notify_all()

    def _control(self, data: bytes, closing: bool) -> None:
        """What the protocol writes on its own (a pong, the echo of the peer's close frame);
        with *closing*, nothing is written after it. Called by the reader, holding the wire's
        lock."""
        with self._cv:
            if self._aborted or (self.closing and not closing):
                return
            if not self._write_now(data):
                self._queue(data, 0.0, counted=False)
            if not self.closing:
                self.closing = closing
                if closing:
                    self._items.append(_End(None, ""))
                    self._cv.notify_all()

    def push_room(self, emitted: int = 0) -> bool:
        """May a push be queued now, *emitted* more being on their way (room for answers)?"""
        with self._cv:
            room = not self.closing and self._frames + emitted < PUSH_ROOM
            if not room:
                # Ask the writer to kick dispatch once it has drained below the mark.
                self._want_kick = True
            return room

    def close_after_flush(self, code: int = 1000, reason: str = "") -> None:
        """Write what is queued, then close with *code*."""
        with self._cv:
            if self.closing:
                return
            self.closing = True
            self._items.append(_End(code, reason))
            self._cv.notify_all()

    def abort(self) -> None:
        """Cut the TCP connection now: no close frame, queued frames dropped."""
        with self._cv:
            self.closing = True
            self._aborted = True
            self._items.clear()
            self._frames = 0
            self._cv.notify_all()
        # shutdown() (not close()) wakes a writer blocked in sendall and the reader.
        self.wire.shutdown()

    def finish(self) -> None:
        """Called when the handler ends: flush and close, bounded; then join the writer and
        release the socket."""
        self.close_after_flush()
        self._writer.join(2.0)
        if self._writer.is_alive():
            self.abort()
            self._writer.join()
        self.wire.close(graceful=not self._aborted)

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                while not self._items and not self._aborted and not self._kick_due:
                    self._idle = True
                    self._cv.wait()
                if self._aborted:
                    return
                if not self._items:
                    self._kick_due = False
                    item = None
                else:
                    item = self._items.popleft()
                    self._busy = True
                    if not isinstance(item, _End) and item[2]:
                        self._frames -= 1
                        self._took = monotonic()
                        self._cv.notify_all()  # an answer may be waiting for this room
            if item is None:
                self._kick()
                continue
            if isinstance(item, _End):
                self._end(item)
                return
            data, delay, _ = item
            if delay:
                with self._cv:
                    if self._cv.wait_for(lambda: self._aborted, timeout=delay):
                        return
            if not self._send(data):
                return
            with self._cv:
                kick = self._want_kick and self._frames < PUSH_ROOM and not self.closing
                if kick:
                    self._want_kick = False
                    self._kick_due = False
            if kick:
                self._kick()

    def _end(self, end: _End) -> None:
        """The close frame, then what the reader queued behind it meanwhile (the echo of a
        close frame crossing ours, which the wire produces instead of ours)."""
        if end.code is not None:
            data = self.wire.close_frame(end.code, end.reason)  # not under _cv: see ServerWire
            if data and not self._send(data):
                return
        with self._cv:
            rest = [item for item in self._items if not isinstance(item, _End)]
            self._items.clear()
        for data, _, _ in rest:
            if not self._send(data):
                return

    def _send(self, data: bytes) -> bool:
        try:
            self._sock.sendall(data)
        except Exception:
            self.abort()
            return False
        return True
