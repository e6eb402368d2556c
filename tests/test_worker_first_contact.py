"""A server never reached since the start: said at ERROR from the first failed dial, shown by the
health probe's ``/readyz``, and, with ``first_connect_timeout``, the end of ``run()``
(``ServerUnreachable``; ``orbit-sync worker`` exits 6). A server once reached is retried for ever.
Against a closed port and the real mock server, on the worker's fake clock."""

from __future__ import annotations

import http.client
import json
import logging
import math
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from _worker_helpers import FailedDials, run_until_it_gives_up

from orbit_sync import Client, ServerUnreachable
from orbit_sync._cli_report import EXIT_UNREACHABLE, exit_status_for
from orbit_sync.contrib.health import HealthProbe
from orbit_sync.errors import WorkerDisconnected
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import Backoff, DisconnectEvent, SessionEvent, Worker, WorkerListener
from orbit_sync.worker.core._errors import FirstContact

QUEUE = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def closed_url() -> str:
    """A ws:// URL on a loopback port nothing listens on (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"ws://127.0.0.1:{port}"


@pytest.fixture
def lines() -> Iterator[FailedDials]:
    """The worker logger's "cannot connect" lines during the test."""
    with FailedDials() as dials:
        yield dials


class _Lost(WorkerListener, threading.Event):
    """Set when the worker's session ends."""

    def disconnected(self, event: DisconnectEvent) -> None:
        self.set()


def _worker(url: str, clock: ManualClock, **options: Any) -> Worker:
    worker = Worker(
        Client(url, "some-token-0123456789"),
        queue_id=QUEUE,
        clock=clock,
        handle_signals=False,
        reconnect_backoff=Backoff(initial=5.0, maximum=10.0),
        **options,
    )
    worker.register("echo", lambda ctx, payload: payload)
    return worker


def test_a_server_never_reached_stops_the_worker_after_first_connect_timeout(
    closed_url: str, lines: FailedDials
) -> None:
    """Dials refused for first_connect_timeout of the worker's clock: run() raises
    ServerUnreachable naming the URL, the dials and the last failure (exit 6); the first failed
    dial said at ERROR that the server was never reached, the retries at WARNING."""
    clock = ManualClock(0.0)
    worker = _worker(closed_url, clock, first_connect_timeout=30)
    # After each failed dial the connection thread waits out its backoff on the fake clock: let
    # it pass at once, until the worker gives up.
    exc = run_until_it_gives_up(worker, clock, lines)
    assert exc is not None, "the worker kept retrying past first_connect_timeout"
    assert isinstance(exc, ServerUnreachable)
    assert str(exc).startswith(f"{closed_url} was not reached within 30 s of the start (")
    assert "dials failed, the last: WorkerDisconnected" in str(exc)
    assert "Connection refused" in str(exc)
    assert exit_status_for(exc) == EXIT_UNREACHABLE
    (first_level, first), *retries = lines.lines
    assert first_level == logging.ERROR
    assert "not reached once since this worker started; retrying" in first
    assert retries and all(level == logging.WARNING for level, _ in retries)
    assert all("not reached once since the start" in line for _, line in retries)
    # The pauses stopped at the bound: 30 s of 10 s pauses is a handful of dials.
    assert 3 <= len(lines.lines) <= 6


def test_a_server_reached_once_is_retried_past_first_connect_timeout(lines: FailedDials) -> None:
    """A worker that connected, then lost its server, keeps retrying long after
    first_connect_timeout, at WARNING, without saying it was never reached."""
    clock = ManualClock(0.0)
    lost = _Lost()
    server = MockOrbitServer()
    server.start()
    try:
        worker = Worker(
            Client(server.url, server.token),
            queue_id=server.queue_id,
            clock=clock,
            handle_signals=False,
            reconnect_backoff=Backoff(initial=5.0, maximum=10.0),
            first_connect_timeout=1,
            listeners=[lost],
        )
        worker.register("echo", lambda ctx, payload: payload)
        worker.start()
        assert worker.wait_ready(10)
    finally:
        server.stop()
    try:
        # From here on the connection thread only waits out reconnect delays.
        assert lost.wait(10), "the session never ended"
        # Each retry line comes after 10 s more of the worker's clock: past the 1 s bound.
        for seen in range(1, 5):
            assert clock.wait_for_sleepers(1, "orbit-worker-connection", timeout=5)
            clock.advance(10.0)
            assert lines.wait(seen), "the worker stopped retrying"
    finally:
        worker.stop(drain=False)
    assert all(level == logging.WARNING for level, _ in lines.lines)
    assert not any("not reached once" in line for _, line in lines.lines)


def test_readyz_says_a_worker_never_reached_its_server(closed_url: str, lines: FailedDials) -> None:
    """While no dial has succeeded since the start, /readyz answers 503 with status
    "unreached", reached false and how long ago the first dial failed."""
    clock = ManualClock(0.0)
    probe = HealthProbe(clock=clock)
    worker = _worker(closed_url, clock, listeners=[probe])
    with probe.serve(port=0) as http_server:
        worker.start()
        try:
            assert lines.wait(1)
            clock.advance(4.0)
            conn = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=5)
            conn.request("GET", "/readyz")
            answer = conn.getresponse()
            state = json.loads(answer.read())
            conn.close()
        finally:
            worker.stop(drain=False)
    assert answer.status == 503
    assert state["status"] == "unreached" and state["reached"] is False
    assert state["unreached_s"] == 4.0 and state["dial_failures"] >= 1


def test_probe_status_words() -> None:
    """starting, unreached, ready, reconnecting, draining, stopped: in that life order."""
    clock = ManualClock(0.0)
    probe = HealthProbe(clock=clock)
    assert probe.state()["status"] == "starting"
    probe.dial_failed(DisconnectEvent("WorkerDisconnected"))
    clock.advance(2.0)
    assert probe.state()["status"] == "unreached" and probe.state()["unreached_s"] == 2.0
    probe.connected(SessionEvent("a" * 32, False))
    state = probe.state()
    assert state["status"] == "ready" and state["reached"] and state["unreached_s"] is None
    probe.disconnected(DisconnectEvent("WorkerDisconnected"))
    probe.dial_failed(DisconnectEvent("WorkerDisconnected"))
    assert probe.state()["status"] == "reconnecting" and probe.state()["unreached_s"] is None


def test_first_contact_bound() -> None:
    """No bound: never gives up; with one, only once the bound passed, and never once reached."""
    now = [0.0]
    refused = WorkerDisconnected("cannot connect to the Orbit server: Connection refused")
    unbounded = FirstContact(lambda: now[0], None)
    bounded = FirstContact(lambda: now[0], 10.0)
    now[0] = 5.0
    assert bounded.failed(refused, "ws://h") is None and bounded.remaining() == 5.0
    now[0] = 100.0
    assert unbounded.failed(refused, "ws://h") is None and unbounded.remaining() == math.inf
    stop = bounded.failed(refused, "ws://h")
    assert isinstance(stop, ServerUnreachable) and "(2 dials failed" in str(stop)
    reached = FirstContact(lambda: now[0], 10.0)
    reached.connected()
    now[0] = 1000.0
    assert reached.remaining() == math.inf
