"""The dial: TCP, TLS and the WebSocket upgrade, bounded by one deadline; then a :class:`Transport`.

websocket-client performs the opening handshake only (the HTTP upgrade on a socket we opened and,
for ``wss://``, wrapped in TLS ourselves); every frame afterwards is :mod:`._transport`'s.
Supported: ``websocket-client >=1.0,<1.10`` (``SUPPORTED_WEBSOCKET_CLIENT``). Only its public API
is used; the one behaviour we rely on beyond it (the upgrade answer is read line by line, never
past its blank line, so the first frame stays on the socket for the transport) is pinned by
``tests/test_client_transport.py``.

* We open the TCP socket and wrap TLS ourselves and hand the socket to ``WebSocket.connect``. So
  the dial is bounded by our own deadline, certificates and host names are always verified with the
  caller's ``ssl.SSLContext`` (re-checked at every dial: the caller may have weakened it since), and
  websocket-client's own environment variables (``http_proxy``/``https_proxy``,
  ``WEBSOCKET_CLIENT_CA_BUNDLE``) change nothing: proxies are not used.
* Trust does follow the standard library's environment: the default context
  (``ssl.create_default_context()``) loads the OpenSSL default verify paths, which
  ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` replace. Whoever sets those variables for the process
  chooses which certificate authorities it trusts; pass an explicit ``ssl_context`` to pin them.
* Host names are matched against the certificate's subjectAltName only: the dial turns the
  common-name fallback off on the context it uses (``hostname_checks_common_name = False``,
  RFC 6125), the caller's context included.
* ``redirect_limit=0``: a redirect would re-send ``Authorization`` to another host.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import websocket

from ._foreign import kept, mapped
from ._realtime import monotonic
from ._transport import Transport, shutdown_socket
from .errors import CallTimeout, HTTPError, WorkerDisconnected, WorkerProtocolError

__all__ = [
    "SUPPORTED_WEBSOCKET_CLIENT",
    "DialGuard",
    "check_internals",
    "connect",
    "dial_stage",
]

#: The websocket-client versions this module was tested against: [low, high).
SUPPORTED_WEBSOCKET_CLIENT = ((1, 0, 0), (1, 10, 0))
_REDIRECTS = range(300, 400)


def check_internals() -> None:
    """Raise RuntimeError unless websocket-client still has the API the dial uses."""
    ws_class = getattr(websocket, "WebSocket", None)
    needed = ("connect", "getheaders", "getstatus")
    if ws_class is None or not all(callable(getattr(ws_class, name, None)) for name in needed):
        raise RuntimeError(
            "websocket-client API changed (WebSocket.connect/getheaders/getstatus); orbit-sync "
            "cannot dial with this version"
        )


class DialGuard:
    """Bounds a whole dial (TCP + TLS + upgrade + hello/welcome) by one deadline.

    Socket timeouts bound each read, not the sum of them (a server trickling one header byte at a
    time never trips them), so a timer shuts the socket down when the deadline passes.
    """

    def __init__(self, timeout: float) -> None:
        self.deadline = monotonic() + timeout
        self.fired = False
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._timer = threading.Timer(timeout, self._fire)
        self._timer.name = "orbit-sync-dial-guard"
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        """Seconds left; raises CallTimeout once none are."""
        left = self.deadline - monotonic()
        if left <= 0 or self.fired:
            raise CallTimeout("dial did not complete in time")
        return left

    def watch(self, sock: socket.socket) -> None:
        """Shut *sock* down if the deadline passes (at once if it already has)."""
        with self._lock:
            self._sock = sock
            fired = self.fired
        if fired:
            shutdown_socket(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            sock = self._sock
        if sock is not None:
            shutdown_socket(sock)

    def cut(self) -> None:
        """End the dial now, from any thread, as if its deadline had passed."""
        self._fire()

    def stop(self) -> None:
        """Disarm and join the timer thread."""
        self._timer.cancel()
        self._timer.join()


def _open_tcp(host: str, port: int, guard: DialGuard) -> socket.socket:
    # getaddrinfo is not interruptible; the system resolver's own timeouts bound it.
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise mapped(exc, f"cannot resolve the Orbit host: {exc.strerror}") from kept(exc)
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
    if last is None:
        raise WorkerDisconnected("cannot connect to the Orbit server: no address")
    reason = last.strerror or "no address"
    raise mapped(last, f"cannot connect to the Orbit server: {reason}") from kept(last)


@contextlib.contextmanager
def dial_stage(stage: str) -> Iterator[None]:
    """Mark a ``WorkerDisconnected`` raised inside (a lost connection: every one raised there
    is) with the stage of the dial it broke (the reconnect backoff tells a link that cut a dial
    from a server that refused it)."""
    try:
        yield
    except WorkerDisconnected as exc:
        if exc.dial_stage is None:
            exc.dial_stage = stage
        raise


def _new_websocket() -> Any:
    check_internals()
    # Its frame machinery is never used: only connect() (the upgrade) and the answer's headers.
    return websocket.WebSocket(skip_utf8_validation=True)


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
    try:
        if ssl_context is not None:
            sock = _wrap_tls(sock, host, ssl_context, guard)
        ws = _new_websocket()
        sock.settimeout(guard.remaining())
        with dial_stage("upgrade"):
            _upgrade(ws, url, headers, subprotocol, sock, guard)
        transport = Transport(ws, sock)
        if transport.subprotocol_header != subprotocol:
            raise WorkerProtocolError(f"the server did not select subprotocol {subprotocol}")
        return transport
    except BaseException:
        shutdown_socket(sock)
        sock.close()
        raise


def _wrap_tls(
    sock: socket.socket, host: str, context: ssl.SSLContext, guard: DialGuard
) -> ssl.SSLSocket:
    # RFC 6125 retired matching the host name against the certificate's common name: only its
    # subjectAltName counts, so a CN-only certificate is refused even by a context (the
    # caller's included) that still allows the fallback. Set at every dial: the caller may
    # have turned it back on since.
    context.hostname_checks_common_name = False
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
        reason = f"TLS certificate verification failed: {exc.verify_message}"
        raise mapped(exc, reason) from kept(exc)
    except CallTimeout:
        tls.close()
        raise
    except OSError as exc:
        tls.close()
        if guard.fired:
            raise CallTimeout("dial did not complete in time") from exc
        if isinstance(exc, TimeoutError):
            raise mapped(exc, "dial did not complete in time") from kept(exc)
        failed = mapped(exc, "TLS handshake failed")
        if isinstance(failed, WorkerDisconnected) and isinstance(
            exc, ConnectionError | ssl.SSLEOFError
        ):
            failed.dial_stage = "tls"  # reset or closed mid-handshake, not a TLS refusal
        raise failed from kept(exc)
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
        # The table drops the cause: the library's message carries the response headers and body.
        raise mapped(exc, int(exc.status_code)) from kept(exc)
    except websocket.WebSocketTimeoutException as exc:
        raise mapped(exc, "dial did not complete in time") from kept(exc)
    except websocket.WebSocketConnectionClosedException as exc:
        # Cut before the whole 101 answer arrived: the network, not the server's protocol.
        if guard.fired:
            raise CallTimeout("dial did not complete in time") from exc
        raise mapped(exc, "connection lost before the upgrade was answered") from kept(exc)
    except websocket.WebSocketException as exc:
        status = ws.getstatus()
        if isinstance(status, int) and status in _REDIRECTS:
            # redirect_limit=0: the redirect is reported, never followed. Not the table's row
            # (that would be a protocol error), and the cause may quote the answer: dropped.
            raise HTTPError(status) from None
        if guard.fired:
            raise CallTimeout("dial did not complete in time") from None
        raise mapped(
            exc, f"invalid WebSocket upgrade answer (subprotocol {subprotocol} required)"
        ) from kept(exc)
    except OSError as exc:
        if guard.fired:
            raise CallTimeout("dial did not complete in time") from exc
        raise mapped(exc, "connection lost during the WebSocket upgrade") from kept(exc)
    status = ws.getstatus()
    if isinstance(status, int) and status in _REDIRECTS:
        # websocket-client before 1.9.1 returns a redirect answer under redirect_limit=0 instead
        # of raising: report it the same way, never followed.
        raise HTTPError(status)
