"""The admin API's task endpoints: list a page, enqueue one or many, get, cancel, wait.

An enqueue's arguments are :meth:`MockOrbitServer.enqueue`'s (``handler``, ``payload`` and the
enqueue options), read by one parser per option; a bulk enqueue reads each task the same way
and stores all of them or none.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..models import TaskState
from ._admin_client import DEFAULT_TASK_PAGE, MAX_TASK_PAGE, MAX_WAIT
from ._admin_endpoint import Answer, Endpoint, jsonable, queue_param, wait_on
from ._admin_query import Params, bad
from ._http import HttpRequest
from ._options import ENQUEUE_OPTIONS
from ._snapshots import RetrySafety

if TYPE_CHECKING:
    from ._server import MockOrbitServer

__all__ = ["ENDPOINTS"]

#: Tasks per bulk enqueue.
MAX_BULK = 100_000


def _list_tasks(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
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


def _enqueue(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    handler, payload, options = _enqueue_args(server, p)
    task_id = server.enqueue(handler, payload, **options)
    return 201, {"task_id": task_id, "task": jsonable(server.task(task_id))}


def _enqueue_bulk(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
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


def _get_task(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    p.done()
    return 200, {"task": jsonable(server.task(m.group(1)))}


def _cancel_task(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    p.done()
    server.request_cancel(m.group(1))
    return 200, {"task": jsonable(server.task(m.group(1)))}


def _wait_task(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    states = _states(p, "states", required=True)
    assert states is not None
    timeout = p.opt_seconds("timeout", high=MAX_WAIT)
    p.done()
    task_id = m.group(1)
    server.task(task_id)  # 404 before blocking
    reached = wait_on(
        server,
        lambda: server.task(task_id).state in states,
        10.0 if timeout is None else timeout,
    )
    return 200, {"reached": reached, "task": jsonable(server.task(task_id))}


#: Names of an attempt (its outcome or state) that are not task states, and the task state
#: each leads to: what a caller who asked for one should wait for instead.
_ATTEMPT_ONLY = {
    "UNKNOWN": "an attempt outcome, not a task state: a task whose attempt ends UNKNOWN ends in "
    "NEEDS_REVIEW (or goes back to WAITING for a retry under an IDEMPOTENT retry policy)",
    "EXPIRED": "an attempt state, not a task state: an attempt whose lease expired after it "
    "started makes its task NEEDS_REVIEW (or WAITING for a retry under an IDEMPOTENT retry "
    "policy)",
}


def _states(p: Params, name: str, *, required: bool) -> frozenset[TaskState] | None:
    names = p.opt_list(name, pattern=re.compile(r"[A-Z_]{1,32}"), what="task states")
    if names is None:
        if required:
            raise bad(f"parameter '{name}' is required (comma-separated task states)")
        return None
    among = ", ".join(s.value for s in TaskState)
    for n in names or ():
        if n in _ATTEMPT_ONLY:
            raise bad(f"parameter '{name}': {n} is {_ATTEMPT_ONLY[n]}; task states are {among}")
    if not names or any(n not in TaskState.__members__ for n in names):
        raise bad(f"parameter '{name}' must list task states among {among}")
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
    "queue_id": lambda s, p, n: queue_param(s, p.opt_text(n)),
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


_HEXID = r"([0-9a-f]{32})"
ENDPOINTS: tuple[Endpoint, ...] = (
    ("GET", r"/tasks", _list_tasks, "state queue_id handler after limit"),
    ("POST", r"/tasks", _enqueue, _ENQUEUE_NAMES),
    ("POST", r"/tasks/bulk", _enqueue_bulk, "tasks"),
    ("GET", rf"/tasks/{_HEXID}", _get_task, ""),
    ("POST", rf"/tasks/{_HEXID}/cancel", _cancel_task, ""),
    ("GET", rf"/tasks/{_HEXID}/wait", _wait_task, "states timeout"),
)
