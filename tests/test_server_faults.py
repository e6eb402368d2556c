"""Fault injection of MockOrbitServer over real sockets: each fault fires, is counted and does
exactly what it says (applied or not, answered or not, connection kept or cut)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from _rawclient import Closed, RawClient, error_code
from websockets.exceptions import InvalidStatus

from orbit_sync.models import AttemptRef, Finish, TaskState, new_message_id
from orbit_sync.testing import ManualClock, MockOrbitServer


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A server on a manual clock with no assignment rate limit."""
    with MockOrbitServer(clock=ManualClock(), assignment_rate=None) as srv:
        yield srv


def _assigned(server: MockOrbitServer, client: RawClient) -> tuple[str, AttemptRef]:
    task_id = server.enqueue("resize", {"n": 1})
    return task_id, client.ref(client.next_push())


def test_drop_reply_applies_without_answering(server: MockOrbitServer) -> None:
    """drop_reply: the start is applied, no answer comes, and the connection stays open."""
    client = RawClient(server).open()
    task_id, ref = _assigned(server, client)
    fault = server.faults.drop_reply("task.start")
    client.send("task.start", ref)
    assert fault.wait(5) and fault.fired == 1
    assert server.task(task_id).state is TaskState.RUNNING
    # The next request is answered normally: the connection is alive, the fault is spent.
    assert client.renew(ref)["type"] == "ack"
    assert fault.fired == 1 and server.faults.active() == ()


def test_close_before_does_not_apply(server: MockOrbitServer) -> None:
    """close_before: the connection is cut and the request was never applied."""
    client = RawClient(server).open()
    task_id, ref = _assigned(server, client)
    fault = server.faults.close_before("task.start")
    client.send("task.start", ref)
    with pytest.raises(Closed):
        client.recv()
    assert fault.fired == 1
    assert server.task(task_id).state is TaskState.LEASED


def test_close_after_applies_then_cuts(server: MockOrbitServer) -> None:
    """close_after: applied, then the connection is cut without an answer."""
    client = RawClient(server).open()
    task_id, ref = _assigned(server, client)
    client.start(ref)
    fault = server.faults.close_after("task.finish")
    mid = client.send("task.finish", _finish(ref))
    with pytest.raises(Closed):
        client.recv()
    assert fault.fired == 1
    assert server.task(task_id).state is TaskState.SUCCEEDED
    again = client.reconnect().connect()
    again.hello()
    again.resume(ref)
    replay = again.request("task.finish", _finish(ref), message_id=mid)
    assert replay["body"]["deduplicated"] is True


def _finish(ref: AttemptRef) -> Finish:
    return Finish(ref=ref, outcome="SUCCEEDED", result={"ok": True})


def test_delay_reply_holds_the_answer(server: MockOrbitServer) -> None:
    """delay_reply: the answer arrives no sooner than the delay, and is correct."""
    client = RawClient(server).open()
    _, ref = _assigned(server, client)
    client.start(ref)
    fault = server.faults.delay_reply("task.renew", seconds=0.3)
    started = time.monotonic()
    answer = client.renew(ref)
    assert time.monotonic() - started >= 0.3
    assert answer["type"] == "ack" and fault.fired == 1


def test_duplicate_push_sends_the_same_assignment_twice(server: MockOrbitServer) -> None:
    """duplicate_push: the next task.assign frame arrives twice, byte for byte."""
    client = RawClient(server).open()
    fault = server.faults.duplicate_push("task.assign")
    server.enqueue("resize", {"n": 1})
    first = client.next_push()
    second = client.next_push()
    assert first == second and fault.fired == 1


def test_refuse_connections(server: MockOrbitServer) -> None:
    """refuse_connections: the next upgrades get the status; later ones succeed."""
    fault = server.faults.refuse_connections(count=2, status=503)
    for _ in range(2):
        with pytest.raises(InvalidStatus) as info:
            RawClient(server).connect()
        assert info.value.response.status_code == 503
    assert fault.wait(0) and fault.fired == 2
    assert RawClient(server).connect().hello()["type"] == "worker.welcome"


