"""No token, instance_secret or lease_secret in DEBUG logs, reprs, messages or tracebacks."""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Any

import pytest
from _scripted import (
    INSTANCE_SECRET,
    LEASE_SECRET,
    TOKEN,
    WAIT,
    ScriptedServer,
    assignment_body,
    command_body,
    frame,
    leaked,
    open_pair,
    registration,
    welcome_body,
)

from orbit_sync.client import Client
from orbit_sync.errors import HTTPError, OrbitError, WorkerError, WorkerProtocolError
from orbit_sync.models import CapacityReport, Finish, Outcome

SECRETS = {"token": TOKEN, "instance_secret": INSTANCE_SECRET, "lease_secret": LEASE_SECRET}


def _texts(obj: Any) -> list[str]:
    """repr, str and (for exceptions) the formatted traceback of *obj*."""
    out = [repr(obj), str(obj)]
    if isinstance(obj, BaseException):
        out.append("".join(traceback.format_exception(obj)))
    return out


def test_secrets_never_appear(caplog: pytest.LogCaptureFixture) -> None:
    """A session with failures, logged at DEBUG (ours and websocket-client's), leaks nothing."""
    caplog.set_level(logging.DEBUG, logger="orbit_sync")
    caplog.set_level(logging.DEBUG, logger="websocket")
    seen: list[Any] = []
    with ScriptedServer() as server:
        client = Client(server.url, TOKEN)
        conn, peer = open_pair(server)
        seen += [client, conn, conn.registration, conn.welcome]

        def answer() -> None:
            peer.ack(peer.recv(), welcome_body())
            peer.push("task.assign", assignment_body())
            peer.ack(peer.recv(), command_body("start"))
            peer.error(peer.recv(), "LEASE_LOST", "lease is gone")
            peer.recv()
            # An invalid assignment that carries the lease secret: its error must not echo it.
            peer.push("task.assign", assignment_body(queue_id="b" * 32))

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        conn.capacity(CapacityReport(1, 4))
        assignment = conn.next_assignment(timeout=WAIT)
        result = conn.start(assignment.attempt)
        seen += [assignment, assignment.attempt, assignment.task, result, result.lease]
        with pytest.raises(WorkerError) as lost:
            conn.renew(assignment.attempt)
        seen.append(lost.value)
        with pytest.raises(WorkerProtocolError) as broken:
            conn.finish(Finish(assignment.attempt, Outcome.SUCCEEDED, {"ok": True}))
        thread.join(WAIT)
        seen += [broken.value, conn.err, conn]
        conn.close()

    with ScriptedServer(status=401) as refusing:
        with pytest.raises(HTTPError) as refused:
            Client(refusing.url, TOKEN).dial_worker(registration())
        seen.append(refused.value)
    with ScriptedServer() as server:
        hello_error: dict[str, OrbitError] = {}

        def dial() -> None:
            try:
                Client(server.url, TOKEN).dial_worker(registration())
            except OrbitError as exc:
                hello_error["e"] = exc

        dialer = threading.Thread(target=dial, daemon=True)
        dialer.start()
        peer = server.accept()
        hello = peer.recv()
        peer.send(frame("error", reply_to=hello["message_id"], error=("UNAUTHENTICATED", "no")))
        dialer.join(WAIT)
        seen.append(hello_error["e"])

    texts = [caplog.text] + [text for obj in seen for text in _texts(obj)]
    assert "sent task.start" in caplog.text  # the DEBUG log really was captured
    assert leaked("\n".join(texts), SECRETS) == []
