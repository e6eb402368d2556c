"""The mock server's JSON admin API, over real loopback HTTP (http.client against a real server)."""

from __future__ import annotations

import http.client
import json
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from _independent import parse_time

from orbit_sync import HTTPError
from orbit_sync.client import Client
from orbit_sync.models import Capability, CapacityReport, Registration, new_id, new_secret
from orbit_sync.testing import AdminAPI, AdminClient, AdminError, ManualClock, MockOrbitServer

#: The documented admin body bounds (docs/mock-server.md): one body, and those announced together.
MAX_ADMIN_BODY = 16 * 1024 * 1024
ADMIN_BODY_BUDGET = 32 * 1024 * 1024
ADMIN_TOKEN = "admin-token-for-tests-0123456789"
MARKER = "s3cr3t-marker-never-echoed"


class Admin:
    """A server with an admin API, and raw HTTP calls against it."""

    def __init__(self, server: MockOrbitServer, api: AdminAPI) -> None:
        self.server = server
        self.api = api
        self.port = int(server.url.rsplit(":", 1)[1])

    def raw(
        self,
        method: str,
        target: str,
        *,
        token: str | None = ADMIN_TOKEN,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> tuple[int, http.client.HTTPResponse, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            hdrs = {} if token is None else {"Authorization": f"Bearer {token}"}
            hdrs.update(headers or {})
            conn.request(method, target, body=body, headers=hdrs)
            response = conn.getresponse()
            return response.status, response, response.read()
        finally:
            conn.close()

    def call(
        self, method: str, path: str, params: dict[str, str] | None = None, **kw: Any
    ) -> tuple[int, dict[str, Any]]:
        query = ("?" + urllib.parse.urlencode(params)) if params else ""
        status, _, data = self.raw(method, "/admin/v1" + path + query, **kw)
        return status, json.loads(data)


@pytest.fixture
def admin() -> Iterator[Admin]:
    """A started server on a manual clock with an AdminAPI holding a known token."""
    api = AdminAPI(ADMIN_TOKEN)
    with MockOrbitServer(clock=ManualClock(), admin_handler=api, assignment_rate=None) as server:
        yield Admin(server, api)


def registration(queue_id: str) -> Registration:
    """A fresh worker identity for one dial."""
    return Registration(
        queue_id=queue_id,
        capabilities=[Capability("resize", "1", "1")],
        capacity=1,
        instance_id=new_id(),
        instance_secret=new_secret(),
    )


# --------------------------------------------------------------------------- authentication


def test_requests_without_the_admin_token_get_401(admin: Admin) -> None:
    """No token, a worker token, another scheme or two headers: 401 with a Bearer challenge."""
    for kwargs in (
        {"token": None},
        {"token": admin.server.token},
        {"token": ADMIN_TOKEN + "x"},
        {"token": None, "headers": {"Authorization": f"Basic {ADMIN_TOKEN}"}},
    ):
        status, response, data = admin.raw("GET", "/admin/v1/server", **kwargs)  # type: ignore[arg-type]
        assert status == 401, kwargs.keys()
        assert response.getheader("WWW-Authenticate", "").startswith("Bearer")
        assert json.loads(data)["error"]["code"] == "UNAUTHENTICATED"
        assert ADMIN_TOKEN.encode() not in data and admin.server.token.encode() not in data
    conn = http.client.HTTPConnection("127.0.0.1", admin.port, timeout=10)
    try:
        conn.putrequest("GET", "/admin/v1/server")
        conn.putheader("Authorization", f"Bearer {ADMIN_TOKEN}")
        conn.putheader("Authorization", f"Bearer {ADMIN_TOKEN}")
        conn.endheaders()
        assert conn.getresponse().status == 401
    finally:
        conn.close()


def test_unknown_admin_paths_are_401_before_404(admin: Admin) -> None:
    """Without the token nothing reveals which endpoints exist; with it, unknown ones are 404."""
    assert admin.call("GET", "/nope", token=None)[0] == 401
    status, body = admin.call("GET", "/nope")
    assert status == 404 and body["error"]["code"] == "NOT_FOUND"


def test_admin_token_is_not_a_worker_token(admin: Admin) -> None:
    """The admin token cannot open a worker session (and the worker token still can)."""
    with pytest.raises(HTTPError) as info:
        Client(admin.server.url, ADMIN_TOKEN).dial_worker(registration(admin.server.queue_id))
    assert info.value.status_code == 401
    conn = Client(admin.server.url, admin.server.token).dial_worker(
        registration(admin.server.queue_id)
    )
    conn.close()


def test_admin_api_repr_and_default_token() -> None:
    """The token is readable on purpose but never in repr; by default it is random."""
    api = AdminAPI(ADMIN_TOKEN)
    assert ADMIN_TOKEN not in repr(api) and api.token == ADMIN_TOKEN
    first, second = AdminAPI(), AdminAPI()
    assert first.token != second.token and len(first.token) >= 32
    client = AdminClient("ws://127.0.0.1:1", ADMIN_TOKEN)
    assert ADMIN_TOKEN not in repr(client)
    with pytest.raises(ValueError):
        AdminAPI("has space")
    with pytest.raises(ValueError):
        AdminAPI("")


# --------------------------------------------------------------------------- transport choices


def test_json_body_enqueues_with_typed_values(admin: Admin) -> None:
    """POST /tasks with Content-Type application/json: values keep their JSON types."""
    body = {
        "handler": "resize",
        "payload": {"w": 10, "name": "żółw"},
        "max_attempts": 5,
        "backoff_initial": 0.25,
        "retry_safety": "IDEMPOTENT",
        "deadline": 60,
        "attempt_time_limit": None,
    }
    status, _, data = admin.raw(
        "POST",
        "/admin/v1/tasks",
        headers={"Content-Type": "application/json; charset=utf-8"},
        body=json.dumps(body).encode(),
    )
    assert status == 201, data
    snap = admin.server.task(json.loads(data)["task_id"])
    assert snap.payload == {"w": 10, "name": "żółw"} and snap.policy.max_attempts == 5
    assert snap.policy.backoff_initial == 0.25 and snap.policy.retry_safety.value == "IDEMPOTENT"
    assert snap.policy.deadline is not None and snap.policy.attempt_time_limit is None


def test_form_body_is_the_query_form(admin: Admin) -> None:
    """curl -d's default form encoding is read as the query string would be."""
    status, _, data = admin.raw(
        "POST",
        "/admin/v1/tasks",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        body=urllib.parse.urlencode({"handler": "resize", "payload": "[1]"}).encode(),
    )
    assert status == 201 and admin.server.task(json.loads(data)["task_id"]).payload == [1]


@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ({"Content-Type": "text/plain"}, b"handler=resize", 415, "UNSUPPORTED_MEDIA_TYPE"),
        ({}, b'{"handler": "resize", "payload": 1}', 415, "UNSUPPORTED_MEDIA_TYPE"),
        ({"Content-Type": "application/json"}, b'{"handler": "resize"', 400, "INVALID_ARGUMENT"),
        ({"Content-Type": "application/json"}, b"[1, 2]", 400, "INVALID_ARGUMENT"),
        (
            {"Content-Type": "application/json"},
            b'{"handler": "resize", "payload": 1, "max_attempts": "5"}',
            400,
            "INVALID_ARGUMENT",
        ),
        (
            {"Content-Type": "application/json"},
            f'{{"handler": "resize", "payload": 1, "{MARKER}": 1}}'.encode(),
            400,
            "INVALID_ARGUMENT",
        ),
    ],
)
def test_bad_bodies_get_json_errors(
    admin: Admin, headers: dict[str, str], body: bytes, status: int, code: str
) -> None:
    """A body the API cannot use is a JSON error with a status, never a dropped connection."""
    got, response, data = admin.raw("POST", "/admin/v1/tasks", headers=headers, body=body)
    assert got == status and response.getheader("Content-Type") == "application/json"
    assert json.loads(data)["error"]["code"] == code and MARKER.encode() not in data
    assert admin.server.tasks() == ()


