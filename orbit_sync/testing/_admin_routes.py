"""The admin API (:class:`AdminAPI`) of :class:`~._server.MockOrbitServer`: credentials, routing,
answers.

It lets another process (a benchmark, a worker written in another language, a shell script)
drive a standalone mock server: enqueue and inspect tasks (one at a time or in bulk), cancel them,
move server time, pause queues, arm faults, read the event log and check invariants::

    api = AdminAPI()                                   # or AdminAPI("my-admin-token")
    with MockOrbitServer(admin_handler=api) as server:
        ...  # POST http://127.0.0.1:PORT/admin/v1/tasks
             # Authorization: Bearer <api.token>
             # Content-Type: application/json
             # {"handler": "resize", "payload": {"w": 1}}

Arguments come as a JSON object body or as query parameters (see :mod:`._admin_query`). Every
request needs ``Authorization: Bearer <admin token>``; worker tokens are not accepted, and the
admin token is not a worker token. Answers are JSON (``application/json``), times RFC 3339 UTC.
Errors are ``{"error": {"code": ..., "message": ...}}`` with a status, a stable code and a
message that names the parameter at fault but never repeats a value sent to us.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
from typing import TYPE_CHECKING

from websockets.http11 import Response

from . import _admin_control, _admin_tasks
from ._admin_client import ADMIN_PREFIX
from ._admin_endpoint import Answer, Route
from ._admin_faults import FaultDesk
from ._admin_query import Params, Problem, bad, not_found, parse_body
from ._http import AdminExchange, HttpRequest, json_response
from ._options import TOKEN_RE

if TYPE_CHECKING:
    from ._server import MockOrbitServer

__all__ = ["AdminAPI"]

_LOG = logging.getLogger("orbit_sync.testing.admin")

#: The largest JSON body an endpoint parses (the server refuses larger bodies before reading).
MAX_BODY = 16 * 1024 * 1024


class AdminAPI:
    """The admin endpoints; pass the instance (or :meth:`handle`) as the server's
    ``admin_handler``. *token* defaults to a fresh random one (see :attr:`token`).

    Endpoints, under ``/admin/v1``::

        GET  /server                             url, default queue, windows, bounds, server time
        GET  /clock                              server time
        POST /clock/advance?seconds=S            server.advance(S): due work runs on the way
        GET  /tasks[?state=A,B&queue_id=&handler=&limit=N&after=C]   one page of task
                                                 snapshots (default 1000, at most 10000);
                                                 "next": the cursor for after=, or null
        POST /tasks {handler, payload[, ...]}     enqueue (201); the enqueue options optional:
                                                 handler_version, payload_version, queue_id,
                                                 max_attempts, backoff_initial, backoff_max,
                                                 retry_safety, deadline, latest_start,
                                                 attempt_time_limit
        POST /tasks/bulk {tasks: [{...}, ...]}   enqueue many, all or none (201)
        GET  /tasks/{id}                         one snapshot
        POST /tasks/{id}/cancel                  server.request_cancel(id)
        GET  /tasks/{id}/wait?states=A,B[&timeout=S]   block until reached (at most 30 s)
        POST /queues[?max_concurrency=N&paused=true]   new queue (201)
        POST /queues/{id|default}/pause          pause; /resume resumes
        POST /queues/{id|default}/concurrency?max_concurrency=N|none
        POST /tokens[?scopes=a,b | ?queue_id=]   new worker token (201)
        POST /tokens/revoke                      the token in header Orbit-Worker-Token
        GET  /sessions                           session snapshots
        POST /disconnect[?session_id=]           cut one connection, or all, abruptly
        GET  /events[?since=N&limit=M]           the event log from offset N; "next" offset,
                                                 "dropped": events the ring no longer holds,
                                                 "missed": those of them at or after N
        GET  /invariants                         {"ok": bool, "problems": [...]}
        GET  /faults                             faults armed through this API
        POST /faults?kind=K[&frame_type=&count=&session_id=&seconds=&code=&status=]  (201)
        GET  /faults/{n}/wait[?timeout=S]        block until it fired count times
        POST /faults/{n}/cancel                  disarm one; POST /faults/clear disarms all
        POST /faults/send-raw?text=&session_id=  push one unchecked text frame
    """

    def __init__(self, token: str | None = None) -> None:
        if token is None:
            token = secrets.token_urlsafe(32)
        elif not isinstance(token, str):
            raise TypeError("admin token must be a str")
        elif not TOKEN_RE.fullmatch(token):
            raise ValueError(
                "admin token must be 1-512 characters, without spaces or control characters"
            )
        self._token = token
        self._routes: list[tuple[str, re.Pattern[str], Route, frozenset[str]]] = []
        for method, pattern, route, names in (
            *_admin_control.ENDPOINTS,
            *_admin_tasks.ENDPOINTS,
            *FaultDesk().endpoints(),
        ):
            compiled = re.compile(re.escape(ADMIN_PREFIX) + pattern)
            known = names.split() if isinstance(names, str) else names
            self._routes.append((method, compiled, route, frozenset(known)))

    @property
    def token(self) -> str:
        """The admin bearer token (deliberately readable: it is the caller's own test server)."""
        return self._token

    def __repr__(self) -> str:
        return "AdminAPI(token=<redacted>)"

    def __call__(
        self, server: MockOrbitServer, connection: AdminExchange, request: HttpRequest
    ) -> Response:
        return self.handle(server, connection, request)

    def check_head(self, request: HttpRequest) -> Response | None:
        """Before the server reads any body: the 401 answer when the token is missing or wrong."""
        try:
            self._authenticate(request)
        except Problem as problem:
            return _problem_response(problem)
        return None

    # ------------------------------------------------------------------ dispatch

    def handle(
        self, server: MockOrbitServer, connection: AdminExchange, request: HttpRequest
    ) -> Response:
        """Answer one HTTP request under ``/admin/`` (the server's ``admin_handler``)."""
        path, _, query = request.path.partition("?")
        try:
            status, body = self._dispatch(server, request, path, query)
        except Problem as problem:
            _LOG.debug("admin %s %s -> %d", request.method, path, problem.status)
            return _problem_response(problem)
        except Exception:
            # Logged with its traceback (no request data in it); the caller gets no details.
            _LOG.exception("admin %s %s failed", request.method, path)
            return json_response(
                500, {"error": {"code": "INTERNAL", "message": "internal error; see server log"}}
            )
        _LOG.debug("admin %s %s -> %d", request.method, path, status)
        return json_response(status, body)

    def _dispatch(
        self, server: MockOrbitServer, request: HttpRequest, path: str, query: str
    ) -> Answer:
        self._authenticate(request)
        allowed = []
        for method, pattern, route, known in self._routes:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            if method != request.method:
                allowed.append(method)
                continue
            params = _params(request, query)
            # Unknown names first: a misspelt optional parameter must not pass unnoticed, and a
            # misspelt required one is better reported as the typo than as missing.
            params.only(known)
            try:
                result = route(server, params, match, request)
            except KeyError as exc:
                # The server's KeyErrors name what is unknown by kind and id: ids are not secret.
                raise not_found(str(exc.args[0]) if exc.args else "not found") from None
            except ValueError as exc:
                # Argument checks of the server API (handler names, budgets, windows) describe
                # the rule broken, not the value. A TypeError would be our bug: it stays a 500.
                raise bad(str(exc)) from None
            return result
        if allowed:
            raise Problem(
                405,
                "METHOD_NOT_ALLOWED",
                f"use {' or '.join(sorted(set(allowed)))} here",
                [("Allow", ", ".join(sorted(set(allowed))))],
            )
        raise not_found("no such admin endpoint")

    def _authenticate(self, request: HttpRequest) -> None:
        values = request.headers.get_all("Authorization")
        given = ""
        if len(values) == 1:
            scheme, _, rest = values[0].partition(" ")
            if scheme.lower() == "bearer":
                given = rest.strip()
        # Constant time: the admin token is a credential. Non-ASCII header text cannot match.
        if not given or not hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), self._token.encode("utf-8")
        ):
            raise Problem(
                401,
                "UNAUTHENTICATED",
                "admin endpoints need Authorization: Bearer <admin token>",
                [("WWW-Authenticate", 'Bearer realm="orbit-admin"')],
            )


def _problem_response(problem: Problem) -> Response:
    return json_response(
        problem.status,
        {"error": {"code": problem.code, "message": problem.message}},
        problem.headers,
    )


def _params(request: HttpRequest, query: str) -> Params:
    """The request's arguments: its query string and its body (JSON object or form)."""
    types = request.headers.get_all("Content-Type")
    if len(types) > 1:
        raise bad("more than one Content-Type")
    values, form = parse_body(types[0] if types else None, request.body, MAX_BODY)
    if values is not None and not isinstance(values, dict):
        raise bad("a JSON body must be an object")
    return Params("&".join(q for q in (query, form) if q), values)
