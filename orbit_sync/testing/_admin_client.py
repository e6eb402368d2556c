"""``AdminClient``: the mock server's admin API from another process, over ``http.client`` only.

It imports neither websockets nor the server, so a script or a worker's test suite can drive a
mock server running elsewhere with only the SDK installed.
"""

from __future__ import annotations

import datetime as _dt
import enum
import http.client
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .. import _json
from .._codec import format_time
from ..errors import FrameError

__all__ = [
    "ADMIN_PREFIX",
    "DEFAULT_TASK_PAGE",
    "MAX_TASK_PAGE",
    "MAX_WAIT",
    "AdminClient",
    "AdminError",
    "admin_url",
]

#: Every endpoint lives under this path.
ADMIN_PREFIX = "/admin/v1"
#: The longest a ``wait`` request may block (the server caps longer ones).
MAX_WAIT = 30.0
#: Tasks per ``GET /tasks`` page: by default, and at most.
DEFAULT_TASK_PAGE = 1000
MAX_TASK_PAGE = 10_000
#: The largest answer :class:`AdminClient` reads by default: ``GET /tasks`` of 100,000 tasks.
MAX_ANSWER_BYTES = 256 * 1024 * 1024


class AdminError(Exception):
    """A non-2xx answer of the admin API: ``status``, ``code`` and the server's ``message``;
    or (code ``BAD_ANSWER``) an answer that is not the JSON object the API promises."""

    # Where users import it from: tracebacks then print orbit_sync.testing.AdminError.
    __module__ = "orbit_sync.testing"

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

    Each call returns the answer's JSON, or raises :class:`AdminError` for a non-2xx answer:
    :meth:`get` and :meth:`post` the whole answer object; :meth:`enqueue` the task id;
    :meth:`enqueue_many` the ids in order; :meth:`task`, :meth:`cancel` and :meth:`wait` one task
    snapshot (a dict: ``task_id``, ``state``, ``attempts``, ``result``, ...); :meth:`tasks` a list
    of them and :meth:`iter_tasks` an iterator.

    *url* is the server's URL (``ws://127.0.0.1:PORT``) or the admin base URL. ``GET``
    parameters travel in the query string; ``POST`` parameters as a JSON body, so values keep
    their JSON types (a task ``payload`` is any JSON value other than null). Answers larger than
    *max_answer_bytes*, or not a JSON object, raise :class:`AdminError` (``BAD_ANSWER``).
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout: float = MAX_WAIT + 5.0,
        ssl_context: Any = None,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        base = url if url.rstrip("/").endswith(ADMIN_PREFIX) else admin_url(url)
        parts = urllib.parse.urlsplit(base)
        if parts.hostname is None:
            raise ValueError("the admin URL needs a host")
        if type(max_answer_bytes) is not int or max_answer_bytes < 1:
            raise ValueError("max_answer_bytes must be an int >= 1")
        self._secure = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._secure else 80)
        self._prefix = parts.path.rstrip("/")
        self._token = token
        self._timeout = timeout
        self._ssl = ssl_context
        self._limit = max_answer_bytes
        self.url = base.rstrip("/")

    def __repr__(self) -> str:
        return f"AdminClient({self.url!r}, token=<redacted>)"

    def request(
        self,
        method: str,
        path: str,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        json: Mapping[str, Any] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Send one request (*params* in the query, *json* as the body); return
        ``(status, parsed JSON)`` whatever the status. Raises :class:`AdminError`
        (``BAD_ANSWER``) when the answer is too large or not a JSON object."""
        query = urllib.parse.urlencode(
            {k: _param_text(v) for k, v in (params or {}).items() if v is not None}
        )
        target = self._prefix + path + (f"?{query}" if query else "")
        sent = {"Authorization": f"Bearer {self._token}", **(headers or {})}
        body = None
        if json is not None:
            body = _json.dumps({k: _json_value(v) for k, v in json.items()}).encode("utf-8")
            sent["Content-Type"] = "application/json"
        conn: http.client.HTTPConnection
        if self._secure:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        try:
            conn.request(method, target, body=body, headers=sent)
            response = conn.getresponse()
            status = response.status
            data = self._read(response)
        finally:
            conn.close()
        try:
            parsed = _json.loads(data, limit=self._limit)
        except FrameError:
            raise AdminError(status, "BAD_ANSWER", "the answer is not strict JSON") from None
        if not isinstance(parsed, dict):
            raise AdminError(status, "BAD_ANSWER", "the answer is not a JSON object")
        return status, parsed

    def _read(self, response: http.client.HTTPResponse) -> bytes:
        declared = response.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > self._limit:
            raise AdminError(
                response.status, "BAD_ANSWER", f"the answer is over {self._limit} bytes"
            )
        data = response.read(self._limit + 1)
        if len(data) > self._limit:
            raise AdminError(
                response.status, "BAD_ANSWER", f"the answer is over {self._limit} bytes"
            )
        return data

    def call(
        self, method: str, path: str, *, json: Mapping[str, Any] | None = None, **params: Any
    ) -> dict[str, Any]:
        """Send one request; return the JSON answer, or raise :class:`AdminError`."""
        status, body = self.request(method, path, params, json=json)
        if not 200 <= status < 300:
            error = body.get("error")
            if not isinstance(error, dict):
                raise AdminError(status, "BAD_ANSWER", "an error answer without an error object")
            raise AdminError(status, str(error.get("code", "")), str(error.get("message", "")))
        return body

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        """``GET {admin url}{path}?params``."""
        return self.call("GET", path, **params)

    def post(self, path: str, **params: Any) -> dict[str, Any]:
        """``POST {admin url}{path}`` with *params* as a JSON object body."""
        return self.call("POST", path, json=params)

    def enqueue(self, handler: str, payload: Any, **options: Any) -> str:
        """Enqueue a task; returns its id. *options*: those of ``MockOrbitServer.enqueue``."""
        body = self.post("/tasks", handler=handler, payload=payload, **options)
        return str(body["task_id"])

    def enqueue_many(self, tasks: Iterable[Mapping[str, Any]]) -> list[str]:
        """Enqueue many tasks in one request (all or none); each a mapping with ``handler``,
        ``payload`` and any ``enqueue`` options. Returns their ids, in order."""
        items = [{k: _json_value(v) for k, v in task.items()} for task in tasks]
        body = self.call("POST", "/tasks/bulk", json={"tasks": items})
        return [str(task_id) for task_id in body["task_ids"]]

    def iter_tasks(
        self,
        *,
        state: Iterable[str] | None = None,
        queue_id: str | None = None,
        handler: str | None = None,
        page_size: int = MAX_TASK_PAGE,
    ) -> Iterator[dict[str, Any]]:
        """Every task snapshot that matches, in enqueue order, one ``GET /tasks`` page of
        *page_size* at a time (a task enqueued meanwhile shows up on a later page)."""
        if type(page_size) is not int or not 1 <= page_size <= MAX_TASK_PAGE:
            raise ValueError(f"page_size must be an int from 1 to {MAX_TASK_PAGE}")
        filters: dict[str, Any] = {"limit": page_size}
        if state is not None:
            filters["state"] = [state] if isinstance(state, str) else list(state)
        if queue_id is not None:
            filters["queue_id"] = queue_id
        if handler is not None:
            filters["handler"] = handler
        after = 0
        while True:
            page = self.get("/tasks", after=after, **filters)
            yield from page["tasks"]
            if page.get("next") is None:
                return
            after = int(page["next"])

    def tasks(self, **filters: Any) -> list[dict[str, Any]]:
        """Every task snapshot that matches (:meth:`iter_tasks`, all pages), as a list."""
        return list(self.iter_tasks(**filters))

    def task(self, task_id: str) -> dict[str, Any]:
        """One task snapshot, as JSON."""
        return dict(self.get(f"/tasks/{task_id}")["task"])

    def cancel(self, task_id: str) -> dict[str, Any]:
        """Request the task's cancellation (``POST /tasks/{id}/cancel``); returns its snapshot
        right after the request: a waiting task is ``CANCELLED`` at once, a running one keeps
        running until its handler stops (wait for ``CANCELLED``)."""
        return dict(self.post(f"/tasks/{task_id}/cancel")["task"])

    def wait(self, task_id: str, states: Iterable[str], timeout: float = 10.0) -> dict[str, Any]:
        """Block until the task is in one of *states* (task states: ``SUCCEEDED``, ``FAILED``,
        ``CANCELLED``, ``NEEDS_REVIEW``, ...; ``UNKNOWN`` is an attempt outcome, refused with a
        400); returns the task's snapshot; raises TimeoutError if it is not there in time."""
        body = self.get(f"/tasks/{task_id}/wait", states=list(states), timeout=timeout)
        if not body["reached"]:
            raise TimeoutError(f"task {task_id} is {body['task']['state']} after {timeout} s")
        return dict(body["task"])


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, _dt.datetime):
        return format_time(value)
    if isinstance(value, tuple | set | frozenset):
        return [_json_value(v) for v in value]
    return value


def _param_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        # str(1e-07) is "1e-07": the query form takes plain decimals only.
        return f"{value:.9f}".rstrip("0").rstrip(".")
    if isinstance(value, int | str):
        return str(value)
    if isinstance(value, _dt.datetime):
        return format_time(value)
    if isinstance(value, list | tuple | set | frozenset):
        return ",".join(str(v.value if isinstance(v, enum.Enum) else v) for v in value)
    raise TypeError(f"cannot send a {type(value).__name__} as a query parameter")
