"""The admin API's endpoints for the server as a whole: its settings and time, queues, worker
tokens, sessions, the event log and the invariants."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .._codec import format_time
from ._admin_endpoint import Answer, Endpoint, jsonable, queue_param
from ._admin_query import Params, bad
from ._clock import ManualClock
from ._http import HttpRequest
from ._state import SCOPE_CONNECT, SCOPE_CONSUME, InvariantError, queue_scope

if TYPE_CHECKING:
    from ._server import MockOrbitServer

__all__ = ["ENDPOINTS"]


def _server_info(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
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


def _clock(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    p.done()
    return 200, {"now": format_time(server.now())}


def _advance(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    seconds = p.opt_seconds("seconds")
    p.done()
    if seconds is None:
        raise bad("parameter 'seconds' is required")
    server.advance(seconds)
    return 200, {"now": format_time(server.now())}


def _add_queue(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    limit = _concurrency_param(p, required=False)
    paused = p.opt_bool("paused")
    p.done()
    queue_id = server.add_queue(max_concurrency=limit, paused=bool(paused))
    return 201, {"queue_id": queue_id}


def _pause_resume(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    p.done()
    queue_id = queue_param(server, m.group(1))
    if m.group(2) == "pause":
        server.pause_queue(queue_id)
    else:
        server.resume_queue(queue_id)
    return 200, {"queue_id": queue_id, "paused": m.group(2) == "pause"}


def _concurrency(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    limit = _concurrency_param(p, required=True)
    p.done()
    queue_id = queue_param(server, m.group(1))
    server.set_max_concurrency(limit, queue_id)
    return 200, {"queue_id": queue_id, "max_concurrency": limit}


def _add_token(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    scopes = p.opt_list("scopes", pattern=re.compile(r"[\x21-\x2b\x2d-\x7e]{1,200}"), what="scopes")
    queue_id = queue_param(server, p.opt_text("queue_id"))
    p.done()
    if scopes is not None and queue_id is not None:
        raise bad("give either 'scopes' or 'queue_id', not both")
    if scopes is None:
        qid = server.queue_id if queue_id is None else queue_id
        scopes = [SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(qid)]
    token = server.add_token(scopes)
    # The token is the answer's purpose: the caller administers this test server.
    return 201, {"token": token, "scopes": sorted(set(scopes))}


def _revoke_token(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    p.done()
    # In a header, never the URL: credentials do not belong in request lines or access logs.
    values = r.headers.get_all("Orbit-Worker-Token")
    if len(values) != 1 or not values[0]:
        raise bad("header 'Orbit-Worker-Token' must carry the worker token to revoke")
    server.revoke_token(values[0])
    return 200, {"revoked": True}


def _sessions(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    p.done()
    return 200, {"sessions": jsonable(server.sessions())}


def _disconnect(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    session_id = p.opt_id("session_id")
    p.done()
    return 200, {"disconnected": server.disconnect(session_id)}


def _events(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
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


def _invariants(server: MockOrbitServer, p: Params, m: re.Match[str], r: HttpRequest) -> Answer:
    p.done()
    try:
        server.check_invariants()
    except InvariantError as exc:
        return 200, {"ok": False, "problems": list(exc.problems)}
    return 200, {"ok": True, "problems": []}


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


_QUEUE = r"([0-9a-f]{32}|default)"
ENDPOINTS: tuple[Endpoint, ...] = (
    ("GET", r"/server", _server_info, ""),
    ("GET", r"/clock", _clock, ""),
    ("POST", r"/clock/advance", _advance, "seconds"),
    ("POST", r"/queues", _add_queue, "max_concurrency paused"),
    ("POST", rf"/queues/{_QUEUE}/(pause|resume)", _pause_resume, ""),
    ("POST", rf"/queues/{_QUEUE}/concurrency", _concurrency, "max_concurrency"),
    ("POST", r"/tokens", _add_token, "scopes queue_id"),
    ("POST", r"/tokens/revoke", _revoke_token, ""),
    ("GET", r"/sessions", _sessions, ""),
    ("POST", r"/disconnect", _disconnect, "session_id"),
    ("GET", r"/events", _events, "since limit"),
    ("GET", r"/invariants", _invariants, ""),
)