def _raw_exchange(admin: Admin, head: bytes, then: bytes = b"") -> bytes:
    """Send a hand-written request head (and *then*), return everything the server answers."""
    with socket.create_connection(("127.0.0.1", admin.port), timeout=10) as sock:
        sock.sendall(head)
        if then:
            assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            sock.sendall(then)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_oversized_and_chunked_bodies_are_refused_before_reading(admin: Admin) -> None:
    """A Content-Length over the limit is 413 and a transfer coding 411, both JSON."""
    auth = f"Authorization: Bearer {ADMIN_TOKEN}\r\n".encode()
    answer = _raw_exchange(
        admin,
        b"POST /admin/v1/tasks HTTP/1.1\r\nHost: x\r\n"
        + auth
        + b"Content-Type: application/json\r\nContent-Length: 999999999\r\n\r\n{",
    )
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"TOO_LARGE"' in answer
    answer = _raw_exchange(
        admin,
        b"POST /admin/v1/tasks HTTP/1.1\r\nHost: x\r\n"
        + auth
        + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n0\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 411 ") and b'"LENGTH_REQUIRED"' in answer


def _head(token: str | None, length: int) -> bytes:
    auth = "" if token is None else f"Authorization: Bearer {token}\r\n"
    return (
        f"POST /admin/v1/tasks HTTP/1.1\r\nHost: x\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["missing", "wrong"])
def test_token_is_checked_before_any_body_byte(admin: Admin, token: str | None) -> None:
    """A request without the admin token gets its 401 at once, on its head alone: its announced
    body is never waited for (nor held)."""
    with socket.create_connection(("127.0.0.1", admin.port), timeout=5) as sock:
        sock.sendall(_head(token, 1024 * 1024))  # and no body: the answer must not wait for it
        assert sock.recv(1024).startswith(b"HTTP/1.1 401 ")


def test_unauthenticated_slow_bodies_do_not_hold_up_admin_calls(admin: Admin) -> None:
    """As many unauthenticated requests as the admin limit, each announcing a large body it
    never sends, leave authenticated calls answered."""
    socks = [socket.create_connection(("127.0.0.1", admin.port), timeout=5) for _ in range(16)]
    try:
        for sock in socks:
            sock.sendall(_head(None, 16 * 1024 * 1024 - 1))
        for sock in socks:  # each refused at once
            assert sock.recv(1024).startswith(b"HTTP/1.1 401 ")
        assert admin.call("GET", "/server")[0] == 200
    finally:
        for sock in socks:
            sock.close()


def test_bodies_held_at_once_are_bounded(admin: Admin) -> None:
    """Authenticated requests whose announced bodies together pass the budget: the one over it
    is told to retry (503) before a byte of its body is read."""
    held = [socket.create_connection(("127.0.0.1", admin.port), timeout=10) for _ in range(2)]
    try:
        for sock in held:
            sock.sendall(_head(ADMIN_TOKEN, MAX_ADMIN_BODY))
        admin.server.wait_until(lambda s: s.admin_body_bytes == ADMIN_BODY_BUDGET, timeout=10)
        with socket.create_connection(("127.0.0.1", admin.port), timeout=5) as sock:
            sock.sendall(_head(ADMIN_TOKEN, 10))
            answer = sock.recv(1024)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer
    finally:
        for sock in held:
            sock.close()


def test_expect_100_continue_is_answered(admin: Admin) -> None:
    """A client that sends Expect: 100-continue (curl, for bodies over 1 KiB) gets its 100."""
    body = json.dumps({"handler": "resize", "payload": {"pad": "x" * 2000}}).encode()
    head = (
        "POST /admin/v1/tasks HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    answer = _raw_exchange(admin, head, then=body)
    assert answer.startswith(b"HTTP/1.1 201 ")
    assert len(admin.server.tasks()) == 1


def test_wrong_method_is_405_with_allow(admin: Admin) -> None:
    """A known path with another method answers 405 and lists the allowed ones."""
    status, response, data = admin.raw("DELETE", "/admin/v1/tasks")
    assert status == 405
    assert response.getheader("Allow") == "GET, POST"
    assert json.loads(data)["error"]["code"] == "METHOD_NOT_ALLOWED"
    status, response, _ = admin.raw("GET", "/admin/v1/clock/advance")
    assert status == 405 and response.getheader("Allow") == "POST"


def test_answers_are_json_and_not_cached(admin: Admin) -> None:
    """Every answer is a JSON object with its length, no-store, and closes the connection."""
    status, response, data = admin.raw("GET", "/admin/v1/server")
    assert status == 200
    assert response.getheader("Content-Type") == "application/json"
    assert response.getheader("Cache-Control") == "no-store"
    assert int(response.getheader("Content-Length", "-1")) == len(data)
    body = json.loads(data)
    assert body["url"] == admin.server.url
    assert body["queue_id"] == admin.server.queue_id
    assert body["manual_clock"] is True
    assert parse_time(body["now"]) == admin.server.now()


# --------------------------------------------------------------------------- validation


def test_payload_must_be_strict_json_and_is_never_echoed(admin: Admin) -> None:
    """Duplicate keys, NaN, null or a missing payload are 400s that do not repeat the input."""
    for payload in (
        f'{{"k": "{MARKER}", "k": 1}}',
        f'{{"k": NaN, "m": "{MARKER}"}}',
        f'["{MARKER}"',
        "null",
    ):
        status, _, data = admin.raw(
            "POST",
            "/admin/v1/tasks?" + urllib.parse.urlencode({"handler": "resize", "payload": payload}),
        )
        assert status == 400, payload
        assert json.loads(data)["error"]["code"] == "INVALID_ARGUMENT"
        assert MARKER.encode() not in data
    status, body = admin.call("POST", "/tasks", {"handler": "resize"})
    assert status == 400 and "'payload' is required" in body["error"]["message"]
    assert admin.server.tasks() == ()


def test_malformed_queries_are_400_without_echo(admin: Admin) -> None:
    """Bad encoding, bare names, repeats and unknown names are refused; values never echoed."""
    cases = [
        f"handler=resize&payload=1&x{MARKER}",  # a field without '='
        "handler=resize&payload=%ff",  # not UTF-8
        "handler=resize&handler=other&payload=1",
        f"handler=resize&payload=1&tokn={MARKER}",
        f"handler=resize&payload=1&{MARKER.upper()}=1",
    ]
    for query in cases:
        status, _, data = admin.raw("POST", "/admin/v1/tasks?" + query)
        assert status == 400, query
        assert MARKER.encode() not in data and MARKER.upper().encode() not in data
    _, body = admin.call("POST", "/tasks", {"handler": "resize", "payload": "1", "tokn": "v"})
    assert body["error"]["message"] == "unknown parameter 'tokn'"
    _, body = admin.call("POST", "/tasks", {"handler": "a", "handler_version": "1", "Zz": "1"})
    assert body["error"]["message"] == "unknown parameter (unprintable name)"
    assert admin.server.tasks() == ()


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"max_attempts": "01"}, "max_attempts"),
        ({"max_attempts": "+1"}, "max_attempts"),
        ({"max_attempts": "1e3"}, "max_attempts"),
        ({"max_attempts": "1001"}, "max_attempts"),
        ({"backoff_initial": "-1"}, "backoff_initial"),
        ({"backoff_initial": "nan"}, "backoff_initial"),
        ({"backoff_initial": "1e3"}, "backoff_initial"),
        ({"attempt_time_limit": "0"}, "attempt_time_limit"),
        ({"retry_safety": "SOMETIMES"}, "retry_safety"),
        ({"deadline": "tomorrow"}, "deadline"),
        ({"deadline": "2026-01-01T00:00:00+01:00"}, "deadline"),
        ({"queue_id": "Q"}, "queue id"),
        ({"handler": "Resize"}, "handler"),
        ({"handler_version": "01"}, "version"),
    ],
)
def test_enqueue_arguments_are_checked(admin: Admin, params: dict[str, str], fragment: str) -> None:
    """Each malformed enqueue argument is a 400 naming what is wrong; nothing is enqueued."""
    query = {"handler": "resize", "payload": "{}", **params}
    status, body = admin.call("POST", "/tasks", query)
    assert status == 400
    assert fragment in body["error"]["message"]
    assert admin.server.tasks() == ()


