"""The mock server's gate for admin requests (``/admin/...`` on the WebSocket port).

:class:`AdminGate` bounds what admin callers may hold before their handler runs: at most
``max_admin_requests`` at once (half of them may be waits), the declared body sizes of all of
them together (twice the largest body), and the time to send a body. The credentials and the
declared size are checked before any byte of body is read, so an unauthenticated caller costs no
memory and no waiting for its body. Errors are the admin API's ``{"error": {code, message}}``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from websockets.http11 import Response

from .._realtime import monotonic
from . import _http
from ._hub import Hub

if TYPE_CHECKING:
    from ._server import MockOrbitServer

__all__ = [
    "ADMIN_BODY_BUDGET",
    "ADMIN_IO_TIMEOUT",
    "MAX_ADMIN_BODY",
    "AdminGate",
    "AdminHandler",
    "admin_error",
]

#: ``admin_handler(server, connection, request)``: answers requests under ``/admin/``; ``None``
#: means 404. *request* has ``method``, ``path`` (with the query), ``headers`` and ``body``.
#: A handler may also have ``check_head(request)``, called with the head alone (empty body)
#: before any byte of body is read: a response it returns is the answer, and the body is never
#: read (so an unauthenticated caller costs no memory and no waiting for its body).
AdminHandler = Callable[
    ["MockOrbitServer", _http.AdminExchange, _http.HttpRequest], Response | None
]

#: The largest admin request body (a bulk enqueue of 100,000 small tasks is ~5 MiB).
MAX_ADMIN_BODY = 16 * 1024 * 1024
#: How long an admin request may take to send its body, and any caller to take its answer.
ADMIN_IO_TIMEOUT = 10.0
#: The admin bodies held in memory at once, all requests together (declared sizes).
ADMIN_BODY_BUDGET = 2 * MAX_ADMIN_BODY

_LOG = logging.getLogger("orbit_sync.testing.server")

_ERROR_CODES = {
    404: "NOT_FOUND",
    408: "TIMEOUT",
    411: "LENGTH_REQUIRED",
    413: "TOO_LARGE",
    431: "TOO_LARGE",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


def admin_error(
    status: int, message: str, headers: Iterable[tuple[str, str]] = (), *, code: str = ""
) -> Response:
    """An admin API error answer: ``{"error": {"code", "message"}}``."""
    return _http.json_response(
        status,
        {
            "error": {
                "code": code or _ERROR_CODES.get(status, "INVALID_ARGUMENT"),
                "message": message,
            }
        },
        headers,
    )


class AdminGate:
    """Admits admin requests within the server's bounds and hands them to *handler*."""

    def __init__(
        self,
        server: MockOrbitServer,
        hub: Hub,
        handler: AdminHandler | None,
        *,
        max_requests: int,
    ) -> None:
        self._server = server
        self._hub = hub
        self._handler = handler
        self._max = max_requests
        self._active = 0
        self._waits = 0
        self._body_bytes = 0

    @property
    def active(self) -> int:
        """Admin requests being served now."""
        with self._hub.cond:
            return self._active

    @property
    def body_bytes(self) -> int:
        """Body bytes announced by the admin requests being served now."""
        with self._hub.cond:
            return self._body_bytes

    def serve(
        self, sock: socket.socket, addr: Any, request: _http.HttpRequest, surplus: bytes
    ) -> None:
        """Answer one admin request (its head read, *surplus* the bytes read past it), then
        close the connection."""
        hub = self._hub
        waiting = request.path.partition("?")[0].endswith("/wait")
        with hub.cond:
            busy = self._active >= self._max or (waiting and self._waits >= max(1, self._max // 2))
            if busy:
                hub.record("admin.refused", detail="admin request limit")
            else:
                self._active += 1
                self._waits += waiting
                hub.changed()
        if busy:
            _http.answer_and_close(
                sock,
                admin_error(
                    503, "too many admin requests at once; retry shortly", [("Retry-After", "1")]
                ),
                ADMIN_IO_TIMEOUT,
            )
            return
        try:
            response = self._response(sock, addr, request, surplus)
        finally:
            with hub.cond:
                self._active -= 1
                self._waits -= waiting
                hub.changed()
        _http.answer_and_close(sock, response, ADMIN_IO_TIMEOUT)

    def _response(
        self, sock: socket.socket, addr: Any, request: _http.HttpRequest, surplus: bytes
    ) -> Response:
        if self._handler is None:
            return admin_error(404, "this server has no admin API")
        # The credentials and the declared size first: no byte of body is read before them.
        check_head = getattr(self._handler, "check_head", None)
        early = None if check_head is None else check_head(request)
        if early is not None:
            return cast(Response, early)
        try:
            length = _http.body_length(request.headers, MAX_ADMIN_BODY)
        except _http.HttpError as exc:
            return admin_error(exc.status, exc.message)
        hub = self._hub
        with hub.cond:
            fits = self._body_bytes + length <= ADMIN_BODY_BUDGET
            if fits:
                self._body_bytes += length
                hub.changed()
        if not fits:
            return admin_error(
                503, "too many admin request bodies at once; retry shortly", [("Retry-After", "1")]
            )
        try:
            return self._call(sock, addr, request, length, surplus)
        finally:
            with hub.cond:
                self._body_bytes -= length
                hub.changed()

    def _call(
        self,
        sock: socket.socket,
        addr: Any,
        request: _http.HttpRequest,
        length: int,
        surplus: bytes,
    ) -> Response:
        assert self._handler is not None
        try:
            body = _http.read_body(
                sock, request.headers, length, surplus, monotonic() + ADMIN_IO_TIMEOUT
            )
        except _http.HttpError as exc:
            return admin_error(exc.status, exc.message)
        except TimeoutError:
            return admin_error(408, "the request body came too slowly")
        except OSError:
            return admin_error(400, "the connection failed while reading the body")
        request = dataclasses.replace(request, body=body)
        try:
            response = self._handler(self._server, _http.AdminExchange(addr), request)
        except Exception:
            _LOG.exception("the admin handler failed on %s", request.method)
            return admin_error(500, "internal error; see the server log", code="INTERNAL")
        if response is None:
            return admin_error(404, "no such admin endpoint")
        return response
