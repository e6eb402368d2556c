"""``orbit-sync mock-server --queue-id``: a restarted server with the same queue id and tokens
keeps a connected worker working; an unknown queue is named in the refusal."""

from __future__ import annotations

import queue
import signal
import subprocess
from typing import Any

import pytest
from _cli_process import Proc, command

from orbit_sync import Client
from orbit_sync.errors import WorkerError
from orbit_sync.testing import AdminClient, MockOrbitServer
from orbit_sync.worker import Backoff, SessionEvent, Worker

QUEUE = "0123456789abcdef0123456789abcdef"
TOKEN = "restart-worker-token-0123456789"
ADMIN = "restart-admin-token-0123456789"


def _mock(procs: list[Proc], port: str) -> dict[str, str]:
    proc = Proc(
        command(
            "mock-server",
            *("--port", port, "--queue-id", QUEUE, "--token", TOKEN, "--admin-token", ADMIN),
            *("--assignment-rate", "0"),
        )
    )
    procs.append(proc)
    return proc.banner()


class _Sessions:
    """A listener that hands each established session to the test."""

    def __init__(self) -> None:
        self.events: queue.Queue[SessionEvent] = queue.Queue()

    def connected(self, event: SessionEvent) -> None:
        self.events.put(event)


def test_a_worker_stays_working_across_a_restart(procs: list[Proc]) -> None:
    """Stop the mock server and start it again on the same port with the same --queue-id and
    tokens: the worker reconnects and runs the new server's task; it never stops."""
    banner = _mock(procs, "0")
    assert banner["ORBIT_QUEUE_ID"] == QUEUE
    url = banner["ORBIT_URL"]
    port = url.rsplit(":", 1)[1]
    sessions = _Sessions()
    worker = Worker(
        Client(url, TOKEN),
        queue_id=QUEUE,
        handle_signals=False,
        reconnect_backoff=Backoff(initial=0.05, maximum=0.2),
        listeners=[sessions],
    )

    @worker.handler("echo")
    def echo(ctx: Any, payload: Any) -> Any:
        return payload

    with worker:
        assert sessions.events.get(timeout=10).reconnect is False
        assert procs[0].stop(signal.SIGTERM) == 0
        second = _mock(procs, port)
        assert second["ORBIT_QUEUE_ID"] == QUEUE
        assert sessions.events.get(timeout=15).reconnect is True
        admin = AdminClient(second["ORBIT_ADMIN_URL"], ADMIN)
        task_id = admin.enqueue("echo", {"n": 7})
        assert admin.wait(task_id, ["SUCCEEDED"], timeout=15)["result"] == {"n": 7}
        assert worker.stats().connected


def test_an_unknown_queue_is_named_in_the_refusal() -> None:
    """A hello for a queue the server does not have is PERMISSION_DENIED (PROTOCOL §11: no queue
    scope) with a message naming that queue, not a generic scope message."""
    other = "f" * 32
    with MockOrbitServer(queue_id=QUEUE) as server:
        assert server.queue_id == QUEUE
        client = Client(server.url, server.token)
        worker = Worker(client, queue_id=other, handle_signals=False)
        worker.register("echo", lambda ctx, payload: payload)
        with pytest.raises(WorkerError) as info:
            client.dial_worker(worker.registration)
    assert info.value.code == "PERMISSION_DENIED"
    assert f"no scope for queue {other}, or this server has no such queue" in str(info.value)


def test_a_malformed_queue_id_is_a_usage_error() -> None:
    """``--queue-id`` (and ``MockOrbitServer(queue_id=...)``) takes 32 lowercase hex characters,
    like the worker's ``--queue``."""
    with pytest.raises(ValueError, match="32 lowercase hex"):
        MockOrbitServer(queue_id="Q1")
    proc = subprocess.run(
        command("mock-server", "--queue-id", "Q1"), capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert "--queue-id: expected a queue id" in proc.stderr