# --------------------------------------------------------------------------- tasks


def test_enqueue_get_and_list(admin: Admin) -> None:
    """An enqueued task is the server's task, serialized with RFC 3339 times and its policy."""
    status, body = admin.call(
        "POST",
        "/tasks",
        {
            "handler": "resize",
            "payload": json.dumps({"w": 10, "name": "żółw"}),
            "max_attempts": "5",
            "retry_safety": "IDEMPOTENT",
            "backoff_initial": "0.25",
            "deadline": "60",
            "latest_start": "2026-01-01T00:00:30Z",
        },
    )
    assert status == 201
    task_id = body["task_id"]
    snap = admin.server.task(task_id)
    assert snap.payload == {"w": 10, "name": "żółw"}
    assert snap.policy.max_attempts == 5 and snap.policy.retry_safety.value == "IDEMPOTENT"
    assert snap.policy.backoff_initial == 0.25
    task = body["task"]
    assert task["state"] == "WAITING" and task["payload"] == snap.payload
    assert task["policy"]["deadline"] == "2026-01-01T00:01:00Z"
    assert task["policy"]["latest_start"] == "2026-01-01T00:00:30Z"
    assert parse_time(task["created_at"]) == snap.created_at
    assert admin.call("GET", f"/tasks/{task_id}")[1]["task"] == task
    other = admin.server.enqueue("crop", {"x": 1})
    admin.server.request_cancel(other)
    _, listing = admin.call("GET", "/tasks")
    assert [t["task_id"] for t in listing["tasks"]] == [task_id, other] and listing["count"] == 2
    _, waiting = admin.call("GET", "/tasks", {"state": "WAITING"})
    assert [t["task_id"] for t in waiting["tasks"]] == [task_id]
    _, crops = admin.call("GET", "/tasks", {"handler": "crop", "state": "CANCELLED,WAITING"})
    assert [t["task_id"] for t in crops["tasks"]] == [other]
    assert admin.call("GET", "/tasks", {"state": "DONE"})[0] == 400


