"""The websocket-client shell: the only module that touches websocket-client, internals included.

Supported: ``websocket-client >=1.0,<1.10`` (``SUPPORTED_WEBSOCKET_CLIENT``), every release in that
range having passed the internals check and the transport, dial and TLS tests. Two things depend on
its internals and are checked by ``tests/test_client_transport.py``, which fails if they move:

* ``websocket._abnf.frame_buffer`` parses each frame header (``recv_header``), then its length
  (``recv_length``), then reads the whole payload with ``recv_strict``. websocket-client has no
  incoming size limit, so we replace a socket's ``frame_buffer`` with a subclass that checks the
  header right after the length is known, before a single payload byte is buffered, and across
  fragments (measured: a 48 MiB header makes the stock library buffer 48 MiB).
* ``WebSocket.frame_buffer`` is the attribute ``recv_frame`` reads from.

Other choices:

* We open the TCP socket and wrap TLS ourselves and hand the socket to ``WebSocket.connect``. So
  the dial is bounded by our own deadline, certificates and host names are always verified with the
  caller's ``ssl.SSLContext`` (re-checked at every dial: the caller may have weakened it since), and
  websocket-client's own environment variables (``http_proxy``/``https_proxy``,
  ``WEBSOCKET_CLIENT_CA_BUNDLE``) change nothing: proxies are not used.
* Trust does follow the standard library's environment: the default context
  (``ssl.create_default_context()``) loads the OpenSSL default verify paths, which
  ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` replace. Whoever sets those variables for the process
  chooses which certificate authorities it trusts; pass an explicit ``ssl_context`` to pin them.
* ``redirect_limit=0``: a redirect would re-send ``Authorization`` to another host.
* ``skip_utf8_validation=True``; the payload stays bytes and the strict JSON layer decodes it.
* After the dial the socket timeout is ``None``: over TLS a socket timeout breaks concurrent
  read + send. Bounds are enforced by the connection's own deadlines, teardown by
  ``shutdown(SHUT_RDWR)``, never by ``WebSocket.close()`` from another thread.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import websocket
from websocket import _abnf

from ._json import MAX_FRAME_BYTES
from .errors import CallTimeout, HTTPError, WorkerDisconnected, WorkerProtocolError

__all__ = [
    "SUPPORTED_WEBSOCKET_CLIENT",
    "DialGuard",
    "FrameRejected",
    "Transport",
    "check_internals",
    "connect",
]

#: The websocket-client versions whose internals this module was tested against: [low, high).
SUPPORTED_WEBSOCKET_CLIENT = ((1, 0, 0), (1, 10, 0))

_OP_CONT = _abnf.ABNF.OPCODE_CONT
_OP_TEXT = _abnf.ABNF.OPCODE_TEXT
_OP_BINARY = _abnf.ABNF.OPCODE_BINARY
_OP_CLOSE = _abnf.ABNF.OPCODE_CLOSE
_CONTROL = frozenset({_abnf.ABNF.OPCODE_CLOSE, _abnf.ABNF.OPCODE_PING, _abnf.ABNF.OPCODE_PONG})
_REDIRECTS = range(300, 400)
_CLOSE_WAIT = 5.0  # bound on waiting for woken writers before the descriptor is closed


class FrameRejected(WorkerProtocolError):
    """A server frame header broke the rules; raised before its payload is read."""


def check_internals() -> None:
    """Raise RuntimeError unless websocket-client still has the internals we hook.

    Failing closed matters: without the hook there is no incoming size limit at all.
    """
    fb = getattr(_abnf, "frame_buffer", None)
    needed = ("recv_header", "recv_length", "recv_strict", "recv_frame", "clear")
    if fb is None or not all(callable(getattr(fb, name, None)) for name in needed):
        raise RuntimeError(
            "websocket-client internals changed (websocket._abnf.frame_buffer); orbit-sync "
            "cannot enforce the 512 KiB frame limit with this version"
        )


class _LimitedFrameBuffer(_abnf.frame_buffer):
    """``frame_buffer`` that rejects a frame from its header, before buffering its payload."""

    def __init__(self, recv_fn: Any, limit: int) -> None:
        super().__init__(recv_fn, True)
        self._limit = limit
        self._message = 0  # bytes of the text message being assembled (fragments included)
        self._in_message = False

    def recv_length(self) -> None:
        super().recv_length()
        if self.header is None or self.length is None:
            raise FrameRejected("frame header not read")
        fin, rsv1, rsv2, rsv3, opcode, masked, _ = self.header
        length = self.length
        if rsv1 or rsv2 or rsv3:
            # No extension (compression included) was negotiated.
            raise FrameRejected("server frame sets reserved bits")
        if masked:
            raise FrameRejected("server frames must not be masked")
        if opcode in _CONTROL:
            if length > 125 or not fin:
                raise FrameRejected("invalid control frame")
            return
        if opcode == _OP_BINARY:
            raise FrameRejected("binary frames are not part of pulse.worker.v1")
        if opcode == _OP_TEXT:
            if self._in_message:
                raise FrameRejected("new message inside a fragmented message")
            self._message = length
        elif opcode == _OP_CONT:
            if not self._in_message:
                raise FrameRejected("continuation frame outside a fragmented message")
            self._message += length
        else:
            raise FrameRejected("unknown frame opcode")
        if self._message > self._limit:
            raise FrameRejected(f"server frame is over the {self._limit}-byte limit")
        self._in_message = not fin


class DialGuard:
    """Bounds a whole dial (TCP + TLS + upgrade + hello/welcome) by one deadline.

    Socket timeouts bound each read, not the sum of them (a server trickling one header byte at a
    time never trips them), so a timer shuts the socket down when the deadline passes.
    """

    def __init__(self, timeout: float) -> None:
        self.deadline = time.monotonic() + timeout
        self.fired = False
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._timer = threading.Timer(timeout, self._fire)
        self._timer.name = "orbit-sync-dial-guard"
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        """Seconds left; raises CallTimeout once none are."""
        left = self.deadline - time.monotonic()
        if left <= 0 or self.fired:
            raise CallTimeout("dial did not complete in time")
        return left

    def watch(self, sock: socket.socket) -> None:
        """Shut *sock* down if the deadline passes (at once if it already has)."""
        with self._lock:
            self._sock = sock
            fired = self.fired
        if fired:
            _shutdown(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            sock = self._sock
        if sock is not None:
            _shutdown(sock)

    def cut(self) -> None:
        """End the dial now, from any thread, as if its deadline had passed."""
        self._fire()

    def stop(self) -> None:
        """Disarm and join the timer thread."""
        self._timer.cancel()
        self._timer.join()


def _shutdown(sock: socket.socket) -> None:
    # socket.socket.shutdown, not SSLSocket.shutdown: the latter drops the SSL object while
    # another thread may be inside it; the plain call only wakes that thread with EOF.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _open_tcp(host: str, port: int, guard: DialGuard) -> socket.socket:
    # getaddrinfo is not interruptible; the system resolver's own timeouts bound it.
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise WorkerDisconnected(f"cannot resolve the Orbit host: {exc.strerror}") from None
    last: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            guard.watch(sock)
            sock.settimeout(guard.remaining())
            sock.connect(address)
        except CallTimeout:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            if guard.fired or isinstance(exc, TimeoutError):
                raise CallTimeout("dial did not complete in time") from None
            last = exc
            continue
        # Small control frames: do not wait for Nagle.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return sock
    reason = last.strerror if last is not None and last.strerror else "no address"
    raise WorkerDisconnected(f"cannot connect to the Orbit server: {reason}") from None


class Transport:
    """One WebSocket: frame-limited reads, locked writes, teardown safe from any thread."""

    def __init__(self, ws: Any, sock: socket.socket) -> None:
        self._ws = ws
        self._sock = sock
        #: time.monotonic() of the last bytes received (the read-idle bound's reference).
        self.last_rx = time.monotonic()
        # Writers in progress. The descriptor is closed only once none is left: a write racing a
        # close could otherwise land on a reused descriptor (another socket, another peer).
        self._io = threading.Condition(threading.Lock())
        self._writers = 0
        self._closed = False

    @property
    def subprotocol_header(self) -> str | None:
        """The ``Sec-WebSocket-Protocol`` the server answered, verbatim."""
        headers = self._ws.getheaders() or {}
        value = headers.get("sec-websocket-protocol")
        return value if isinstance(value, str) else None

    def _counting_recv(self, bufsize: int) -> bytes:
        # Our own recv, not WebSocket._recv: that one closes the descriptor on EOF from the reader
        # thread while writers may still be using it. Each chunk also stamps read activity.
        try:
            data = self._sock.recv(bufsize)
        except TimeoutError:  # only during the dial, the one time a socket timeout is set
            raise websocket.WebSocketTimeoutException("timed out") from None
        if not data:
            raise websocket.WebSocketConnectionClosedException("connection closed by the peer")
        self.last_rx = time.monotonic()
        return data

    def set_timeout(self, timeout: float | None) -> None:
        """Socket timeout: only during the dial (None afterwards, see the module docstring)."""
        self._ws.settimeout(timeout)

    def _enter_write(self) -> bool:
        with self._io:
            if self._closed:
                return False
            self._writers += 1
            return True

    def _exit_write(self) -> None:
        with self._io:
            self._writers -= 1
            if self._writers == 0:
                self._io.notify_all()

    def send_text(self, text: str) -> None:
        """Send one text frame (websocket-client serializes concurrent writers with a lock)."""
        if not self._enter_write():
            raise WorkerDisconnected("the connection is closed")
        try:
            self._ws.send(text, _OP_TEXT)
        except (websocket.WebSocketException, OSError, ValueError, AttributeError) as exc:
            # Network failures only (ValueError/AttributeError: the socket was torn down under
            # the writer); anything else is a bug and propagates as itself.
            raise WorkerDisconnected("connection lost while sending") from exc
        finally:
            self._exit_write()

    def recv_message(self) -> bytes:
        """The next text message as bytes.

        Raises FrameRejected/WorkerProtocolError when the server broke the framing rules and
        WorkerDisconnected when the connection ended (a close frame included).
        """
        try:
            opcode, data = self._ws.recv_data()
        except FrameRejected:
            raise
        except (
            websocket.WebSocketProtocolException,
            websocket.WebSocketPayloadException,
        ) as exc:
            raise WorkerProtocolError(f"invalid WebSocket framing: {exc}") from None
        except websocket.WebSocketTimeoutException:
            raise CallTimeout("dial did not complete in time") from None
        except (websocket.WebSocketException, OSError, ValueError, AttributeError) as exc:
            # AttributeError/ValueError: the socket was torn down under the reader.
            raise WorkerDisconnected("connection to the Orbit server lost") from exc
        if opcode == _OP_TEXT:
            return bytes(data)
        if opcode == _OP_CLOSE:
            code = struct.unpack("!H", data[:2])[0] if len(data) >= 2 else 1005
            raise WorkerDisconnected(f"the Orbit server closed the connection (code {code})")
        raise WorkerProtocolError("unexpected WebSocket message type")

    def abort(self, close_code: int | None = None) -> None:
        """Tear down from any thread: a best-effort close frame, then ``shutdown(SHUT_RDWR)``.

        The close frame is sent only if no writer holds the lock and the socket can take it now;
        teardown must never block behind a stuck writer.
        """
        if not self._enter_write():
            return  # already closed
        try:
            if close_code is not None and self._ws.lock.acquire(blocking=False):
                try:
                    _, writable, _ = select.select([], [self._sock], [], 0)
                    if writable:
                        payload = struct.pack("!H", close_code)
                        frame = _abnf.ABNF.create_frame(payload, _abnf.ABNF.OPCODE_CLOSE)
                        self._sock.send(frame.format())
                except (OSError, ValueError):
                    pass
                finally:
                    self._ws.lock.release()
            _shutdown(self._sock)
        finally:
            self._exit_write()

    def close(self) -> None:
        """Release the file descriptor, once the reader is done and no writer is left.

        The shutdown first wakes every blocked writer (they fail at once), so the wait is short;
        it is bounded all the same.
        """
        _shutdown(self._sock)
        with self._io:
            self._closed = True
            self._io.wait_for(lambda: self._writers == 0, timeout=_CLOSE_WAIT)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._ws.sock = None
        self._ws.connected = False


def _new_websocket(transport_ref: list[Transport]) -> Any:
    check_internals()
    ws = websocket.WebSocket(enable_multithread=True, skip_utf8_validation=True)
    if not isinstance(getattr(ws, "frame_buffer", None), _abnf.frame_buffer):
        raise RuntimeError("websocket-client internals changed (WebSocket.frame_buffer)")

    def recv(bufsize: int) -> bytes:
        return transport_ref[0]._counting_recv(bufsize)

    ws.frame_buffer = _LimitedFrameBuffer(recv, MAX_FRAME_BYTES)
    return ws


def connect(
    url: str,
    *,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    headers: Mapping[str, str],
    subprotocol: str,
    guard: DialGuard,
) -> Transport:
    """TCP (+ TLS) + WebSocket upgrade under *guard*'s deadline; checks the subprotocol.

    Raises HTTPError (non-101 answer, redirects included: never followed), WorkerProtocolError
    (bad upgrade answer or subprotocol), WorkerDisconnected (network or TLS failure) or
    CallTimeout (deadline).
    """
    sock = _open_tcp(host, port, guard)
    transport: Transport | None = None
    try:
        if ssl_context is not None:
            sock = _wrap_tls(sock, host, ssl_context, guard)
        ref: list[Transport] = []
        ws = _new_websocket(ref)
        transport = Transport(ws, sock)
        ref.append(transport)
        sock.settimeout(guard.remaining())
        _upgrade(ws, url, headers, subprotocol, sock, guard)
        if transport.subprotocol_header != subprotocol:
            raise WorkerProtocolError(f"the server did not select subprotocol {subprotocol}")
        return transport
    except BaseException:
        _shutdown(sock)
        sock.close()
        raise


def _wrap_tls(
    sock: socket.socket, host: str, context: ssl.SSLContext, guard: DialGuard
) -> ssl.SSLSocket:
    try:
        tls = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    except (OSError, ValueError):
        sock.close()
        raise WorkerDisconnected("TLS setup failed") from None
    guard.watch(tls)
    try:
        tls.settimeout(guard.remaining())
        tls.do_handshake()
    except ssl.SSLCertVerificationError as exc:
        tls.close()
        raise WorkerDisconnected(
            f"TLS certificate verification failed: {exc.verify_message}"
        ) from None
    except CallTimeout:
        tls.close()
        raise
    except OSError as exc:
        tls.close()
        if guard.fired or isinstance(exc, TimeoutError):
            raise CallTimeout("dial did not complete in time") from None
        raise WorkerDisconnected("TLS handshake failed") from None
    return tls


def _upgrade(
    ws: Any,
    url: str,
    headers: Mapping[str, str],
    subprotocol: str,
    sock: socket.socket,
    guard: DialGuard,
) -> None:
    try:
        ws.connect(
            url,
            socket=sock,
            header=dict(headers),
            subprotocols=[subprotocol],
            redirect_limit=0,
            suppress_origin=True,
        )
    except websocket.WebSocketBadStatusException as exc:
        # `from None`: the library's message carries the response headers and body.
        raise HTTPError(int(exc.status_code)) from None
    except websocket.WebSocketTimeoutException:
        raise CallTimeout("dial did not complete in time") from None
    except websocket.WebSocketConnectionClosedException as exc:
        # Cut before the whole 101 answer arrived: the network, not the server's protocol.
        if guard.fired:
            raise CallTimeout("dial did not complete in time") from None
        raise WorkerDisconnected("connection lost before the upgrade was answered") from exc
    except websocket.WebSocketException:
        status = ws.getstatus()
        if isinstance(status, int) and status in _REDIRECTS:
            # redirect_limit=0: the redirect is reported, never followed.
            raise HTTPError(status) from None
        if guard.fired:
            raise CallTimeout("dial did not complete in time") from None
        raise WorkerProtocolError(
            f"invalid WebSocket upgrade answer (subprotocol {subprotocol} required)"
        ) from None
    except OSError as exc:
        if guard.fired:
            raise CallTimeout("dial did not complete in time") from None
        raise WorkerDisconnected("connection lost during the WebSocket upgrade") from exc
    status = ws.getstatus()
    if isinstance(status, int) and status in _REDIRECTS:
        # websocket-client before 1.9.1 returns a redirect answer under redirect_limit=0 instead
        # of raising: report it the same way, never followed.
        raise HTTPError(status)
