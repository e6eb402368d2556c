"""A JSON HTTP admin API for :class:`~orbit_sync.testing.MockOrbitServer`, on the WebSocket port.

It lets another process (a benchmark, a worker written in another language, a shell script)
drive a standalone mock server: enqueue and inspect tasks, cancel them, move server time, pause
queues, arm faults, read the event log and check invariants::

    api = AdminAPI()                                   # or AdminAPI("my-admin-token")
    with MockOrbitServer(admin_handler=api) as server:
        ...  # POST http://127.0.0.1:PORT/admin/v1/tasks?handler=resize&payload={"w":1}
             # Authorization: Bearer <api.token>

**Why query strings, not JSON bodies.** The server is websockets' sync server, whose HTTP parser
only reads what an opening handshake has: the request line and headers. ``Request.parse`` refuses
any ``Content-Length`` other than ``0`` (and any ``Transfer-Encoding``) *before*
``process_request`` runs, and drops the connection without an answer; the bytes of a body are
never handed to us. Reading them would mean patching websockets internals. So every request is
body-less: reads are ``GET``, changes are ``POST`` (``Content-Length: 0`` or none), and arguments
are query parameters. A JSON-valued argument (a task ``payload``, a raw frame) is strict JSON text
in one parameter, parsed with :func:`orbit_sync._json.loads` (duplicate keys, NaN, lone surrogates
are refused). websockets caps the request line at 8 KiB, so such values must stay a few KiB;
bigger payloads belong to the Python API.

Every request needs ``Authorization: Bearer <admin token>``; worker tokens are not accepted, and
the admin token is not a worker token. Answers are JSON (``application/json``), times RFC 3339
UTC. Errors are ``{"error": {"code": ..., "message": ...}}`` with a stable code and a message that
names the parameter at fault but never repeats a value sent to us.
"""

from __future__ import annotations

import datetime as _dt
import enum
import hmac
import http
import logging
import math
import re
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.sync.server import ServerConnection

from .. import _json
from .._codec import format_time, parse_time
from ..errors import FrameError
from ..models import CODE_RE, ID_RE, TaskState
from ._clock import ManualClock
from ._faults import Fault
from ._snapshots import RetrySafety
from ._state import SCOPE_CONNECT, SCOPE_CONSUME, InvariantError, queue_scope

if TYPE_CHECKING:
    from ._server import MockOrbitServer

__all__ = ["ADMIN_PREFIX", "AdminAPI", "AdminClient", "AdminError", "admin_url"]

_LOG = logging.getLogger("orbit_sync.testing.admin")

#: Every endpoint lives under this path.
ADMIN_PREFIX = "/admin/v1"
#: The longest a ``wait`` request may block the connection's thread (and a server's stop).
MAX_WAIT = 30.0
#: Query parameters per request: enough for the widest endpoint, small enough to parse cheaply.
_MAX_FIELDS = 32
#: Same character set as :class:`orbit_sync.client.Client` accepts (RFC 6750 b64token and co.).
_TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/=:!#$%&'*^`|]{1,512}")
#: Parameter names we may repeat in an error message (anything else could be pasted data).
_SAFE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_FRAME_TYPE = re.compile(r"[a-z]+\.[a-z]+")
_UINT = re.compile(r"0|[1-9][0-9]{0,8}")
_SECONDS = re.compile(r"(0|[1-9][0-9]{0,9})(\.[0-9]{1,9})?")
_ENQUEUE_PARAMS = (
    "handler payload handler_version payload_version queue_id max_attempts backoff_initial"
    " backoff_max attempt_time_limit retry_safety deadline latest_start"
)
#: Fault kinds: the names of ``server.faults``' arming methods.
_FAULT_KINDS = (
    "drop_reply",
    "close_before",
    "close_after",
    "delay_reply",
    "reply_error",
    "duplicate_push",
    "refuse_connections",
)