def test_task_list_pages_with_limit_and_cursor(admin: Admin) -> None:
    """GET /tasks returns one page in enqueue order; "next" resumes it, and is null at the end."""
    ids = [admin.server.enqueue("crop" if n % 3 == 0 else "resize", {"n": n}) for n in range(8)]
    seen: list[str] = []
    cursor: int | None = 0
    pages = 0
    while cursor is not None:
        status, page = admin.call("GET", "/tasks", {"limit": "3", "after": str(cursor)})
        assert status == 200 and page["count"] == len(page["tasks"]) <= 3
        seen += [t["task_id"] for t in page["tasks"]]
        cursor = page["next"]
        pages += 1
    assert seen == ids and pages == 3
    # Filters apply before the page is cut: three crop tasks, two pages of two.
    _, first = admin.call("GET", "/tasks", {"handler": "crop", "limit": "2"})
    _, second = admin.call(
        "GET", "/tasks", {"handler": "crop", "limit": "2", "after": first["next"]}
    )
    assert [t["task_id"] for t in first["tasks"] + second["tasks"]] == ids[0::3]
    assert second["next"] is None
    # Without limit: a default page of 1000 (and everything here).
    _, everything = admin.call("GET", "/tasks")
    assert everything["count"] == 8 and everything["next"] is None
    for bad_params in ({"limit": "0"}, {"limit": "10001"}, {"after": "-1"}, {"after": "x"}):
        status, body = admin.call("GET", "/tasks", bad_params)
        assert status == 400 and body["error"]["code"] == "INVALID_ARGUMENT"


def test_task_cursor_survives_forgotten_tasks() -> None:
    """A cursor is a position in enqueue order: tasks forgotten between pages do not break it."""
    api = AdminAPI(ADMIN_TOKEN)
    with MockOrbitServer(clock=ManualClock(), admin_handler=api, retention=5) as server:
        ids = [server.enqueue("resize", {"n": n}) for n in range(6)]
        client = AdminClient(server.url, ADMIN_TOKEN)
        first = client.get("/tasks", limit=2)
        assert [t["task_id"] for t in first["tasks"]] == ids[:2]
        for task_id in ids[:4]:  # the page's last task and the next one end and are forgotten
            server.request_cancel(task_id)
        server.advance(5)
        rest = client.get("/tasks", limit=2, after=first["next"])
        assert [t["task_id"] for t in rest["tasks"]] == ids[4:] and rest["next"] is None