def test_a_firing_fault_wakes_wait_until(server: MockOrbitServer) -> None:
    """wait_until re-checks a predicate over fault.fired as soon as the fault fires."""
    fault = server.faults.refuse_connections(status=503)
    waiting = threading.Event()
    statuses: list[int] = []

    def fired(_: MockOrbitServer) -> bool:
        done = fault.fired == 1
        waiting.set()  # we hold the server's lock: the fault fires only once we wait
        return done

    def connect() -> None:
        waiting.wait(5)
        try:
            RawClient(server).connect()
        except InvalidStatus as exc:
            statuses.append(exc.response.status_code)

    thread = threading.Thread(target=connect)
    thread.start()
    started = time.monotonic()
    try:
        server.wait_until(fired, timeout=3)  # nothing but the fault changes meanwhile
    finally:
        thread.join()
    # Woken by the fault, not by the timeout (after which wait_until checks once more).
    assert time.monotonic() - started < 2
    assert statuses == [503]


def test_reply_error_refuses_without_applying(server: MockOrbitServer) -> None:
    """reply_error: answered with the code, not applied; re-sending the same id works."""
    client = RawClient(server).open()
    task_id, ref = _assigned(server, client)
    server.faults.reply_error("task.start", "RATE_LIMITED")
    mid = new_message_id()
    assert error_code(client.start(ref, message_id=mid)) == "RATE_LIMITED"
    assert server.task(task_id).state is TaskState.LEASED
    assert client.start(ref, message_id=mid)["body"]["deduplicated"] is False


def test_send_raw_reaches_the_client(server: MockOrbitServer) -> None:
    """send_raw pushes the exact text; an unknown session is a LookupError."""
    client = RawClient(server, strict=False).open()
    text = json.dumps({"protocol_version": "1", "type": "bogus"})
    server.faults.send_raw(text, client.session_id)
    assert client.recv() == json.loads(text)
    with pytest.raises(LookupError):
        server.faults.send_raw(text, "f" * 32)


def test_fault_scoped_to_a_session(server: MockOrbitServer) -> None:
    """A fault bound to one session never fires for another."""
    a = RawClient(server).open()
    b = RawClient(server).open()
    fault = server.faults.drop_reply("worker.capacity", session_id=a.session_id)
    assert b.capacity(2, 4)["type"] == "ack"
    assert fault.fired == 0
    a.send("worker.capacity", {"sequence": "2", "capacity": 4, "drain": False})
    assert fault.wait(5)


def test_fault_count_and_cancel(server: MockOrbitServer) -> None:
    """A fault fires exactly count times; a cancelled one never fires."""
    client = RawClient(server).open()
    fault = server.faults.reply_error("worker.capacity", "UNAVAILABLE", count=2)
    cancelled = server.faults.drop_reply("worker.capacity")
    cancelled.cancel()
    assert [error_code(client.capacity(1, 4)) for _ in range(3)] == [
        "UNAVAILABLE",
        "UNAVAILABLE",
        None,
    ]
    assert fault.fired == 2 and cancelled.fired == 0
    assert any(e.kind == "fault.fired" for e in server.events())


def test_fault_arguments_are_checked(server: MockOrbitServer) -> None:
    """Unknown frame types, bad counts and bad statuses raise at once."""
    with pytest.raises(ValueError):
        server.faults.drop_reply("task.assign")
    with pytest.raises(ValueError):
        server.faults.duplicate_push("task.start")
    with pytest.raises(ValueError):
        server.faults.close_after("task.finish", count=0)
    with pytest.raises(ValueError):
        server.faults.refuse_connections(status=101)
    with pytest.raises(ValueError):
        server.faults.reply_error("task.start", "lower")
