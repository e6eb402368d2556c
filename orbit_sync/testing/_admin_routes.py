"""The admin API's endpoints (:class:`AdminAPI`), for :class:`~._server.MockOrbitServer`.

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

import datetime as _dt
import enum
import hmac
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
from websockets.http11 import Response

from .._codec import format_time
from ..models import CODE_RE, ID_RE, TaskState
from ._admin_client import ADMIN_PREFIX, DEFAULT_TASK_PAGE, MAX_TASK_PAGE, MAX_WAIT
from ._admin_query import Params, Problem, bad, not_found, parse_body
from ._clock import ManualClock
from ._faults import Fault
from ._http import AdminExchange, HttpRequest, json_response
from ._options import ENQUEUE_OPTIONS, TOKEN_RE
from ._snapshots import RetrySafety
from ._state import SCOPE_CONNECT, SCOPE_CONSUME, InvariantError, queue_scope

if TYPE_CHECKING:
    from ._server import MockOrbitServer

__all__ = ["AdminAPI", "jsonable"]

_LOG = logging.getLogger("orbit_sync.testing.admin")

#: The largest JSON body an endpoint parses (the server refuses larger bodies before reading).
MAX_BODY = 16 * 1024 * 1024
#: Tasks per bulk enqueue.
MAX_BULK = 100_000
_FRAME_TYPE = re.compile(r"[a-z]+\.[a-z]+")
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


Route = Callable[
    ["MockOrbitServer", Params, "re.Match[str]", HttpRequest], tuple[int, dict[str, Any]]
]


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
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._routes: list[tuple[str, re.Pattern[str], Route, frozenset[str]]] = []
        hexid = r"([0-9a-f]{32})"
        queue = r"([0-9a-f]{32}|default)"
        for method, pattern, route, names in (
            ("GET", r"/server", self._server_info, ""),
            ("GET", r"/clock", self._clock, ""),
            ("POST", r"/clock/advance", self._advance, "seconds"),
            ("GET", r"/tasks", self._list_tasks, "state queue_id handler after limit"),
            ("POST", r"/tasks", self._enqueue, _ENQUEUE_NAMES),
            ("POST", r"/tasks/bulk", self._enqueue_bulk, "tasks"),
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

    # ------------------------------------------------------------------ server and time

    def _server_info(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        return 200, {
            "url": server.url,
            "queue_id": server.queue_id,
            "namespace_id": server.namespace_id,
            "lease_duration": server.lease_duration,
            "session_window": server.session_window,
            "manual_clock": isinstance(server.clock, ManualClock),
            "accepting": server.accepting,
            "now": format_time(server.now()),
            "bounds": server.bounds(),
        }

    def _clock(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        return 200, {"now": format_time(server.now())}

    def _advance(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        seconds = p.opt_seconds("seconds")
        p.done()
        if seconds is None:
            raise bad("parameter 'seconds' is required")
        server.advance(seconds)
        return 200, {"now": format_time(server.now())}

    # ------------------------------------------------------------------ tasks

    def _list_tasks(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        states = _states(p, "state", required=False)
        queue_id = p.opt_id("queue_id")
        handler = p.opt_text("handler")
        after = p.opt_int("after", 0, 2**63 - 1) or 0
        limit = p.opt_int("limit", 1, MAX_TASK_PAGE) or DEFAULT_TASK_PAGE
        p.done()
        tasks, cursor = server.task_page(
            states=states, queue_id=queue_id, handler=handler, after=after, limit=limit
        )
        return 200, {"tasks": jsonable(tasks), "count": len(tasks), "next": cursor}

    def _enqueue(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        handler, payload, options = _enqueue_args(server, p)
        task_id = server.enqueue(handler, payload, **options)
        return 201, {"task_id": task_id, "task": jsonable(server.task(task_id))}

    def _enqueue_bulk(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        typed, items = p.given("tasks"), p.opt_json("tasks")
        p.done()
        if not typed or not isinstance(items, list):
            raise bad("parameter 'tasks' is required: a JSON array of task objects")
        if len(items) > MAX_BULK:
            raise bad(f"at most {MAX_BULK} tasks per bulk request")
        specs: list[dict[str, Any]] = []
        for index, item in enumerate(items):
            where = f"tasks[{index}]: "
            if not isinstance(item, dict):
                raise bad(where + "each task must be a JSON object")
            params = Params(body=item, where=where)
            params.only(_ENQUEUE_NAMES)
            handler, payload, options = _enqueue_args(server, params)
            specs.append({"handler": handler, "payload": payload, **options})
        try:
            task_ids = server.enqueue_many(specs)
        except ValueError as exc:
            # The state machine's own checks name the spec by index: say it as the body does.
            raise bad(re.sub(r"^spec ([0-9]+): ", r"tasks[\1]: ", str(exc))) from None
        return 201, {"task_ids": task_ids, "count": len(task_ids)}

    def _get_task(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        return 200, {"task": jsonable(server.task(m.group(1)))}

    def _cancel_task(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        server.request_cancel(m.group(1))
        return 200, {"task": jsonable(server.task(m.group(1)))}

    def _wait_task(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
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
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        limit = _concurrency_param(p, required=False)
        paused = p.opt_bool("paused")
        p.done()
        queue_id = server.add_queue(max_concurrency=limit, paused=bool(paused))
        return 201, {"queue_id": queue_id}

    def _pause_resume(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        queue_id = _queue_param(server, m.group(1))
        if m.group(2) == "pause":
            server.pause_queue(queue_id)
        else:
            server.resume_queue(queue_id)
        return 200, {"queue_id": queue_id, "paused": m.group(2) == "pause"}

    def _concurrency(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        limit = _concurrency_param(p, required=True)
        p.done()
        queue_id = _queue_param(server, m.group(1))
        server.set_max_concurrency(limit, queue_id)
        return 200, {"queue_id": queue_id, "max_concurrency": limit}

    def _add_token(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        scopes = p.opt_list(
            "scopes", pattern=re.compile(r"[\x21-\x2b\x2d-\x7e]{1,200}"), what="scopes"
        )
        queue_id = _queue_param(server, p.opt_text("queue_id"))
        p.done()
        if scopes is not None and queue_id is not None:
            raise bad("give either 'scopes' or 'queue_id', not both")
        if scopes is None:
            qid = server.queue_id if queue_id is None else queue_id
            scopes = [SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(qid)]
        token = server.add_token(scopes)
        # The token is the answer's purpose: the caller administers this test server.
        return 201, {"token": token, "scopes": sorted(set(scopes))}

    def _revoke_token(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        # In a header, never the URL: credentials do not belong in request lines or access logs.
        values = r.headers.get_all("Orbit-Worker-Token")
        if len(values) != 1 or not values[0]:
            raise bad("header 'Orbit-Worker-Token' must carry the worker token to revoke")
        server.revoke_token(values[0])
        return 200, {"revoked": True}

    # ------------------------------------------------------------------ sessions and events

    def _sessions(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        return 200, {"sessions": jsonable(server.sessions())}

    def _disconnect(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        session_id = p.opt_id("session_id")
        p.done()
        return 200, {"disconnected": server.disconnect(session_id)}

    def _events(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        since = p.opt_int("since", 0, 10**9) or 0
        limit = p.opt_int("limit", 1, 10_000) or 1000
        p.done()
        log = server.events()
        # Offsets count every event ever recorded; the ring keeps the latest ones only.
        start = max(since, log.dropped)
        events = log[start - log.dropped : start - log.dropped + limit]
        return 200, {
            "events": jsonable(events),
            "next": start + len(events),
            "dropped": log.dropped,
            "missed": start - since,
        }

    def _invariants(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
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
                raise not_found(f"no fault {number} was armed through this API")
            return number, self._faults[number - 1]

    def _list_faults(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        with self._lock:
            faults = list(enumerate(self._faults, 1))
        return 200, {"faults": [self._fault_view(n, f) for n, f in faults]}

    def _arm_fault(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        kind = p.text("kind")
        if kind not in _FAULT_KINDS:
            raise bad(f"parameter 'kind' must be one of {', '.join(_FAULT_KINDS)}")
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
                raise bad(f"parameter 'frame_type' is required for {kind}")
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
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
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
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        number, fault = self._fault(m)
        fault.cancel()
        return 200, {"fault": self._fault_view(number, fault)}

    def _clear_faults(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        p.done()
        server.faults.clear()
        return 200, {"cleared": True}

    def _send_raw(
        self, server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest
    ) -> tuple[int, dict[str, Any]]:
        text = p.text("text")
        session_id = p.opt_id("session_id")
        p.done()
        try:
            server.faults.send_raw(text, session_id)
        except LookupError:
            raise Problem(409, "NO_SESSION", "no connected session to send to") from None
        return 200, {"sent": True}


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


def _states(p: Params, name: str, *, required: bool) -> frozenset[TaskState] | None:
    names = p.opt_list(name, pattern=re.compile(r"[A-Z_]{1,32}"), what="task states")
    if names is None:
        if required:
            raise bad(f"parameter '{name}' is required (comma-separated task states)")
        return None
    if not names or any(n not in TaskState.__members__ for n in names):
        raise bad(
            f"parameter '{name}' must list task states among "
            + ", ".join(s.value for s in TaskState)
        )
    return frozenset(TaskState(n) for n in names)


def _enqueue_args(server: MockOrbitServer, p: Params) -> tuple[str, Any, dict[str, Any]]:
    """``(handler, payload, options)`` of one enqueue request; the options are
    ``MockOrbitServer.enqueue``'s keywords (only those given)."""
    handler = p.text("handler")
    if not p.given("payload"):
        raise p.bad("parameter 'payload' is required (JSON, not null)")
    payload = p.opt_json("payload")
    if payload is None:
        raise p.bad("parameter 'payload' must be JSON other than null")
    options: dict[str, Any] = {}
    for name in ENQUEUE_OPTIONS:
        value = _OPTION_PARSERS[name](server, p, name)
        if value is not None:
            options[name] = value
    p.done()
    return handler, payload, options