def test_admin_client_iterates_every_page(admin: Admin) -> None:
    """AdminClient.tasks() follows the cursors through every page, filters kept."""
    ids = [admin.server.enqueue("crop" if n % 2 else "resize", {"n": n}) for n in range(25)]
    client = AdminClient(admin.server.url, ADMIN_TOKEN)
    assert [t["task_id"] for t in client.tasks(page_size=4)] == ids
    crops = client.iter_tasks(handler="crop", state=["WAITING"], page_size=5)
    assert [t["task_id"] for t in crops] == ids[1::2]
    assert client.tasks(state="SUCCEEDED") == []
    with pytest.raises(ValueError, match="page_size"):
        client.tasks(page_size=0)


def test_unknown_task_is_404(admin: Admin) -> None:
    """A well-formed but unknown id is 404 on get, cancel and wait."""
    missing = new_id()
    for method, path in (("GET", ""), ("POST", "/cancel"), ("GET", "/wait?states=WAITING")):
        status, _, data = admin.raw(method, f"/admin/v1/tasks/{missing}{path}")
        assert status == 404, path
        assert json.loads(data)["error"]["code"] == "NOT_FOUND"


def test_cancel_through_the_api(admin: Admin) -> None:
    """POST /tasks/{id}/cancel stores the cancel request on the server's task."""
    task_id = admin.server.enqueue("resize", {"w": 1})
    status, body = admin.call("POST", f"/tasks/{task_id}/cancel")
    assert status == 200 and body["task"]["state"] == "CANCELLED"
    snap = admin.server.task(task_id)
    assert snap.state.value == "CANCELLED"
    assert parse_time(body["task"]["cancel_requested_at"]) == snap.cancel_requested_at


def test_wait_reports_whether_the_state_was_reached(admin: Admin) -> None:
    """wait returns reached=false after its timeout, and reached=true once the state holds."""
    task_id = admin.server.enqueue("resize", {"w": 1})
    started = time.monotonic()
    status, body = admin.call(
        "GET", f"/tasks/{task_id}/wait", {"states": "SUCCEEDED", "timeout": "0.2"}
    )
    assert status == 200 and body["reached"] is False and body["task"]["state"] == "WAITING"
    assert time.monotonic() - started >= 0.2
    result: dict[str, Any] = {}

    def waiter() -> None:
        result.update(admin.call("GET", f"/tasks/{task_id}/wait", {"states": "CANCELLED"})[1])

    thread = threading.Thread(target=waiter)
    thread.start()
    admin.server.request_cancel(task_id)
    thread.join(10)
    assert not thread.is_alive()
    assert result["reached"] is True and result["task"]["state"] == "CANCELLED"
    assert admin.call("GET", f"/tasks/{task_id}/wait", {"timeout": "1"})[0] == 400
    assert admin.call("GET", f"/tasks/{task_id}/wait", {"states": "X", "timeout": "31"})[0] == 400


def test_stop_ends_a_blocked_wait(admin: Admin) -> None:
    """A wait in progress does not hold server.stop() for its timeout: it answers 503."""
    entered = threading.Event()

    class Signalling(AdminAPI):
        def handle(self, server: Any, connection: Any, request: Any) -> Any:
            entered.set()
            return super().handle(server, connection, request)

    api = Signalling(ADMIN_TOKEN)
    server = MockOrbitServer(clock=ManualClock(), admin_handler=api).start()
    other = Admin(server, api)
    task_id = server.enqueue("resize", {"w": 1})
    outcome: list[Any] = []

    def waiter() -> None:
        try:
            outcome.append(
                other.call(
                    "GET", f"/tasks/{task_id}/wait", {"states": "SUCCEEDED", "timeout": "25"}
                )
            )
        except (http.client.HTTPException, OSError) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert entered.wait(10)
    started = time.monotonic()
    server.stop()
    thread.join(10)
    assert time.monotonic() - started < 5.0
    assert not thread.is_alive()
    assert outcome and outcome[0][0] == 503 and outcome[0][1]["error"]["code"] == "UNAVAILABLE"


# --------------------------------------------------------------------------- time and queues


def test_advance_moves_server_time_and_runs_due_work(admin: Admin) -> None:
    """POST /clock/advance moves the manual clock and runs what falls due (a deadline here)."""
    task_id = admin.server.enqueue("resize", {"w": 1}, deadline=10.0)
    before = admin.server.now()
    status, body = admin.call("POST", "/clock/advance", {"seconds": "12.5"})
    assert status == 200
    assert (admin.server.now() - before).total_seconds() == 12.5
    assert parse_time(body["now"]) == admin.server.now()
    assert admin.call("GET", "/clock")[1]["now"] == body["now"]
    assert admin.server.task(task_id).state.value == "FAILED"
    assert admin.call("POST", "/clock/advance")[0] == 400
    assert admin.call("POST", "/clock/advance", {"seconds": "-1"})[0] == 400


def test_pause_and_resume_a_queue(admin: Admin) -> None:
    """Pausing stops assignments to a connected worker; resuming lets the task through."""
    assert admin.call("POST", "/queues/default/pause")[1] == {
        "queue_id": admin.server.queue_id,
        "paused": True,
    }
    conn = Client(admin.server.url, admin.server.token).dial_worker(
        registration(admin.server.queue_id)
    )
    try:
        conn.capacity(CapacityReport(sequence=1, capacity=1))
        task_id = admin.server.enqueue("resize", {"w": 1})
        with pytest.raises(TimeoutError):
            conn.next_assignment(timeout=0.3)
        status, body = admin.call("POST", f"/queues/{admin.server.queue_id}/resume")
        assert status == 200 and body["paused"] is False
        assert conn.next_assignment(timeout=5).task.task_id == task_id
    finally:
        conn.close()
    kinds = [e.kind for e in admin.server.events()]
    assert "queue.paused" in kinds and "queue.resumed" in kinds
    assert admin.call("POST", f"/queues/{new_id()}/pause")[0] == 404


