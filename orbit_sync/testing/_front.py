"""The mock server's front door: each accepted connection up to its WebSocket session.

On the connection's own thread (started by :mod:`._listener`), :class:`FrontDoor` finishes the
TLS handshake and reads the request head within the handshake deadline, then either hands an
``/admin/`` request to the :class:`~._admin_gate.AdminGate` or completes the opening handshake
through websockets' sans-I/O protocol: the path, the bearer token and its scope, the
subprotocol and the connection limit are checked before the ``101``, and the session then runs
on the same thread (:class:`~._session_server.SessionServer`).
"""

from __future__ import annotations

import contextlib
import http
import logging
import socket
import ssl
from typing import Any

from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol

from .._codec import SUBPROTOCOL
from .._json import MAX_FRAME_BYTES
from .._realtime import monotonic
from . import _http
from ._admin_gate import ADMIN_IO_TIMEOUT, AdminGate, admin_error
from ._hub import Hub
from ._listener import Admission
from ._session_server import SessionServer
from ._state import SCOPE_CONNECT

__all__ = ["CONNECT_PATH", "FrontDoor"]

CONNECT_PATH = "/v1/worker/connect"


class _QuietLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """websockets logs headers and frame previews at DEBUG: tokens and secrets. Never emit them."""

    def isEnabledFor(self, level: int) -> bool:
        return level > logging.DEBUG and self.logger.isEnabledFor(level)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        return None


