"""The mock server's side of one WebSocket after its opening handshake: frames in, bytes out.

websockets' sans-I/O :class:`~websockets.server.ServerProtocol` parses what the client sends
(masking, fragment and size rules, control frames, the closing handshake); this module moves
the bytes on the connection's own handler thread. websockets' threaded ``ServerConnection``
would add a reader thread and a hand-off per frame in, and a protocol lock, a context manager
and a frame object per frame out: about a tenth of the server's CPU per task.

Reading happens on one thread only (the connection's handler). Writing belongs to
:class:`~._conn.Conn`, which orders every byte this module hands it (answers, pushes, pongs,
the close frame) on the socket; :func:`text_frame` encodes an outgoing message without the
protocol object, so producers on other threads never touch it.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import ssl
import threading
from collections.abc import Callable

from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from .._realtime import monotonic
from .._transport import OP_TEXT, frame_header

__all__ = ["CLOSE_TIMEOUT", "InvalidText", "ServerWire", "WireClosed", "text_frame"]

#: How long a closing connection waits for the peer's close frame and end of stream.
CLOSE_TIMEOUT = 0.5
#: Bytes asked of the socket per read.
_READ_SIZE = 65536


class WireClosed(Exception):
    """The WebSocket is closed: closing handshake, end of stream, or a protocol error."""


class InvalidText(Exception):
    """A text message that is not valid UTF-8 (PROTOCOL §2): the connection stays readable so
    that the server can answer ``INVALID_FRAME`` before it closes."""


def text_frame(text: str) -> bytes:
    """One unfragmented, unmasked text frame carrying *text* (RFC 6455 §5.2)."""
    payload = text.encode()
    return frame_header(OP_TEXT, len(payload), 0) + payload


#: Receives what the protocol wants written (pongs, the echo of a close frame) and whether
#: the connection is closing with it, so that nothing is queued behind a close frame.
Control = Callable[[bytes, bool], None]


class ServerWire:
    """Reads and parses frames for one connection whose opening handshake *protocol* completed.

    :meth:`recv` and :meth:`close` are called by one thread only (the handler);
    :meth:`close_frame` by the connection's writer, never while holding the connection's lock
    (the reader takes that one inside this wire's); :meth:`shutdown` by anyone.
    """

    def __init__(self, sock: socket.socket, protocol: ServerProtocol, control: Control) -> None:
        self.sock = sock
        self._protocol = protocol
        self._control = control
        # The protocol object is fed by the reader and asked for a close frame by the writer.
        # The reader holds this lock until it handed the bytes the protocol produced to the
        # connection, so a close frame and the echo of the peer's close are never both sent.
        self._lock = threading.Lock()
        self._tls = isinstance(sock, ssl.SSLSocket)
        #: Whether a write that must not block can be tried on this socket (plain TCP where
        #: the platform has ``MSG_DONTWAIT``; TLS records cannot be written partially).
        self.nonblocking_writes = not self._tls and hasattr(socket, "MSG_DONTWAIT")
        self._messages: collections.deque[str | bytes | InvalidText] = collections.deque()
        self._parts: list[bytes | bytearray | memoryview] = []
        self._binary = False
        self._ended = False
        self._poll = select.poll() if hasattr(select, "poll") else None
        if self._poll is not None:
            self._poll.register(sock, select.POLLIN)

    # ------------------------------------------------------------------ reading

    def recv(self, timeout: float | None) -> str | bytes:
        """The next message: ``str`` for text, ``bytes`` for binary.

        Raises :class:`TimeoutError` when none came within *timeout* seconds, :class:`InvalidText`
        for a text message that is not UTF-8, and :class:`WireClosed` once the connection ended.
        """
        deadline = None if timeout is None else monotonic() + timeout
        while not self._messages:
            if self._ended:
                raise WireClosed("the connection is closed")
            self._feed(self._read(deadline))
        message = self._messages.popleft()
        if isinstance(message, InvalidText):
            raise message
        return message

    def _read(self, deadline: float | None) -> bytes:
        sock = self.sock
        if not (self._tls and sock.pending()):  # type: ignore[attr-defined]
            remaining = None if deadline is None else max(deadline - monotonic(), 0.0)
            if not self._readable(remaining):
                raise TimeoutError("no frame within the read deadline")
        try:
            return sock.recv(_READ_SIZE)
        except OSError:  # reset, or shut down by abort(): the end of the stream either way
            return b""

    def _readable(self, timeout: float | None) -> bool:
        if self._poll is not None:
            return bool(self._poll.poll(None if timeout is None else timeout * 1000.0))
        ready, _, _ = select.select([self.sock], [], [], timeout)
        return bool(ready)

    def _feed(self, data: bytes) -> None:
        protocol = self._protocol
        with self._lock:
            if data:
                protocol.receive_data(data)
            else:
                protocol.receive_eof()
            events = protocol.events_received()
            # The end-of-stream marker is b"": close() ends the stream.
            out = b"".join(protocol.data_to_send())
            closing = protocol.state is not State.OPEN
            if out:
                self._control(out, closing)
        for frame in events:
            if not isinstance(frame, Frame):
                continue  # no HTTP event follows a completed handshake
            opcode = frame.opcode
            if opcode is Opcode.TEXT or opcode is Opcode.BINARY:
                self._binary = opcode is Opcode.BINARY
                self._parts = [frame.data]
            elif opcode is Opcode.CONT:
                self._parts.append(frame.data)
            else:
                continue  # ping (answered by the protocol), pong, close (state says it)
            if frame.fin:
                self._deliver(b"".join(self._parts))
                self._parts = []
        if closing or not data:
            self._ended = True

    def _deliver(self, payload: bytes) -> None:
        if self._binary:
            self._messages.append(payload)
            return
        try:
            self._messages.append(payload.decode())
        except UnicodeDecodeError:
            self._messages.append(InvalidText("a text frame that is not UTF-8"))

    # ------------------------------------------------------------------ closing

    def close_frame(self, code: int, reason: str) -> bytes:
        """The close frame starting the closing handshake, or ``b""`` when one was already
        sent or received (the writer thread calls this; the reader only reads the state)."""
        protocol = self._protocol
        with self._lock:
            if protocol.state is not State.OPEN:
                return b""
            protocol.send_close(code, reason)
            return b"".join(protocol.data_to_send())

    def shutdown(self) -> None:
        """Cut the TCP connection now; wakes a reader or a writer blocked on the socket."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self, graceful: bool) -> None:
        """Release the socket. Gracefully: our end of the stream first, then what the peer
        still sends (its close frame) is read and dropped until its end of stream, for up to
        ``CLOSE_TIMEOUT``: closing a socket with unread data would reset the connection and
        could destroy frames the peer has not read yet."""
        sock = self.sock
        if graceful:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            deadline = monotonic() + CLOSE_TIMEOUT
            with contextlib.suppress(OSError, TimeoutError):
                while self._read(deadline):
                    pass
        self.shutdown()
        sock.close()