def test_new_queue_and_concurrency(admin: Admin) -> None:
    """POST /queues creates a queue; its concurrency can be changed; bad values are 400."""
    status, body = admin.call("POST", "/queues", {"max_concurrency": "2", "paused": "true"})
    assert status == 201
    queue_id = body["queue_id"]
    task_id = admin.call(
        "POST", "/tasks", {"handler": "resize", "payload": "1", "queue_id": queue_id}
    )
    assert task_id[0] == 201 and admin.server.task(task_id[1]["task_id"]).queue_id == queue_id
    assert (
        admin.call("POST", f"/queues/{queue_id}/concurrency", {"max_concurrency": "none"})[0] == 200
    )
    assert admin.call("POST", f"/queues/{queue_id}/concurrency", {"max_concurrency": "0"})[0] == 400
    assert admin.call("POST", "/queues", {"paused": "yes"})[0] == 400


# --------------------------------------------------------------------------- tokens, sessions


def test_tokens_can_be_issued_and_revoked(admin: Admin) -> None:
    """A token from POST /tokens dials; a scope-less one is refused 403; a revoked one 401."""
    status, body = admin.call("POST", "/tokens")
    assert status == 201
    token = body["token"]
    conn = Client(admin.server.url, token).dial_worker(registration(admin.server.queue_id))
    conn.close()
    _, bare = admin.call("POST", "/tokens", {"scopes": ""})
    with pytest.raises(HTTPError) as info:
        Client(admin.server.url, bare["token"]).dial_worker(registration(admin.server.queue_id))
    assert info.value.status_code == 403
    assert admin.call("POST", "/tokens/revoke")[0] == 400
    status, _ = admin.call("POST", "/tokens/revoke", headers={"Orbit-Worker-Token": token})
    assert status == 200
    with pytest.raises(HTTPError) as info:
        Client(admin.server.url, token).dial_worker(registration(admin.server.queue_id))
    assert info.value.status_code == 401
    assert admin.call("POST", "/tokens", {"scopes": "a", "queue_id": "default"})[0] == 400


def test_sessions_disconnect_and_no_secrets(admin: Admin) -> None:
    """Sessions are listed without secrets, and POST /disconnect cuts the connection."""
    reg = registration(admin.server.queue_id)
    conn = Client(admin.server.url, admin.server.token).dial_worker(reg)
    try:
        status, _, data = admin.raw("GET", "/admin/v1/sessions")
        assert status == 200
        (session,) = json.loads(data)["sessions"]
        assert session["session_id"] == conn.session_id and session["connected"] is True
        assert reg.instance_secret.encode() not in data
        assert admin.server.token.encode() not in data
        assert not any("secret" in key or "token" in key for key in session)
        status, body = admin.call("POST", "/disconnect", {"session_id": conn.session_id})
        assert status == 200 and body == {"disconnected": 1}
        assert conn.done.wait(5)
    finally:
        conn.close()


def test_events_are_paged(admin: Admin) -> None:
    """GET /events pages through the event log with since/limit and next."""
    for n in range(3):
        admin.server.enqueue("resize", {"n": n})
    total = len(admin.server.events())
    _, first = admin.call("GET", "/events", {"limit": "2"})
    assert len(first["events"]) == 2 and first["next"] == 2
    _, rest = admin.call("GET", "/events", {"since": str(first["next"])})
    assert first["next"] + len(rest["events"]) == total == rest["next"]
    assert [e["kind"] for e in rest["events"]][-1] == "task.enqueued"
    parse_time(rest["events"][-1]["at"])


def test_events_offsets_survive_the_ring() -> None:
    """Offsets count every event ever recorded: after the ring dropped some, "missed" says how
    many a reader asking from an old offset lost, and "next" goes on from the absolute count."""
    api = AdminAPI(ADMIN_TOKEN)
    with MockOrbitServer(clock=ManualClock(), admin_handler=api, event_log_size=4) as server:
        admin = Admin(server, api)
        for n in range(10):
            server.enqueue("resize", {"n": n})
        log = server.events()
        assert log.dropped > 0
        _, page = admin.call("GET", "/events", {"since": "0"})
        assert page["missed"] == log.dropped and page["next"] == log.dropped + len(log)
        assert [e["detail"] for e in page["events"]] == [e.detail for e in log]
        _, tail = admin.call("GET", "/events", {"since": str(page["next"] - 1)})
        assert tail["missed"] == 0 and len(tail["events"]) == 1


def test_invariants(admin: Admin) -> None:
    """GET /invariants reports ok with no problems on a healthy server."""
    admin.server.enqueue("resize", {"w": 1})
    assert admin.call("GET", "/invariants") == (200, {"ok": True, "problems": []})


# --------------------------------------------------------------------------- faults