class _Problem(Exception):
    """An answer other than 2xx: status, stable code, public message (never a secret)."""

    def __init__(
        self, status: int, code: str, message: str, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = tuple(headers)


def _bad(message: str) -> _Problem:
    return _Problem(400, "INVALID_ARGUMENT", message)


def _not_found(message: str) -> _Problem:
    return _Problem(404, "NOT_FOUND", message)


def _shown(name: str) -> str:
    return f"'{name}'" if _SAFE_NAME.fullmatch(name) else "(unprintable name)"


class _Params:
    """Strict query parameters: each given once, each known, each well-formed."""

    def __init__(self, query: str) -> None:
        pairs: list[tuple[str, str]] = []
        if query:
            try:
                pairs = urllib.parse.parse_qsl(
                    query,
                    keep_blank_values=True,
                    strict_parsing=True,
                    encoding="utf-8",
                    errors="strict",
                    max_num_fields=_MAX_FIELDS,
                )
            except ValueError:
                # parse_qsl's own messages quote the offending field: never echo it.
                raise _bad(
                    "malformed query string: expected name=value pairs, percent-encoded UTF-8, "
                    f"at most {_MAX_FIELDS} of them"
                ) from None
        self._values: dict[str, str] = {}
        for name, value in pairs:
            if name in self._values:
                raise _bad(f"parameter {_shown(name)} is given more than once")
            self._values[name] = value
        self._used: set[str] = set()

    def _raw(self, name: str) -> str | None:
        self._used.add(name)
        return self._values.get(name)

    def only(self, known: frozenset[str]) -> None:
        """Refuse any parameter outside *known*."""
        unknown = sorted(set(self._values) - known)
        if unknown:
            raise _bad(f"unknown parameter {_shown(unknown[0])}")

    def done(self) -> None:
        """Refuse parameters no handler asked for: a typo must not be silently ignored."""
        unknown = sorted(set(self._values) - self._used)
        if unknown:
            raise _bad(f"unknown parameter {_shown(unknown[0])}")

    def text(self, name: str, *, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
        value = self._raw(name)
        if value is None:
            raise _bad(f"parameter '{name}' is required")
        if pattern is not None and not pattern.fullmatch(value):
            raise _bad(f"parameter '{name}' must be {what}")
        return value

    def opt_text(
        self, name: str, *, pattern: re.Pattern[str] | None = None, what: str = ""
    ) -> str | None:
        if self._raw(name) is None:
            return None
        return self.text(name, pattern=pattern, what=what)

    def opt_id(self, name: str) -> str | None:
        return self.opt_text(name, pattern=ID_RE, what="32 lowercase hex characters")

    def opt_int(self, name: str, low: int, high: int) -> int | None:
        value = self._raw(name)
        if value is None:
            return None
        if not _UINT.fullmatch(value) or not low <= int(value) <= high:
            raise _bad(f"parameter '{name}' must be a decimal integer from {low} to {high}")
        return int(value)

    def opt_seconds(self, name: str, *, high: float = 1e9, positive: bool = False) -> float | None:
        value = self._raw(name)
        if value is None:
            return None
        seconds = float(value) if _SECONDS.fullmatch(value) else math.nan
        if not (seconds > 0 if positive else seconds >= 0) or not seconds <= high:
            low = "> 0" if positive else ">= 0"
            raise _bad(
                f"parameter '{name}' must be a plain decimal number of seconds, {low} and "
                f"<= {high:g}"
            )
        return seconds

    def opt_bool(self, name: str) -> bool | None:
        value = self._raw(name)
        if value is None:
            return None
        if value not in ("true", "false"):
            raise _bad(f"parameter '{name}' must be true or false")
        return value == "true"

    def opt_json(self, name: str) -> Any:
        value = self._raw(name)
        if value is None:
            return None
        try:
            return _json.loads(value)
        except FrameError as exc:
            # FrameError messages describe the defect, never the content.
            raise _bad(f"parameter '{name}' is not strict JSON: {exc}") from None

    def opt_moment(self, name: str) -> float | _dt.datetime | None:
        """Seconds from now, or an RFC 3339 UTC time."""
        value = self._raw(name)
        if value is None:
            return None
        if _SECONDS.fullmatch(value):
            return float(value)
        try:
            return parse_time(value)
        except ValueError:
            raise _bad(
                f"parameter '{name}' must be seconds from now or an RFC 3339 UTC time"
            ) from None

    def opt_list(self, name: str, *, pattern: re.Pattern[str], what: str) -> list[str] | None:
        value = self._raw(name)
        if value is None:
            return None
        items = [] if value == "" else value.split(",")
        for item in items:
            if not pattern.fullmatch(item):
                raise _bad(f"parameter '{name}' must be a comma-separated list of {what}")
        return items


def jsonable(value: Any) -> Any:
    """Plain JSON data from a snapshot: attrs classes to objects, times to RFC 3339 strings,
    enums to their values. Fields named like a secret are left out, whatever they hold."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, int | float):
        return value
    if isinstance(value, _dt.datetime):
        return format_time(value)
    if attrs.has(type(value)):
        return {
            f.name: jsonable(getattr(value, f.name))
            for f in attrs.fields(type(value))
            if "secret" not in f.name and "token" not in f.name
        }
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    raise TypeError(f"cannot serialize {type(value).__name__} to JSON")


def _response(
    status: int, body: Mapping[str, Any], headers: Iterable[tuple[str, str]] = ()
) -> Response:
    data = (_json.dumps(body) + "\n").encode("utf-8")
    phrase = http.HTTPStatus(status).phrase
    hdrs = Headers(
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            # Answers may carry tokens (POST /tokens) and always describe live state.
            ("Cache-Control", "no-store"),
            # websockets closes the TCP connection after any non-101 answer; say so.
            ("Connection", "close"),
            *headers,
        ]
    )
    return Response(status, phrase, hdrs, data)


Route = Callable[["MockOrbitServer", _Params, "re.Match[str]", Request], tuple[int, dict[str, Any]]]


class AdminAPI:
    """The admin endpoints; pass the instance (or :meth:`handle`) as the server's
    ``admin_handler``. *token* defaults to a fresh random one (see :attr:`token`).

    Endpoints, under ``/admin/v1``::

        GET  /server                             url, default queue, windows, server time
        GET  /clock                              server time
        POST /clock/advance?seconds=S            server.advance(S): due work runs on the way
        GET  /tasks[?state=A,B&queue_id=&handler=]   task snapshots
        POST /tasks?handler=&payload=JSON[&...]  enqueue (201); policy parameters optional:
                                                 handler_version, payload_version, queue_id,
                                                 max_attempts, backoff_initial, backoff_max,
                                                 retry_safety, deadline, latest_start,
                                                 attempt_time_limit
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
                                                 "dropped": events the ring no longer holds
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
        elif not _TOKEN_RE.fullmatch(token):
            raise ValueError(
                "admin token must be 1-512 characters, without spaces or control characters"
            )
        self._token = token
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._routes: list[tuple[str, re.Pattern[str], Route, frozenset[str]]] = []
        hexid = r"([0-9a-f]{32})"
        queue = r"([0-9a-f]{32}|default)"
        for method, pattern, route, names in (
            ("GET", r"/server", self._server_info, ""),
            ("GET", r"/clock", self._clock, ""),
            ("POST", r"/clock/advance", self._advance, "seconds"),
            ("GET", r"/tasks", self._list_tasks, "state queue_id handler"),
            (
                "POST",
                r"/tasks",
                self._enqueue,
                _ENQUEUE_PARAMS,
            ),
            ("GET", rf"/tasks/{hexid}", self._get_task, ""),
            ("POST", rf"/tasks/{hexid}/cancel", self._cancel_task, ""),
            ("GET", rf"/tasks/{hexid}/wait", self._wait_task, "states timeout"),
            ("POST", r"/queues", self._add_queue, "max_concurrency paused"),
            ("POST", rf"/queues/{queue}/(pause|resume)", self._pause_resume, ""),
            ("POST", rf"/queues/{queue}/concurrency", self._concurrency, "max_concurrency"),
            ("POST", r"/tokens", self._add_token, "scopes queue_id"),
            ("POST", r"/tokens/revoke", self._revoke_token, ""),
            ("GET", r"/sessions", self._sessions, ""),
            ("POST", r"/disconnect", self._disconnect, "session_id"),
            ("GET", r"/events", self._events, "since limit"),
            ("GET", r"/invariants", self._invariants, ""),
            ("GET", r"/faults", self._list_faults, ""),
            (
                "POST",
                r"/faults",
                self._arm_fault,
                "kind frame_type session_id count seconds code status",
            ),
            ("POST", r"/faults/clear", self._clear_faults, ""),
            ("POST", r"/faults/send-raw", self._send_raw, "text session_id"),
            ("GET", r"/faults/([1-9][0-9]{0,8})/wait", self._wait_fault, "timeout"),
            ("POST", r"/faults/([1-9][0-9]{0,8})/cancel", self._cancel_fault, ""),
        ):
            compiled = re.compile(re.escape(ADMIN_PREFIX) + pattern)
            self._routes.append((method, compiled, route, frozenset(names.split())))

    @property
    def token(self) -> str:
        """The admin bearer token (deliberately readable: it is the caller's own test server)."""
        return self._token

    def __repr__(self) -> str:
        return "AdminAPI(token=<redacted>)"

    def __call__(
        self, server: MockOrbitServer, connection: ServerConnection, request: Request
    ) -> Response:
        return self.handle(server, connection, request)

    # ------------------------------------------------------------------ dispatch

    def handle(
        self, server: MockOrbitServer, connection: ServerConnection, request: Request
    ) -> Response:
        """Answer one HTTP request under ``/admin/`` (the server's ``admin_handler``)."""
        path, _, query = request.path.partition("?")
        try:
            status, body = self._dispatch(server, request, path, query)
        except _Problem as problem:
            _LOG.debug("admin %s %s -> %d", request.method, path, problem.status)
            return _response(
                problem.status,
                {"error": {"code": problem.code, "message": problem.message}},
                problem.headers,
            )
        except Exception:
            # Logged with its traceback (no request data in it); the caller gets no details.
            _LOG.exception("admin %s %s failed", request.method, path)
            return _response(
                500, {"error": {"code": "INTERNAL", "message": "internal error; see server log"}}
            )
        _LOG.debug("admin %s %s -> %d", request.method, path, status)
        return _response(status, body)

    def _dispatch(
        self, server: MockOrbitServer, request: Request, path: str, query: str
    ) -> tuple[int, dict[str, Any]]:
        self._authenticate(request)
        allowed = []
        for method, pattern, route, known in self._routes:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            if method != request.method:
                allowed.append(method)
                continue
            params = _Params(query)
            # Unknown names first: a misspelt optional parameter must not pass unnoticed, and a
            # misspelt required one is better reported as the typo than as missing.
            params.only(known)
            try:
                result = route(server, params, match, request)
            except KeyError as exc:
                # The server's KeyErrors name what is unknown by kind and id: ids are not secret.
                raise _not_found(str(exc.args[0]) if exc.args else "not found") from None
            except ValueError as exc:
                # Argument checks of the server API (handler names, budgets, windows) describe
                # the rule broken, not the value. A TypeError would be our bug: it stays a 500.
                raise _bad(str(exc)) from None
            return result
        if allowed:
            raise _Problem(
                405,
                "METHOD_NOT_ALLOWED",
                f"use {' or '.join(sorted(set(allowed)))} here",
                [("Allow", ", ".join(sorted(set(allowed))))],
            )
        raise _not_found("no such admin endpoint")

    def _authenticate(self, request: Request) -> None:
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
            raise _Problem(
                401,
                "UNAUTHENTICATED",
                "admin endpoints need Authorization: Bearer <admin token>",
                [("WWW-Authenticate", 'Bearer realm="orbit-admin"')],
            )

    # ------------------------------------------------------------------ server and time

    def _server_info(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        return 200, {
            "url": server.url,
            "queue_id": server.queue_id,
            "namespace_id": server.namespace_id,
            "lease_duration": server.lease_duration,
            "session_window": server.session_window,
            "manual_clock": isinstance(server.clock, ManualClock),
            "now": format_time(server.now()),
        }

    def _clock(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        return 200, {"now": format_time(server.now())}

    def _advance(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        seconds = p.opt_seconds("seconds")
        p.done()
        if seconds is None:
            raise _bad("parameter 'seconds' is required")
        server.advance(seconds)
        return 200, {"now": format_time(server.now())}

    # ------------------------------------------------------------------ tasks

    def _list_tasks(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        states = _states(p, "state", required=False)
        queue_id = p.opt_id("queue_id")
        handler = p.opt_text("handler")
        p.done()
        tasks = [
            t
            for t in server.tasks()
            if (states is None or t.state in states)
            and (queue_id is None or t.queue_id == queue_id)
            and (handler is None or t.handler == handler)
        ]
        return 200, {"tasks": jsonable(tasks), "count": len(tasks)}

    def _enqueue(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        handler = p.text("handler")
        if p.opt_text("payload") is None:
            raise _bad("parameter 'payload' is required (JSON text, not null)")
        payload = p.opt_json("payload")
        if payload is None:
            raise _bad("parameter 'payload' must be JSON other than null")
        kwargs: dict[str, Any] = {}
        for name in ("handler_version", "payload_version"):
            value = p.opt_text(name)
            if value is not None:
                kwargs[name] = value
        queue_id = _queue_param(server, p.opt_text("queue_id"))
        if queue_id is not None:
            kwargs["queue_id"] = queue_id
        max_attempts = p.opt_int("max_attempts", 1, 1000)
        if max_attempts is not None:
            kwargs["max_attempts"] = max_attempts
        for name in ("backoff_initial", "backoff_max"):
            seconds = p.opt_seconds(name)
            if seconds is not None:
                kwargs[name] = seconds
        limit = p.opt_seconds("attempt_time_limit", positive=True)
        if limit is not None:
            kwargs["attempt_time_limit"] = limit
        safety = p.opt_text("retry_safety")
        if safety is not None:
            if safety not in RetrySafety.__members__:
                raise _bad("parameter 'retry_safety' must be IDEMPOTENT or RECONCILE_ONLY")
            kwargs["retry_safety"] = RetrySafety(safety)
        for name in ("deadline", "latest_start"):
            moment = p.opt_moment(name)
            if moment is not None:
                kwargs[name] = moment
        p.done()
        task_id = server.enqueue(handler, payload, **kwargs)
        return 201, {"task_id": task_id, "task": jsonable(server.task(task_id))}

    def _get_task(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        return 200, {"task": jsonable(server.task(m.group(1)))}

    def _cancel_task(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        server.request_cancel(m.group(1))
        return 200, {"task": jsonable(server.task(m.group(1)))}

    def _wait_task(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        states = _states(p, "states", required=True)
        assert states is not None
        timeout = p.opt_seconds("timeout", high=MAX_WAIT)
        p.done()
        task_id = m.group(1)
        server.task(task_id)  # 404 before blocking
        reached = _wait(
            server,
            lambda: server.task(task_id).state in states,
            10.0 if timeout is None else timeout,
        )
        return 200, {"reached": reached, "task": jsonable(server.task(task_id))}

    # ------------------------------------------------------------------ queues and tokens

    def _add_queue(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        limit = _concurrency_param(p, required=False)
        paused = p.opt_bool("paused")
        p.done()
        queue_id = server.add_queue(max_concurrency=limit, paused=bool(paused))
        return 201, {"queue_id": queue_id}

    def _pause_resume(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        queue_id = _queue_param(server, m.group(1))
        if m.group(2) == "pause":
            server.pause_queue(queue_id)
        else:
            server.resume_queue(queue_id)
        return 200, {"queue_id": queue_id, "paused": m.group(2) == "pause"}

    def _concurrency(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        limit = _concurrency_param(p, required=True)
        p.done()
        queue_id = _queue_param(server, m.group(1))
        server.set_max_concurrency(limit, queue_id)
        return 200, {"queue_id": queue_id, "max_concurrency": limit}

    def _add_token(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        scopes = p.opt_list(
            "scopes", pattern=re.compile(r"[\x21-\x2b\x2d-\x7e]{1,200}"), what="scopes"
        )
        queue_id = _queue_param(server, p.opt_text("queue_id"))
        p.done()
        if scopes is not None and queue_id is not None:
            raise _bad("give either 'scopes' or 'queue_id', not both")
        if scopes is None:
            qid = server.queue_id if queue_id is None else queue_id
            scopes = [SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(qid)]
        token = server.add_token(scopes)
        # The token is the answer's purpose: the caller administers this test server.
        return 201, {"token": token, "scopes": sorted(set(scopes))}

    def _revoke_token(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        # In a header, never the URL: credentials do not belong in request lines or access logs.
        values = r.headers.get_all("Orbit-Worker-Token")
        if len(values) != 1 or not values[0]:
            raise _bad("header 'Orbit-Worker-Token' must carry the worker token to revoke")
        server.revoke_token(values[0])
        return 200, {"revoked": True}

    # ------------------------------------------------------------------ sessions and events

    def _sessions(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        return 200, {"sessions": jsonable(server.sessions())}

    def _disconnect(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        session_id = p.opt_id("session_id")
        p.done()
        return 200, {"disconnected": server.disconnect(session_id)}

    def _events(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        since = p.opt_int("since", 0, 10**9) or 0
        limit = p.opt_int("limit", 1, 10_000) or 1000
        p.done()
        # `since` counts every event ever recorded; the log is a ring that may have dropped
        # the oldest ones (`dropped`), so a cursor older than the ring starts at its oldest.
        log = server.events()
        start = max(since, log.dropped)
        events = log[start - log.dropped : start - log.dropped + limit]
        return 200, {
            "events": jsonable(events),
            "next": start + len(events),
            "dropped": log.dropped,
        }

    def _invariants(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        try:
            server.check_invariants()
        except InvariantError as exc:
            return 200, {"ok": False, "problems": list(exc.problems)}
        return 200, {"ok": True, "problems": []}

    # ------------------------------------------------------------------ faults

    def _fault_view(self, number: int, fault: Fault) -> dict[str, Any]:
        return {
            "id": number,
            "kind": fault.kind,
            "frame_type": fault.frame_type,
            "session_id": fault.session_id,
            "count": fault.count,
            "fired": fault.fired,
            "armed": fault.armed,
        }

    def _fault(self, m: re.Match[str]) -> tuple[int, Fault]:
        number = int(m.group(1))
        with self._lock:
            if number > len(self._faults):
                raise _not_found(f"no fault {number} was armed through this API")
            return number, self._faults[number - 1]

    def _list_faults(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        with self._lock:
            faults = list(enumerate(self._faults, 1))
        return 200, {"faults": [self._fault_view(n, f) for n, f in faults]}

    def _arm_fault(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        kind = p.text("kind")
        if kind not in _FAULT_KINDS:
            raise _bad(f"parameter 'kind' must be one of {', '.join(_FAULT_KINDS)}")
        count = p.opt_int("count", 1, 10**6) or 1
        faults = server.faults
        fault: Fault
        if kind == "refuse_connections":
            status = p.opt_int("status", 300, 599) or 503
            p.done()
            fault = faults.refuse_connections(count, status)
        else:
            frame_type = p.opt_text(
                "frame_type", pattern=_FRAME_TYPE, what="a frame type such as task.finish"
            )
            session_id = p.opt_id("session_id")
            seconds = p.opt_seconds("seconds", high=60.0) if kind == "delay_reply" else None
            code = (
                p.opt_text("code", pattern=CODE_RE, what="an error code [A-Z][A-Z0-9_]*")
                if kind == "reply_error"
                else None
            )
            p.done()
            if kind == "duplicate_push":
                fault = faults.duplicate_push(
                    frame_type or "task.assign", count, session_id=session_id
                )
            elif frame_type is None:
                raise _bad(f"parameter 'frame_type' is required for {kind}")
            elif kind == "delay_reply":
                fault = faults.delay_reply(
                    frame_type, 0.5 if seconds is None else seconds, count, session_id=session_id
                )
            elif kind == "reply_error":
                fault = faults.reply_error(
                    frame_type, code or "UNAVAILABLE", count, session_id=session_id
                )
            elif kind == "drop_reply":
                fault = faults.drop_reply(frame_type, count, session_id=session_id)
            elif kind == "close_before":
                fault = faults.close_before(frame_type, count, session_id=session_id)
            else:
                fault = faults.close_after(frame_type, count, session_id=session_id)
        with self._lock:
            self._faults.append(fault)
            number = len(self._faults)
        return 201, {"fault": self._fault_view(number, fault)}

    def _wait_fault(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        timeout = p.opt_seconds("timeout", high=MAX_WAIT)
        p.done()
        number, fault = self._fault(m)
        deadline = time.monotonic() + (10.0 if timeout is None else timeout)
        # A fault's firing does not always notify the server's condition (a refused upgrade
        # changes no state), so wait on the fault's own event, in slices short enough to notice
        # a stopping server (whose stop() joins this thread).
        reached = fault.wait(0)
        while not reached and not _stopping(server):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            reached = fault.wait(min(remaining, 0.1))
        return 200, {"reached": reached, "fault": self._fault_view(number, fault)}

    def _cancel_fault(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        number, fault = self._fault(m)
        fault.cancel()
        return 200, {"fault": self._fault_view(number, fault)}

    def _clear_faults(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        server.faults.clear()
        return 200, {"cleared": True}

    def _send_raw(
        self, server: MockOrbitServer, p: _Params, m: re.Match[str], r: Request
    ) -> tuple[int, dict[str, Any]]:
        text = p.text("text")
        session_id = p.opt_id("session_id")
        p.done()
        try:
            server.faults.send_raw(text, session_id)
        except LookupError:
            raise _Problem(409, "NO_SESSION", "no connected session to send to") from None
        return 200, {"sent": True}


def _states(p: _Params, name: str, *, required: bool) -> frozenset[TaskState] | None:
    names = p.opt_list(name, pattern=re.compile(r"[A-Z_]{1,32}"), what="task states")
    if names is None:
        if required:
            raise _bad(f"parameter '{name}' is required (comma-separated task states)")
        return None
    if not names or any(n not in TaskState.__members__ for n in names):
        raise _bad(
            f"parameter '{name}' must list task states among "
            + ", ".join(s.value for s in TaskState)
        )
    return frozenset(TaskState(n) for n in names)


def _queue_param(server: MockOrbitServer, value: str | None) -> str | None:
    if value is None:
        return None
    if value == "default":
        return server.queue_id
    if not ID_RE.fullmatch(value):
        raise _bad("a queue id must be 32 lowercase hex characters or 'default'")
    return value


def _concurrency_param(p: _Params, *, required: bool) -> int | None:
    raw = p.opt_text("max_concurrency")
    if raw is None:
        if required:
            raise _bad("parameter 'max_concurrency' is required (an integer >= 1, or none)")
        return None
    if raw == "none":
        return None
    value = p.opt_int("max_concurrency", 1, 10**6)
    assert value is not None
    return value


def _wait(server: MockOrbitServer, condition: Callable[[], bool], timeout: float) -> bool:
    """Block on the server's own change notifications until *condition* holds.

    The wait runs on the connection's handshake thread, which ``server.stop()`` joins, so it also
    ends as soon as the server starts stopping."""

    def predicate(s: MockOrbitServer) -> bool:
        return condition() or _stopping(s)

    try:
        server.wait_until(predicate, timeout)
    except TimeoutError:
        return False
    if _stopping(server) and not condition():
        raise _Problem(503, "UNAVAILABLE", "the server is stopping")
    return True


def _stopping(server: MockOrbitServer) -> bool:
    # stop() sets this and notifies the condition wait_until waits on: the wake-up needed here.
    return server.stopping


# --------------------------------------------------------------------------- client side


class AdminError(Exception):
    """A non-2xx answer of the admin API: ``status``, ``code`` and the server's ``message``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.status, self.code, self.message))


def admin_url(server_url: str) -> str:
    """The admin API's base URL for a server URL (``ws://h:p`` → ``http://h:p/admin/v1``)."""
    scheme, sep, rest = server_url.partition("://")
    if not sep or scheme not in ("ws", "wss", "http", "https"):
        raise ValueError("expected a ws://, wss://, http:// or https:// URL")
    secure = scheme in ("wss", "https")
    return ("https" if secure else "http") + "://" + rest.rstrip("/") + ADMIN_PREFIX


class AdminClient:
    """A small client of the admin API, for tests and scripts (one HTTP connection per call,
    as the server closes each after answering).

    *url* is the server's URL (``ws://127.0.0.1:PORT``) or the admin base URL. Parameter values
    may be str, int, float, bool (``true``/``false``) or a list of str (comma-joined); a task
    payload goes through :meth:`enqueue`, which serializes it as strict JSON.
    """

    def __init__(
        self, url: str, token: str, *, timeout: float = MAX_WAIT + 5.0, ssl_context: Any = None
    ) -> None:
        base = url if url.rstrip("/").endswith(ADMIN_PREFIX) else admin_url(url)
        parts = urllib.parse.urlsplit(base)
        if parts.hostname is None:
            raise ValueError("the admin URL needs a host")
        self._secure = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._secure else 80)
        self._prefix = parts.path.rstrip("/")
        self._token = token
        self._timeout = timeout
        self._ssl = ssl_context
        self.url = base.rstrip("/")

    def __repr__(self) -> str:
        return f"AdminClient({self.url!r}, token=<redacted>)"

    def request(
        self,
        method: str,
        path: str,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Send one request; return ``(status, parsed JSON)`` whatever the status."""
        import http.client

        query = urllib.parse.urlencode(
            {k: _param_text(v) for k, v in (params or {}).items() if v is not None}
        )
        target = self._prefix + path + (f"?{query}" if query else "")
        conn: http.client.HTTPConnection
        if self._secure:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        try:
            conn.request(
                method,
                target,
                headers={"Authorization": f"Bearer {self._token}", **(headers or {})},
            )
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        try:
            body = _json.loads(data)
        except FrameError:
            body = {"error": {"code": "NOT_JSON", "message": "the answer is not JSON"}}
        if not isinstance(body, dict):
            body = {"error": {"code": "NOT_JSON", "message": "the answer is not a JSON object"}}
        return response.status, body

    def call(self, method: str, path: str, **params: Any) -> dict[str, Any]:
        """Send one request; return the JSON answer, or raise :class:`AdminError`."""
        status, body = self.request(method, path, params)
        if not 200 <= status < 300:
            error = body.get("error") or {}
            raise AdminError(status, str(error.get("code", "")), str(error.get("message", "")))
        return body

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        """``GET {admin url}{path}?params``."""
        return self.call("GET", path, **params)

    def post(self, path: str, **params: Any) -> dict[str, Any]:
        """``POST {admin url}{path}?params`` (no body)."""
        return self.call("POST", path, **params)

    def enqueue(self, handler: str, payload: Any, **params: Any) -> str:
        """Enqueue a task (payload serialized as strict JSON); returns its id."""
        body = self.post("/tasks", handler=handler, payload=_json.dumps(payload), **params)
        return str(body["task_id"])

    def task(self, task_id: str) -> dict[str, Any]:
        """One task snapshot, as JSON."""
        return dict(self.get(f"/tasks/{task_id}")["task"])

    def wait(self, task_id: str, states: Iterable[str], timeout: float = 10.0) -> dict[str, Any]:
        """Block until the task is in one of *states*; raise TimeoutError if it is not."""
        body = self.get(f"/tasks/{task_id}/wait", states=list(states), timeout=timeout)
        if not body["reached"]:
            raise TimeoutError(f"task {task_id} is {body['task']['state']} after {timeout} s")
        return dict(body["task"])


def _param_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        # str(1e-07) is "1e-07": the API takes plain decimals only.
        return f"{value:.9f}".rstrip("0").rstrip(".")
    if isinstance(value, int | str):
        return str(value)
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(str(v.value if isinstance(v, enum.Enum) else v) for v in value)
    raise TypeError(f"cannot send a {type(value).__name__} as a query parameter")