def _safety(server: MockOrbitServer, p: Params, name: str) -> RetrySafety | None:
    safety = p.opt_text(name)
    if safety is None:
        return None
    if safety not in RetrySafety.__members__:
        raise p.bad(f"parameter '{name}' must be IDEMPOTENT or RECONCILE_ONLY")
    return RetrySafety(safety)


#: How each enqueue option is read: one entry per name of ``EnqueueOptions``.
_OPTION_PARSERS: dict[str, Callable[[MockOrbitServer, Params, str], Any]] = {
    "handler_version": lambda s, p, n: p.opt_text(n),
    "payload_version": lambda s, p, n: p.opt_text(n),
    "queue_id": lambda s, p, n: _queue_param(s, p.opt_text(n)),
    "max_attempts": lambda s, p, n: p.opt_int(n, 1, 1000),
    "backoff_initial": lambda s, p, n: p.opt_seconds(n),
    "backoff_max": lambda s, p, n: p.opt_seconds(n),
    "retry_safety": _safety,
    "deadline": lambda s, p, n: p.opt_moment(n),
    "latest_start": lambda s, p, n: p.opt_moment(n),
    "attempt_time_limit": lambda s, p, n: p.opt_seconds(n, positive=True),
}
assert tuple(_OPTION_PARSERS) == ENQUEUE_OPTIONS, "one parser per enqueue option"
_ENQUEUE_NAMES = ("handler", "payload", *ENQUEUE_OPTIONS)


def _queue_param(server: MockOrbitServer, value: str | None) -> str | None:
    if value is None:
        return None
    if value == "default":
        return server.queue_id
    if not ID_RE.fullmatch(value):
        raise bad("a queue id must be 32 lowercase hex characters or 'default'")
    return value


def _concurrency_param(p: Params, *, required: bool) -> int | None:
    """An integer >= 1, or no limit (``none`` in a query, ``null`` in a JSON body)."""
    name = "max_concurrency"
    if not p.given(name):
        if required:
            raise p.bad(f"parameter '{name}' is required (an integer >= 1, or none)")
        return None
    if p.means_none(name):
        return None
    return p.opt_int(name, 1, 10**6)


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
        raise Problem(503, "UNAVAILABLE", "the server is stopping")
    return True


def _stopping(server: MockOrbitServer) -> bool:
    # stop() sets this and notifies the condition wait_until waits on: the wake-up needed here.
    return server.stopping