def test_faults_armed_through_the_api_fire_and_report(admin: Admin) -> None:
    """A refuse_connections fault armed over HTTP refuses the next dial, and reports firing."""
    status, body = admin.call("POST", "/faults", {"kind": "refuse_connections", "status": "503"})
    assert status == 201 and body["fault"]["id"] == 1 and body["fault"]["armed"] is True
    _, waited = admin.call("GET", "/faults/1/wait", {"timeout": "0.1"})
    assert waited["reached"] is False
    with pytest.raises(HTTPError) as info:
        Client(admin.server.url, admin.server.token).dial_worker(
            registration(admin.server.queue_id)
        )
    assert info.value.status_code == 503
    _, waited = admin.call("GET", "/faults/1/wait", {"timeout": "5"})
    assert waited["reached"] is True and waited["fault"]["fired"] == 1
    _, armed = admin.call(
        "POST", "/faults", {"kind": "drop_reply", "frame_type": "task.finish", "count": "2"}
    )
    assert armed["fault"]["id"] == 2
    assert [f.kind for f in admin.server.faults.active()] == ["drop_reply"]
    assert admin.call("POST", "/faults/2/cancel")[1]["fault"]["armed"] is False
    assert admin.server.faults.active() == ()
    _, listing = admin.call("GET", "/faults")
    assert [f["kind"] for f in listing["faults"]] == ["refuse_connections", "drop_reply"]
    assert admin.call("GET", "/faults/3/wait")[0] == 404
    admin.call("POST", "/faults", {"kind": "delay_reply", "frame_type": "task.start"})
    assert admin.call("POST", "/faults/clear")[0] == 200
    assert admin.server.faults.active() == ()


@pytest.mark.parametrize(
    "params",
    [
        {"kind": "explode"},
        {"kind": "drop_reply"},
        {"kind": "drop_reply", "frame_type": "task.bogus"},
        {"kind": "reply_error", "frame_type": "task.start", "code": "lower"},
        {"kind": "delay_reply", "frame_type": "task.start", "seconds": "61"},
        {"kind": "duplicate_push", "frame_type": "task.start"},
        {"kind": "refuse_connections", "status": "200"},
    ],
)
def test_bad_faults_are_400(admin: Admin, params: dict[str, str]) -> None:
    """Unknown kinds, missing or wrong frame types and out-of-range settings are refused."""
    status, body = admin.call("POST", "/faults", params)
    assert status == 400, body
    assert admin.server.faults.active() == ()


def test_send_raw_without_a_session_is_409(admin: Admin) -> None:
    """send-raw needs a connected session."""
    status, body = admin.call("POST", "/faults/send-raw", {"text": "{}"})
    assert status == 409 and body["error"]["code"] == "NO_SESSION"


# --------------------------------------------------------------------------- the client helper


def test_admin_client_round_trip(admin: Admin) -> None:
    """AdminClient enqueues, waits and raises AdminError with the server's code."""
    client = AdminClient(admin.server.url, ADMIN_TOKEN)
    assert client.url == f"http://127.0.0.1:{admin.port}/admin/v1"
    assert AdminClient("wss://h:1/", ADMIN_TOKEN).url == "https://h:1/admin/v1"
    task_id = client.enqueue("resize", {"w": 1}, max_attempts=2, backoff_initial=1e-5)
    assert client.task(task_id)["policy"]["backoff_initial"] == 1e-5
    client.post(f"/tasks/{task_id}/cancel")
    assert client.wait(task_id, ["CANCELLED"], timeout=1)["state"] == "CANCELLED"
    with pytest.raises(TimeoutError):
        client.wait(task_id, ["SUCCEEDED"], timeout=0.05)
    with pytest.raises(AdminError) as info:
        AdminClient(admin.server.url, "wrong-token").get("/server")
    assert info.value.status == 401 and info.value.code == "UNAUTHENTICATED"
    assert "wrong-token" not in str(info.value)


def test_admin_client_cancel_returns_the_snapshot(admin: Admin) -> None:
    """AdminClient.cancel requests the cancellation and returns the task's snapshot (a
    waiting task is CANCELLED at once)."""
    client = AdminClient(admin.server.url, ADMIN_TOKEN)
    task_id = client.enqueue("resize", {"w": 1})
    snapshot = client.cancel(task_id)
    assert snapshot["task_id"] == task_id and snapshot["state"] == "CANCELLED"
    assert admin.server.task(task_id).cancel_requested_at is not None


def test_waiting_for_unknown_says_it_is_an_outcome(admin: Admin) -> None:
    """wait(..., ["UNKNOWN"]) is a 400 that says UNKNOWN is an attempt outcome and names the
    task state it ends in (NEEDS_REVIEW)."""
    client = AdminClient(admin.server.url, ADMIN_TOKEN)
    task_id = client.enqueue("resize", {"w": 1})
    with pytest.raises(AdminError) as info:
        client.wait(task_id, ["FAILED", "UNKNOWN"], timeout=1)
    assert info.value.status == 400
    assert "UNKNOWN is an attempt outcome, not a task state" in info.value.message
    assert "ends in NEEDS_REVIEW" in info.value.message
    assert "task states are WAITING, LEASED" in info.value.message


