"""Reconnect waits: a dial the link cut is retried soon, one the server refused backs off."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator

import pytest
from test_admin_api import registration

from orbit_sync.client import Client
from orbit_sync.errors import CallTimeout, HTTPError, WorkerDisconnected, WorkerError
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import Backoff
from orbit_sync.worker.core._redial import CUT, REFUSED, RESET, RESET_GRACE, Redial, dial_failure


def _lost(stage: str | None) -> WorkerDisconnected:
    exc = WorkerDisconnected("connection lost")
    exc.dial_stage = stage
    return exc


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server."""
    with MockOrbitServer() as srv:
        yield srv


def test_dial_failures_say_how_far_they_got(server: MockOrbitServer) -> None:
    """Lost after the upgrade was accepted: "hello" (a cut); reset before the upgrade was
    answered: "upgrade"; no TCP connection: no stage (refused); an HTTP refusal stays itself."""
    client = Client(server.url, server.token)
    server.faults.close_before("worker.hello")
    with pytest.raises(WorkerDisconnected) as info:
        client.dial_worker(registration(server.queue_id), timeout=5)
    assert info.value.dial_stage == "hello" and dial_failure(info.value) == CUT

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def reset_one() -> None:
            conn, _ = listener.accept()
            conn.recv(4096)  # the upgrade request, never answered
            conn.close()

        thread = threading.Thread(target=reset_one, daemon=True)
        thread.start()
        with pytest.raises(WorkerDisconnected) as info:
            Client(f"ws://127.0.0.1:{port}", server.token).dial_worker(
                registration(server.queue_id), timeout=5
            )
        thread.join(5)
    assert info.value.dial_stage == "upgrade" and dial_failure(info.value) == RESET

    with pytest.raises(WorkerDisconnected) as info:  # the listener is closed: refused
        Client(f"ws://127.0.0.1:{port}", server.token).dial_worker(
            registration(server.queue_id), timeout=5
        )
    assert info.value.dial_stage is None and dial_failure(info.value) == REFUSED

    server.faults.refuse_connections(status=503)
    with pytest.raises(HTTPError) as http_info:
        client.dial_worker(registration(server.queue_id), timeout=5)
    assert dial_failure(http_info.value) == REFUSED


def test_refusals_back_off_exponentially() -> None:
    """HTTP statuses, error frames, timeouts and failed connects: attempt 1, 2, 3..."""
    redial = Redial(Backoff())
    failures = [
        HTTPError(503),
        WorkerError("UNAVAILABLE", "busy"),
        CallTimeout("slow"),
        _lost(None),
    ]
    for n, exc in enumerate(failures, 1):
        assert redial.failed(exc) == REFUSED
        assert redial.attempt() == n


def test_cuts_never_push_the_wait_up() -> None:
    """However many dials in a row the link cuts after the upgrade, the next wait is the
    shortest (Backoff attempt 0, within [0, initial])."""
    rng = random.Random(5)
    redial = Redial(Backoff(initial=0.2, maximum=10.0), rng)
    for _ in range(20):
        assert redial.failed(_lost("hello")) == CUT
        assert redial.attempt() == 0
        assert 0 <= redial.delay() <= 0.2


def test_resets_get_a_grace_then_back_off_like_refusals() -> None:
    """The first RESET_GRACE resets in a row are taken for a bad link; more look like a proxy
    refusing dials and back off exponentially; a cut between them (the path reached the server)
    starts the run over, and a welcome starts everything over."""
    redial = Redial(Backoff())
    for _ in range(RESET_GRACE):
        assert redial.failed(_lost("upgrade")) == RESET
        assert redial.attempt() == 0
    for n in range(1, 4):
        redial.failed(_lost("tls"))
        assert redial.attempt() == n
    redial.failed(_lost("hello"))
    redial.failed(_lost("upgrade"))
    assert redial.attempt() == 0
    redial.failed(HTTPError(503))
    assert redial.attempt() == 1
    redial.welcomed()
    assert redial.attempt() == 0
