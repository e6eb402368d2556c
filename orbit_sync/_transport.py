"""The WebSocket transport: our own frame path on the socket :mod:`._dial` upgraded.

websocket-client performs the opening handshake only. From then on every frame is read and
written here, on the raw socket: websocket-client's own codec (``frame_buffer`` and ``ABNF``: a
lock, a frame object and 2-3 buffer reads per frame), even over one buffered read, costs about
six times ours per frame, some 10 us of worker CPU per task (``benchmarks/frames_cpu.py``, the
"read a server frame" row of ``make bench``).

Frames (RFC 6455, client side):

* Reads go through one buffer: ``recv(65536)`` and parse every frame the chunk holds, so a burst
  of small frames costs one system call. Server frames must be unmasked with RSV bits 0; control
  frames are at most 125 bytes and never fragmented; only text messages exist in
  ``pulse.worker.v1`` (binary is a protocol error); fragments are reassembled. The 512 KiB limit
  is checked from each frame header, across fragments, before the payload is waited for: a header
  announcing 48 MiB is refused at once instead of being buffered.
* A ping is answered with a pong of the same payload, a pong is ignored, a close frame ends the
  connection (``WorkerDisconnected`` naming its code) after a best-effort close frame back.
* Writes are masked client frames, built and written under ONE write lock that pongs and the close
  frame of ``abort`` share, so frames never interleave. ``send_texts`` writes several frames in one
  ``sendall``. Mask keys come from ``os.urandom``, drawn for many frames at a time.

* No UTF-8 validation here; the payload stays bytes and the strict JSON layer decodes it.
* After the dial the socket timeout is ``None``: over TLS a socket timeout breaks concurrent
  read + send. Bounds are enforced by the connection's own deadlines, teardown by
  ``shutdown(SHUT_RDWR)`` from any thread; the descriptor is closed only once no writer is left.
* No error message carries frame content: a payload may hold a token or a lease secret.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any, Final, Protocol

from ._foreign import kept, mapped
from ._json import MAX_FRAME_BYTES
from ._realtime import monotonic
from .errors import WorkerDisconnected, WorkerProtocolError

__all__ = ["FrameRejected", "FrameTransport", "Transport", "frame_header", "shutdown_socket"]

_OP_CONT = 0x0
OP_TEXT = 0x1
_OP_BINARY = 0x2
_OP_CLOSE = 0x8
_OP_PING = 0x9
_OP_PONG = 0xA
_CLOSE_WAIT = 5.0  # bound on waiting for woken writers before the descriptor is closed
_CHUNK = 65536  # bytes asked of each recv: one call holds a burst of small frames
_KEYS = 256  # bytes of mask keys drawn per os.urandom call (64 frames)


class FrameRejected(WorkerProtocolError):
    """A server frame header broke the rules; raised before its payload is read."""


def _mask(key: bytes, payload: bytes) -> bytes:
    """*payload* XOR the repeated 4-byte *key*: one big-integer XOR, not a loop over bytes."""
    n = len(payload)
    stream = key * (n >> 2) + key[: n & 3]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(stream, "little")).to_bytes(
        n, "little"
    )


def frame_header(opcode: int, n: int, mask_bit: int = 0x80) -> bytes:
    """A FIN frame header for an *n*-byte payload, with the shortest length RFC 6455 allows.

    *mask_bit* is 0x80 for a client frame (its 4-byte key follows the header) and 0 for a
    server frame (the mock server's, which are never masked).
    """
    if n < 126:
        return bytes((0x80 | opcode, mask_bit | n))
    if n < 65536:
        return struct.pack("!BBH", 0x80 | opcode, mask_bit | 126, n)
    return struct.pack("!BBQ", 0x80 | opcode, mask_bit | 127, n)


#: Ctrl-C, whose handler raises KeyboardInterrupt, held back during a write where POSIX can. A
#: short tuple: converting a larger set costs far more than the write (about 150 us for all).
_SIGNALS: Final = (signal.SIGINT,) if hasattr(signal, "pthread_sigmask") else None


def _sendall(sock: socket.socket, data: bytes) -> None:
    """``sendall``, with Ctrl-C held on the main thread (the only one where Python runs signal
    handlers) until it returns: its KeyboardInterrupt is then raised after the write, never in
    the middle of a frame, which would leave the stream unusable. A write stuck that way is
    still ended by the connection's call bound."""
    if _SIGNALS is None or threading.current_thread() is not threading.main_thread():
        sock.sendall(data)
        return
    held: set[int | signal.Signals] | None = None
    try:
        # A Ctrl-C that lands before the mask takes effect raises as this call returns, before
        # ``held`` is set: nothing is sent then, and the finally clause unblocks SIGINT (its
        # handler ran, so it was not blocked before).
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        sock.sendall(data)
    finally:
        if held is None:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        else:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def shutdown_socket(sock: socket.socket) -> None:
    # socket.socket.shutdown, not SSLSocket.shutdown: the latter drops the SSL object while
    # another thread may be inside it; the plain call only wakes that thread with EOF.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class FrameTransport(Protocol):
    """What a :class:`WorkerConnection` needs of its WebSocket once the opening handshake is
    done (:meth:`orbit_sync.Client.dial_worker` makes one): text frames out, whole messages in,
    the time of the last bytes received, and two ways to end it. Every failure is an
    :class:`~orbit_sync.errors.OrbitError` (``WorkerDisconnected`` for a lost socket)."""

    #: When bytes last arrived (monotonic seconds): the read-idle bound is counted from it.
    last_rx: float

    def send_text(self, text: str) -> None:
        """Write one text frame."""

    def send_texts(self, texts: Sequence[str]) -> None:
        """Write several text frames at once."""

    def recv_message(self) -> bytes:
        """Block until the next whole message (pings answered, the close handshake done)."""

    def abort(self, close_code: int | None = None) -> None:
        """End at once (sending a close frame with *close_code* when it can), any thread."""

    def close(self) -> None:
        """Release the socket once the reader is done with it."""


class Transport:
    """One WebSocket after its upgrade: buffered frame reads, locked writes, any-thread teardown.

    One thread reads (``recv_message``); any number write. ``abort`` and ``close`` may come from
    any thread, at any time.
    """

    def __init__(self, ws: Any, sock: socket.socket) -> None:
        self._ws = ws  # websocket-client's object: the upgrade answer's headers, nothing else
        self._sock = sock
        #: time.monotonic() of the last bytes received (the read-idle bound's reference).
        self.last_rx = monotonic()
        # Every frame is written under this lock, so a thread holding it is the only writer: the
        # descriptor is closed while holding it (a write racing a close could otherwise land on a
        # reused descriptor: another socket, another peer). ``_closed`` changes under both locks.
        self._write_lock = threading.Lock()
        self._state = threading.Lock()  # abort's check of _closed, against close()
        self._closed = False
        self._keys = b""  # mask keys drawn ahead (under the write lock)
        self._key_at = 0
        # Reader state (the reading thread only): bytes received and not yet parsed start at
        # _pos; _parts holds the fragments of a message being assembled, _size their total.
        self._buf = b""
        self._pos = 0
        self._parts: list[bytes] | None = None
        self._size = 0

    @property
    def subprotocol_header(self) -> str | None:
        """The ``Sec-WebSocket-Protocol`` the server answered, verbatim."""
        headers = self._ws.getheaders() or {}
        value = headers.get("sec-websocket-protocol")
        return value if isinstance(value, str) else None

    def set_timeout(self, timeout: float | None) -> None:
        """Socket timeout: only during the dial (None afterwards, see the module docstring)."""
        with self._state:
            if self._closed:
                return
            with contextlib.suppress(OSError):
                self._sock.settimeout(timeout)

    # ------------------------------------------------------------------ writing

    def send_text(self, text: str) -> None:
        """Send one text frame."""
        self._write(OP_TEXT, (text.encode("utf-8"),))

    def send_texts(self, texts: Sequence[str]) -> None:
        """Send several text frames, in order, in one ``sendall`` (nothing for an empty batch)."""
        payloads = [text.encode("utf-8") for text in texts]
        if payloads:
            self._write(OP_TEXT, payloads)

    def _write(self, opcode: int, payloads: Sequence[bytes]) -> None:
        try:
            with self._write_lock:
                if self._closed:
                    raise WorkerDisconnected("the connection is closed")
                if len(payloads) == 1:
                    data = self._frame(opcode, payloads[0])
                else:
                    data = b"".join([self._frame(opcode, payload) for payload in payloads])
                _sendall(self._sock, data)
        except OSError as exc:
            raise mapped(exc, "connection lost while sending") from kept(exc)
        except (ValueError, AttributeError) as exc:
            # The socket was torn down under the writer (not a foreign error: our own teardown);
            # anything else is a bug and propagates as itself.
            raise WorkerDisconnected("connection lost while sending") from exc

    def _frame(self, opcode: int, payload: bytes) -> bytes:
        """One masked client frame (under the write lock: it draws a mask key)."""
        at = self._key_at
        if at + 4 > len(self._keys):
            self._keys = os.urandom(_KEYS)
            at = 0
        key = self._keys[at : at + 4]
        self._key_at = at + 4
        return frame_header(opcode, len(payload)) + key + _mask(key, payload)

    def _try_close_frame(self, code: int) -> None:
        """Send a close frame if no writer holds the lock and the socket takes it now.

        Teardown must never block behind a stuck writer or a peer that stopped reading.
        """
        if not self._write_lock.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            _, writable, _ = select.select([], [self._sock], [], 0)
            if writable:
                self._sock.send(self._frame(_OP_CLOSE, struct.pack("!H", code)))
        except (OSError, ValueError):
            pass
        finally:
            self._write_lock.release()

    # ------------------------------------------------------------------ reading

    def recv_message(self) -> bytes:
        """The next text message as bytes.

        Raises FrameRejected when the server broke the framing rules (before the offending
        payload is waited for) and WorkerDisconnected when the connection ended (a close frame
        included); CallTimeout only during the dial, the one time a socket timeout is set.
        """
        while True:
            buf = self._buf
            pos = self._pos
            avail = len(buf) - pos
            if avail < 2:
                self._fill(2)
                continue
            b0 = buf[pos]
            b1 = buf[pos + 1]
            n = b1 & 0x7F
            if n < 126:
                start = pos + 2
            elif n == 126:
                if avail < 4:
                    self._fill(4)
                    continue
                n = int.from_bytes(buf[pos + 2 : pos + 4], "big")
                start = pos + 4
            else:
                if avail < 10:
                    self._fill(10)
                    continue
                n = int.from_bytes(buf[pos + 2 : pos + 10], "big")
                start = pos + 10
            self._check(b0, b1, n)
            end = start + n
            if end > len(buf):
                self._fill(end - pos)  # the header is parsed again from the filled buffer
                continue
            payload = buf[start:end]
            self._pos = end
            opcode = b0 & 0x0F
            if opcode == OP_TEXT:
                if b0 & 0x80:
                    return payload
                self._parts = [payload]
                self._size = n
            elif opcode == _OP_CONT:
                parts = self._parts
                assert parts is not None  # _check refused a continuation outside a message
                parts.append(payload)
                self._size += n
                if b0 & 0x80:
                    self._parts = None
                    self._size = 0
                    return b"".join(parts)
            elif opcode == _OP_PING:
                self._write(_OP_PONG, (payload,))
            elif opcode == _OP_CLOSE:
                code = struct.unpack("!H", payload[:2])[0] if n >= 2 else 1005
                self._try_close_frame(1000)
                raise WorkerDisconnected(f"the Orbit server closed the connection (code {code})")
            # A pong answers nothing we sent: ignored.

    def _check(self, b0: int, b1: int, n: int) -> None:
        """Refuse a frame from its header alone (*n*: its payload length)."""
        if b0 & 0x70:
            # No extension (compression included) was negotiated.
            raise FrameRejected("server frame sets reserved bits")
        if b1 & 0x80:
            raise FrameRejected("server frames must not be masked")
        opcode = b0 & 0x0F
        if opcode == OP_TEXT:
            if self._parts is not None:
                raise FrameRejected("new message inside a fragmented message")
            size = n
        elif opcode == _OP_CONT:
            if self._parts is None:
                raise FrameRejected("continuation frame outside a fragmented message")
            size = self._size + n
        elif opcode in (_OP_CLOSE, _OP_PING, _OP_PONG):
            if n > 125 or not b0 & 0x80:
                raise FrameRejected("invalid control frame")
            return
        elif opcode == _OP_BINARY:
            raise FrameRejected("binary frames are not part of pulse.worker.v1")
        else:
            raise FrameRejected("unknown frame opcode")
        if size > MAX_FRAME_BYTES:
            raise FrameRejected(f"server frame is over the {MAX_FRAME_BYTES}-byte limit")

    def _fill(self, need: int) -> None:
        """Receive until at least *need* unparsed bytes are buffered (each chunk stamps last_rx).

        *need* is bounded by a header already checked against the limit.
        """
        buf = self._buf
        have = len(buf) - self._pos
        chunks = [buf[self._pos :]] if have else []
        recv = self._sock.recv
        while have < need:
            try:
                data = recv(max(_CHUNK, need - have))
            except TimeoutError as exc:  # only during the dial: the one time a timeout is set
                raise mapped(exc, "dial did not complete in time") from kept(exc)
            except OSError as exc:
                raise mapped(exc, "connection to the Orbit server lost") from kept(exc)
            except (ValueError, AttributeError) as exc:
                # The socket was torn down under the reader (our own teardown).
                raise WorkerDisconnected("connection to the Orbit server lost") from exc
            if not data:
                raise WorkerDisconnected("connection to the Orbit server lost")
            self.last_rx = monotonic()
            chunks.append(data)
            have += len(data)
        self._buf = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._pos = 0

    # ------------------------------------------------------------------ teardown

    def abort(self, close_code: int | None = None) -> None:
        """Tear down from any thread: a best-effort close frame, then ``shutdown(SHUT_RDWR)``.

        The close frame is sent only if no writer holds the lock and the socket can take it now;
        teardown must never block behind a stuck writer.
        """
        with self._state:
            if self._closed:
                return  # the descriptor may already belong to another socket
            if close_code is not None:
                self._try_close_frame(close_code)
            shutdown_socket(self._sock)

    def close(self) -> None:
        """Release the file descriptor, once the reader is done and no writer is left.

        The shutdown first wakes every blocked writer (they fail at once), so the wait for the
        write lock is short; it is bounded all the same.
        """
        with self._state:
            closed = self._closed
            if not closed:
                shutdown_socket(self._sock)
        if closed:
            return
        held = self._write_lock.acquire(timeout=_CLOSE_WAIT)
        try:
            with self._state:
                if self._closed:
                    return
                self._closed = True
                with contextlib.suppress(OSError):
                    self._sock.close()
        finally:
            if held:
                self._write_lock.release()
        self._ws.sock = None
        self._ws.connected = False