def test_admin_error_prints_its_public_path() -> None:
    """AdminError names itself orbit_sync.testing.AdminError in a traceback, and pickles."""
    error = AdminError(400, "BAD_REQUEST", "nope")
    line = traceback.format_exception_only(type(error), error)[-1]
    assert line == "orbit_sync.testing.AdminError: 400 BAD_REQUEST: nope\n"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.status, copy.code, copy.message) == (400, "BAD_REQUEST", "nope")


# --------------------------------------------------------------------------- bulk and limits


def test_bulk_enqueue_creates_every_task_in_order(admin: Admin) -> None:
    """POST /tasks/bulk enqueues each task with its own options and returns the ids in order."""
    client = AdminClient(admin.server.url, ADMIN_TOKEN)
    specs = [{"handler": "resize", "payload": {"n": n}} for n in range(1000)]
    specs[7] = {"handler": "crop", "payload": [7], "max_attempts": 9}
    task_ids = client.enqueue_many(specs)
    assert len(task_ids) == 1000 == len(set(task_ids))
    assert [t.task_id for t in admin.server.tasks()] == task_ids
    assert admin.server.task(task_ids[3]).payload == {"n": 3}
    assert admin.server.task(task_ids[7]).policy.max_attempts == 9


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ({"handler": "resize"}, "tasks[2]: parameter 'payload' is required"),
        ({"handler": "resize", "payload": 1, "max_attempts": "2"}, "tasks[2]: parameter 'max"),
        ({"handler": "resize", "payload": 1, "tokn": 1}, "tasks[2]: unknown parameter 'tokn'"),
        ("resize", "tasks[2]: each task must be a JSON object"),
        ({"handler": "Resize", "payload": 1}, "tasks[2]: "),
        (
            {"handler": "resize", "payload": 1, "backoff_initial": 5, "backoff_max": 1},
            "tasks[2]: backoff_max",
        ),
    ],
)
def test_bulk_enqueue_is_all_or_nothing(admin: Admin, item: Any, fragment: str) -> None:
    """One bad task refuses the whole request, naming its index; nothing is enqueued."""
    tasks = [{"handler": "resize", "payload": 1}] * 2 + [item]
    status, body = admin.call(
        "POST",
        "/tasks/bulk",
        headers={"Content-Type": "application/json"},
        body=json.dumps({"tasks": tasks}).encode(),
    )
    assert status == 400 and fragment in body["error"]["message"]
    assert admin.server.tasks() == ()
    status, body = admin.call("POST", "/tasks/bulk")
    assert status == 400 and "'tasks' is required" in body["error"]["message"]


def test_admin_client_reads_large_answers(admin: Admin) -> None:
    """GET /tasks with thousands of tasks parses (answers are not held to the frame limit)."""
    admin.server.enqueue_many({"handler": "resize", "payload": {"n": n}} for n in range(2000))
    client = AdminClient(admin.server.url, ADMIN_TOKEN)
    assert client.get("/tasks", limit=10_000)["count"] == 2000
    with pytest.raises(AdminError) as info:
        AdminClient(admin.server.url, ADMIN_TOKEN, max_answer_bytes=100_000).get("/tasks")
    assert info.value.code == "BAD_ANSWER" and info.value.status == 200


def test_admin_client_raises_on_answers_it_cannot_parse() -> None:
    """A non-JSON answer (whatever its status) is an AdminError, not a made-up body."""

    def text_only(srv: MockOrbitServer, connection: Any, request: Any) -> Any:
        return connection.respond(200 if request.path.endswith("ok") else 502, "<html>\n")

    with MockOrbitServer(admin_handler=text_only) as srv:
        for path, status in (("/ok", 200), ("/bad", 502)):
            with pytest.raises(AdminError) as info:
                AdminClient(srv.url, ADMIN_TOKEN).request("GET", path)
            assert (info.value.status, info.value.code) == (status, "BAD_ANSWER")


def test_admin_requests_beyond_the_limit_get_503() -> None:
    """Waits may hold half the admin slots; one more wait is 503 JSON, other requests go on."""
    api = AdminAPI(ADMIN_TOKEN)
    with MockOrbitServer(clock=ManualClock(), admin_handler=api, max_admin_requests=2) as server:
        admin = Admin(server, api)
        task_id = server.enqueue("resize", {"w": 1})
        answers: list[tuple[int, dict[str, Any]]] = []
        waiter = threading.Thread(
            target=lambda: answers.append(
                admin.call("GET", f"/tasks/{task_id}/wait", {"states": "CANCELLED"})
            )
        )
        waiter.start()
        server.wait_until(lambda s: s.admin_requests == 1)
        status, body = admin.call("GET", f"/tasks/{task_id}/wait", {"states": "CANCELLED"})
        assert status == 503 and body["error"]["code"] == "UNAVAILABLE"
        assert admin.call("GET", "/server")[0] == 200
        server.request_cancel(task_id)
        waiter.join(10)
        assert answers[0][0] == 200 and answers[0][1]["reached"] is True
        assert any(e.kind == "admin.refused" for e in server.events())


def test_admin_client_imports_without_websockets() -> None:
    """AdminClient needs only http.client: it imports with websockets made unimportable."""
    code = (
        "import sys; sys.modules['websockets'] = None\n"
        "from orbit_sync.testing import AdminClient, AdminError\n"
        "assert 'websockets' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
