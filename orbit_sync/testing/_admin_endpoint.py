"""What every admin endpoint shares: its signature, the JSON form of what it answers, the queue
argument, and waits that end when the server stops.

The endpoints live by subject in :mod:`._admin_tasks`, :mod:`._admin_control` and
:mod:`._admin_faults`; :class:`~._admin_routes.AdminAPI` routes to them.
"""

from __future__ import annotations

import datetime as _dt
import enum
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from .._codec import format_time
from ..models import ID_RE
from ._admin_query import Params, Problem, bad
from ._http import HttpRequest

if TYPE_CHECKING:
    import re

    from ._server import MockOrbitServer

__all__ = ["Answer", "Endpoint", "Route", "jsonable", "queue_param", "wait_on"]

#: An endpoint's answer: its status and its JSON object.
Answer = tuple[int, dict[str, Any]]
#: An endpoint: the server, the request's arguments, its path's match, the request itself.
Route = Callable[["MockOrbitServer", Params, "re.Match[str]", HttpRequest], Answer]
#: (method, path pattern under the admin prefix, route, the argument names it takes).
Endpoint = tuple[str, str, Route, str | tuple[str, ...]]


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


def queue_param(server: MockOrbitServer, value: str | None) -> str | None:
    """A queue argument: its id, ``default`` for the default queue, or ``None`` when not given."""
    if value is None:
        return None
    if value == "default":
        return server.queue_id
    if not ID_RE.fullmatch(value):
        raise bad("a queue id must be 32 lowercase hex characters or 'default'")
    return value


def wait_on(server: MockOrbitServer, condition: Callable[[], bool], timeout: float) -> bool:
    """Block on the server's own change notifications until *condition* holds.

    The wait runs on the connection's handshake thread, which ``server.stop()`` joins, so it also
    ends as soon as the server starts stopping."""

    def predicate(s: MockOrbitServer) -> bool:
        # stop() sets `stopping` and notifies the condition wait_until waits on.
        return condition() or s.stopping

    try:
        server.wait_until(predicate, timeout)
    except TimeoutError:
        return False
    if server.stopping and not condition():
        raise Problem(503, "UNAVAILABLE", "the server is stopping")
    return True
