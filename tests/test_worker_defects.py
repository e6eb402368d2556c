"""Regression tests for worker defects found in review: each fails without its fix."""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
from typing import Any

import attrs
import pytest
from _scripted import TOKEN, WAIT, SilentServer, registration
from _worker_helpers import Probe, Sessions, has_event, make_worker, running

from orbit_sync.client import Client
from orbit_sync.errors import WorkerDisconnected
from orbit_sync.models import TaskState
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import Backoff, TaskContext, Worker

QUEUE = "a" * 32


@pytest.fixture
def server() -> Any:
    """A mock server that assigns at once."""
    with MockOrbitServer(assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize("name", ["drain_timeout", "cancel_grace", "flush_timeout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_shutdown_bounds_are_rejected(name: str, value: float) -> None:
    """NaN (which compares false with everything) or infinity as a shutdown bound raises."""
    with pytest.raises(ValueError, match=name):
        Worker(Client("ws://127.0.0.1:1", TOKEN), queue_id=QUEUE, **{name: value})


def test_nan_stop_timeout_is_rejected_before_stopping(server: MockOrbitServer) -> None:
    """request_stop(timeout=nan) raises and the worker keeps running."""
    worker = make_worker(server)
    worker.register("noop", lambda ctx, payload: None)
    with running(worker):
        with pytest.raises(ValueError, match="timeout"):
            worker.request_stop(timeout=float("nan"))
        with pytest.raises(ValueError, match="timeout"):
            worker.stop(timeout=float("nan"))
        task_id = server.enqueue("noop", {})
        assert server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).state is TaskState.SUCCEEDED


# ------------------------------------------------------------------ identity


def test_forked_child_gets_a_new_instance_identity() -> None:
    """After os.fork() the child's Worker has a new instance_id and instance_secret."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    script = textwrap.dedent(
        """
        import json, os, sys
        from orbit_sync.client import Client
        from orbit_sync.worker import Worker
        worker = Worker(Client("ws://127.0.0.1:1", "t"), queue_id="a" * 32)
        worker.register("noop", lambda ctx, payload: None)
        def ident():
            r = worker.registration
            return [r.instance_id, r.instance_secret]
        parent = ident()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, json.dumps(ident()).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        child = json.loads(os.read(read, 4096))
        print(json.dumps({"parent": parent, "child": child, "after": ident()}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    ids = json.loads(out.stdout)
    assert ids["parent"] == ids["after"], "the parent keeps its identity"
    assert ids["child"][0] != ids["parent"][0], "the child needs its own instance_id"
    assert ids["child"][1] != ids["parent"][1], "and its own instance_secret"


# ------------------------------------------------------------------ reconnects


@attrs.frozen
class RecordingBackoff(Backoff):
    """A Backoff that records which attempt number each delay was asked for."""

    asked: list[int] = attrs.field(factory=list)

    def delay(self, attempt: int, rng: Any = None) -> float:
        """Record *attempt*; wait very little."""
        self.asked.append(attempt)
        return 0.01


def test_backoff_restarts_once_a_welcome_arrives(server: MockOrbitServer) -> None:
    """Sessions cut right after their welcome reconnect at the first delay, not a growing one."""
    backoff = RecordingBackoff()
    cuts = server.faults.close_before("worker.capacity", count=5)
    worker = make_worker(server, reconnect_backoff=backoff)
    worker.register("noop", lambda ctx, payload: None)
    with running(worker):
        assert cuts.fired == 5
    assert len(backoff.asked) >= 5
    assert set(backoff.asked) == {0}, backoff.asked


def test_failed_dials_still_back_off(server: MockOrbitServer) -> None:
    """Refused dials (no welcome) keep growing the delay."""
    backoff = RecordingBackoff()
    server.faults.refuse_connections(count=3, status=503)
    worker = make_worker(server, reconnect_backoff=backoff)
    worker.register("noop", lambda ctx, payload: None)
    with running(worker):
        pass
    assert backoff.asked[:3] == [1, 2, 3]


def test_transient_error_to_capacity_is_retried_on_the_same_session(
    server: MockOrbitServer,
) -> None:
    """RATE_LIMITED answering the capacity report is retried in place: one session, no reconnect."""
    fault = server.faults.reply_error("worker.capacity", "RATE_LIMITED", count=2)
    worker = make_worker(server, renew_retry_delay=0.1)
    worker.register("noop", lambda ctx, payload: None)
    with running(worker):
        assert fault.fired == 2
        task_id = server.enqueue("noop", {})
        assert server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).state is TaskState.SUCCEEDED
        assert worker.stats().reconnects == 0
        assert len(server.sessions()) == 1


def test_transient_error_to_resume_is_retried_on_the_same_session(
    server: MockOrbitServer,
) -> None:
    """UNAVAILABLE answering a resume after a reconnect is retried in place, not a new session."""
    probe = Probe()
    sessions = Sessions()
    worker = make_worker(server, renew_retry_delay=0.1, listeners=[sessions])

    @worker.handler("slow")
    def slow(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        probe.release.wait(WAIT)
        return {"ok": True}

    with running(worker):
        task_id = server.enqueue("slow", {})
        probe.wait_started()
        fault = server.faults.reply_error("worker.resume", "UNAVAILABLE", count=2)
        server.disconnect()
        assert fault.wait(WAIT)
        server.wait_until(has_event("attempt.resumed", task_id), timeout=WAIT)
        probe.release.set()
        assert server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).state is TaskState.SUCCEEDED
        # The finish may go out before the retried resume is over (the session is counted
        # then): wait for the session before reading the count.
        assert sessions.wait(lambda s: s.established >= 2), "the worker never reconnected"
        assert worker.stats().reconnects == 1, "only the disconnect itself"
    assert probe.runs[task_id] == 1


def test_reconciliation_cut_midway_is_completed_on_the_next_connection(
    server: MockOrbitServer,
) -> None:
    """A connection cut while its resumes are answered: the next one resumes every running
    attempt again, and every handler keeps its lease and runs once."""
    probe = Probe()
    sessions = Sessions()
    worker = make_worker(server, capacity=3, listeners=[sessions])

    @worker.handler("slow")
    def slow(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        probe.release.wait(WAIT)
        return {"ok": True}

    with running(worker):
        ids = [server.enqueue("slow", {"i": i}) for i in range(3)]
        probe.wait_started(3)
        # The first resume of the next session is applied, then that connection is cut.
        cut = server.faults.close_after("worker.resume", count=1)
        server.disconnect()
        assert cut.wait(WAIT)
        for task_id in ids:
            server.wait_until(has_event("attempt.resumed", task_id), timeout=WAIT)
        probe.release.set()
        for task_id in ids:
            assert server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).state is (
                TaskState.SUCCEEDED
            )
        # The finishes may be answered before the connection thread steps the last resume's
        # answer (the session is counted then): wait for the session before reading the count.
        assert sessions.wait(lambda s: s.established >= 2), "the worker never reconnected"
        stats = worker.stats()
    assert stats.lease_losses == 0
    # The session cut during its resumes (none of them answered) was never established.
    assert stats.reconnects == 1
    assert sessions.established == 2
    assert all(probe.runs[task_id] == 1 for task_id in ids)


# ------------------------------------------------------------------ shutdown bound


def test_stop_cuts_a_pending_dial() -> None:
    """stop() with every bound at 0 returns at once while a dial waits for an upgrade answer."""
    with SilentServer() as silent:
        worker = Worker(
            Client(silent.url, TOKEN),
            queue_id=QUEUE,
            drain_timeout=0,
            cancel_grace=0,
            flush_timeout=0,
            handle_signals=False,
        )
        worker.register("noop", lambda ctx, payload: None)
        worker.start()
        assert silent.accepted.wait(WAIT), "the dial never reached the server"
        stopped = threading.Event()
        threading.Thread(target=lambda: (worker.stop(), stopped.set()), daemon=True).start()
        # Without the cut, stop() waits for the 8 s dial deadline.
        assert stopped.wait(4.0), "stop() waited for the dial to time out"
        assert worker.stop().error is None


# ------------------------------------------------------------------ errors keep their cause


class _BuggyDialer:
    """A dialer with a bug: dial_worker raises a plain RuntimeError."""

    def dial_worker(self, registration: Any, timeout: float = 8.0, **kw: Any) -> Any:
        """Raise like a bug would."""
        raise RuntimeError("dialer bug")


def test_unexpected_dial_error_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug in dialing stops the worker with that error, logged with its traceback."""
    worker = Worker(_BuggyDialer(), queue_id=QUEUE, handle_signals=False)
    worker.register("noop", lambda ctx, payload: None)
    with caplog.at_level(logging.ERROR, logger="orbit_sync.worker"):
        worker.start()
        report = worker.stop()
    assert isinstance(report.error, RuntimeError)
    logged = [r for r in caplog.records if "cannot connect" in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert logged[0].exc_info[1] is report.error


# ------------------------------------------------------------------ dial


def _cutting_listener(answer: bytes) -> tuple[socket.socket, threading.Thread]:
    """A listener that reads one upgrade request, sends *answer*, then closes the connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            conn.sendall(answer)

    thread = threading.Thread(target=serve, name="cutting-listener", daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize("answer", [b"", b"HTTP/1.1 10", b"HTTP/1.1 101 Switching Protocols\r\n"])
def test_upgrade_cut_before_the_answer_is_a_disconnect(answer: bytes) -> None:
    """A connection cut before the whole 101 answer arrived is WorkerDisconnected."""
    listener, thread = _cutting_listener(answer)
    with listener:
        url = f"ws://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(WorkerDisconnected):
            Client(url, TOKEN).dial_worker(registration(), timeout=5.0)
        thread.join(WAIT)


def test_ssl_context_weakened_after_the_client_was_made_is_refused_at_dial() -> None:
    """Turning verification off on the caller's context later fails the dial before connecting."""
    context = ssl.create_default_context()
    with SilentServer() as silent:
        client = Client(f"wss://127.0.0.1:{silent.port}", TOKEN, ssl_context=context)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        with pytest.raises(ValueError, match="verify"):
            client.dial_worker(registration(), timeout=1.0)
        assert not silent.accepted.is_set()