class FrontDoor:
    """Serves each accepted connection (:meth:`serve_socket`, the listener's callback)."""

    def __init__(
        self,
        hub: Hub,
        sessions: SessionServer,
        admin: AdminGate,
        *,
        ssl_context: ssl.SSLContext | None,
        handshake_timeout: float,
        write_timeout: float,
        max_connections: int,
    ) -> None:
        self._hub = hub
        self._sessions = sessions
        self._admin = admin
        self._ssl = ssl_context
        self._handshake_timeout = handshake_timeout
        self._write_timeout = write_timeout
        self._max_connections = max_connections
        self._ws_logger = _QuietLogger(logging.getLogger("orbit_sync.testing.transport"), {})

    def pending_refused(self) -> None:
        """The listener closed a connection past the pre-authentication limit."""
        with self._hub.cond:
            self._hub.record("connection.refused", detail="pre-authentication limit")

    def accept_failed(self, reason: str) -> None:
        """The accept loop hit an error (it backs off and retries)."""
        with self._hub.cond:
            self._hub.record("server.accept_failed", detail=reason)

    def serve_socket(self, sock: socket.socket, addr: Any, admission: Admission) -> None:
        """One accepted connection, on its own thread: TLS handshake and request head within
        the handshake deadline, then an admin answer or a WebSocket session."""
        deadline = monotonic() + self._handshake_timeout
        target = None
        try:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                admission.sock = sock
                sock.settimeout(max(deadline - monotonic(), 0.001))
                sock.do_handshake()
            head, surplus = _http.read_head(sock, deadline)
            target = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            method, path, protocol, headers = _http.parse_head(head)
        except TimeoutError:
            with self._hub.cond:
                self._hub.record("connection.handshake_timeout")
            if target is not None and target.startswith(b"/admin/"):
                self._answer(sock, admin_error(408, "the request head came too slowly"))
            return
        except _http.HttpError as exc:
            # Before the path is known to be an admin one, answer as websockets would.
            if target is not None and target.startswith(b"/admin/"):
                self._answer(sock, admin_error(exc.status, exc.message))
            else:
                self._answer(sock, _http.text_response(exc.status, exc.message + "\n"))
            return
        except (OSError, EOFError, ValueError):
            return  # the peer went away, or TLS failed: nothing to answer
        if path.startswith("/admin/"):
            admission.release()  # counted against the admin limit from here
            request = _http.HttpRequest(method, path, headers, protocol=protocol)
            self._admin.serve(sock, addr, request, surplus)
            return
        self._upgrade(sock, admission, head, surplus)

    def _answer(self, sock: socket.socket, response: Response) -> None:
        _http.answer_and_close(sock, response, ADMIN_IO_TIMEOUT)

    def _upgrade(
        self, sock: socket.socket, admission: Admission, head: bytes, surplus: bytes
    ) -> None:
        """The opening handshake through websockets' sans-I/O protocol, then the session."""
        protocol = ServerProtocol(
            subprotocols=[SUBPROTOCOL],  # type: ignore[list-item]
            extensions=None,  # no compression
            max_size=MAX_FRAME_BYTES,
            logger=self._ws_logger,
        )
        protocol.receive_data(head)
        events = protocol.events_received()
        if not events or not isinstance(events[0], Request):
            self._flush(sock, protocol)  # websockets' own rejection of a bad request, if any
            return
        request = events[0]
        token: str | None = None
        if surplus:
            # The client must wait for the 101 before it sends frames (RFC 6455, section 4.1).
            response = protocol.reject(
                http.HTTPStatus.BAD_REQUEST, "data sent before the handshake completed\n"
            )
        else:
            checked = self._check_upgrade(protocol, request)
            if isinstance(checked, str):
                token = checked
                admission.release()  # authenticated: max_connections counts it from here
                response = protocol.accept(request)
            else:
                response = checked
        protocol.send_response(response)
        if token is None or protocol.state is not State.OPEN:
            if token is not None:
                self._release_opening()
            self._flush(sock, protocol)
            return
        if not self._flush(sock, protocol):
            self._release_opening()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            return
        sock.settimeout(None)  # the wire's reads and our writer enforce their own deadlines
        self._sessions.run(sock, protocol, token)

    def _release_opening(self) -> None:
        with self._hub.cond:
            self._hub.opening -= 1
            self._hub.changed()

    def _flush(self, sock: socket.socket, protocol: ServerProtocol) -> bool:
        """Write what the protocol has to send; False when the socket failed."""
        try:
            for data in protocol.data_to_send():
                if data:
                    _http.send_all(sock, data, monotonic() + self._write_timeout)
                else:
                    sock.shutdown(socket.SHUT_WR)  # websockets' SEND_EOF
        except (OSError, TimeoutError):
            return False
        return True

    def _check_upgrade(self, protocol: ServerProtocol, request: Request) -> Response | str:
        """The token of an upgrade request we accept (a connection slot is then reserved in
        ``hub.opening``), or the answer refusing it."""
        hub = self._hub
        path = request.path
        fault = hub.faults.take("refuse_connections", None, None)
        if fault is not None:
            return protocol.reject(fault.status, "refused by an injected fault\n")
        if path != CONNECT_PATH:
            if path.split("?", 1)[0] == CONNECT_PATH:
                # Credentials never travel in the URL, so no query is accepted at all.
                return protocol.reject(
                    http.HTTPStatus.BAD_REQUEST, "query parameters are not allowed\n"
                )
            return protocol.reject(http.HTTPStatus.NOT_FOUND, "Not Found\n")
        token = _bearer(request)
        with hub.cond:
            scopes = None if token is None else hub.state.token_scopes(token)
            if scopes is None:
                hub.record("connection.refused", detail="401")
                response = protocol.reject(http.HTTPStatus.UNAUTHORIZED, "Unauthorized\n")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
            if SCOPE_CONNECT not in scopes:
                hub.record("connection.refused", detail="403")
                return protocol.reject(http.HTTPStatus.FORBIDDEN, "Forbidden\n")
            offered = [
                p.strip()
                for value in request.headers.get_all("Sec-WebSocket-Protocol")
                for p in value.split(",")
            ]
            if SUBPROTOCOL not in offered:
                return protocol.reject(
                    http.HTTPStatus.BAD_REQUEST, f"subprotocol {SUBPROTOCOL} is required\n"
                )
            if len(hub.conns) + hub.opening >= self._max_connections:
                hub.record("connection.refused", detail="503 connection limit")
                return protocol.reject(
                    http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n"
                )
            assert token is not None
            hub.opening += 1
        return token


def _bearer(request: Request) -> str | None:
    values = request.headers.get_all("Authorization")
    if len(values) != 1:
        return None
    scheme, _, token = values[0].partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
