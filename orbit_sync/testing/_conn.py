"""One accepted worker WebSocket of the mock server: its session binding and bounded outbox.

A :class:`Conn` owns one writer thread that drains the outbox into the socket; the server's
handler thread (websockets') produces into it. The outbox policy (PROTOCOL §10):

* an answer finding the outbox full waits for room up to the write deadline, then the client
  is a slow consumer;
* assignments are dispatched only while fewer than ``PUSH_ROOM`` frames wait (they pause, never
  block), and the writer asks for dispatch again once it drained below that mark;
* pushes that cannot wait (cancel notices) may go ``SPILL_FRAMES`` past a full outbox while the
  writer keeps taking frames.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Callable

from websockets.sync.server import ServerConnection

from ..models import MAX_CAPACITY

__all__ = ["OUTBOX_FRAMES", "PUSH_ROOM", "SPILL_FRAMES", "Conn"]

#: Frames a connection may have waiting to be written (PROTOCOL §10). An answer finding no room
#: waits for it up to the write deadline; assignments pause before it fills (``PUSH_ROOM``).
OUTBOX_FRAMES = 8
#: Pushes stop while this many frames wait, keeping room for answers to requests.
PUSH_ROOM = 4
#: How far pushes that cannot wait may go past a full outbox while its writer keeps up: one
#: cancel notice per attempt a session can hold.
SPILL_FRAMES = MAX_CAPACITY


class Conn:
    """One accepted WebSocket: its session binding and its bounded outbox."""

    def __init__(
        self,
        ws: ServerConnection,
        token: str,
        write_timeout: float,
        kick: Callable[[], None],
    ) -> None:
        self.ws = ws
        #: Runs dispatch again once a full outbox drained below ``PUSH_ROOM``.
        self._kick = kick
        self.token = token
        self.session_id: str | None = None
        self._write_timeout = write_timeout
        self._cv = threading.Condition()
        # (text, delay) frames, or (code, reason) close markers as ints/str.
        self._items: collections.deque[tuple[str, float] | tuple[int, str]] = collections.deque()
        self._frames = 0
        # When the writer last took a frame, or was last handed one while idle (monotonic s).
        self._took = time.monotonic()
        self._idle = False
        self.closing = False
        self._aborted = False
        self._want_kick = False
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
            keeping_up = time.monotonic() - self._took < self._write_timeout
            return self._put(text, 0.0, OUTBOX_FRAMES + (SPILL_FRAMES if keeping_up else 0))

    def _put(self, text: str, delay: float, limit: int) -> bool:
        if self.closing:
            return True  # the connection is going away; nothing more is delivered
        if self._frames >= limit:
            return False
        if self._idle:
            self._idle = False
            self._took = time.monotonic()  # the writer had nothing to do: its clock starts now
        self._items.append((text, delay))
        self._frames += 1
        self._cv.notify_all()
        return True

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
            self._items.append((code, reason))
            self._cv.notify_all()

    def abort(self) -> None:
        """Cut the TCP connection now: no close frame, queued frames dropped."""
        with self._cv:
            self.closing = True
            self._aborted = True
            self._items.clear()
            self._frames = 0
            self._cv.notify_all()
        # shutdown() (not close()) wakes a writer blocked in sendall and the reader thread,
        # without taking the websockets mutex a blocked writer may hold.
        with contextlib.suppress(OSError):
            self.ws.socket.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        """Called when the handler ends: flush and close, bounded; then join the writer."""
        self.close_after_flush()
        self._writer.join(2.0)
        if self._writer.is_alive():
            self.abort()
            self._writer.join()

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._aborted:
                    self._idle = True
                    self._cv.wait()
                if self._aborted:
                    return
                item = self._items.popleft()
                if isinstance(item[0], str):
                    self._frames -= 1
                    self._took = time.monotonic()
                    self._cv.notify_all()  # an answer may be waiting for this room
            if isinstance(item[0], int):
                try:
                    self.ws.close(item[0], str(item[1]))
                except Exception:
                    self.abort()
                return
            text, delay = item
            assert isinstance(text, str) and isinstance(delay, float | int)
            if delay:
                with self._cv:
                    if self._cv.wait_for(lambda: self._aborted, timeout=delay):
                        return
            try:
                self.ws.send(text)
            except Exception:
                self.abort()
                return
            with self._cv:
                kick = self._want_kick and self._frames < PUSH_ROOM and not self.closing
                if kick:
                    self._want_kick = False
            if kick:
                self._kick()
