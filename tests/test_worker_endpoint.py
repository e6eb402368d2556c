"""A URL that is not a ``pulse.worker.v1`` endpoint: retried for a bounded time, then the worker
stops with an error that says so (``orbit-sync worker`` exits 5), against the real mock server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _worker_helpers import FailedDials, run_until_it_gives_up

from orbit_sync import Client
from orbit_sync._cli_report import EXIT_PROTOCOL, exit_status_for
from orbit_sync.errors import HTTPError
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import Backoff, Worker
from orbit_sync.worker.core._errors import FirstContact

URL = "ws://127.0.0.1:1"


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server."""
    with MockOrbitServer() as srv:
        yield srv


def test_a_wrong_path_stops_the_worker_after_the_window(server: MockOrbitServer) -> None:
    """Every dial answered 404 (a wrong path) for 60 s of the worker's clock: run() raises an
    HTTPError that names the URL and the status, and the CLI maps it to exit 5."""
    clock = ManualClock(0.0)
    worker = Worker(
        Client(server.url + "/not-orbit", server.token),
        queue_id=server.queue_id,
        clock=clock,
        handle_signals=False,
        reconnect_backoff=Backoff(initial=5.0, maximum=10.0),
    )

    @worker.handler("echo")
    def echo(ctx: Any, payload: Any) -> Any:
        return payload

    with FailedDials() as dials:
        # After each failed dial the connection thread waits out its backoff on the fake clock:
        # let that pass at once, until the worker gives up.
        exc = run_until_it_gives_up(worker, clock, dials)
    assert exc is not None, "the worker kept retrying a URL that is not an endpoint"
    assert isinstance(exc, HTTPError) and exc.status_code == 404
    assert f"{server.url}/not-orbit is not a pulse.worker.v1 endpoint" in str(exc)
    assert "answered HTTP 404" in str(exc)
    assert 3 <= dials.count <= 8  # 60 s of 10 s pauses, then it stopped
    assert exit_status_for(exc) == EXIT_PROTOCOL


def test_wrong_endpoint_answers_are_retried_within_the_window() -> None:
    """Fewer than three dials, or less than the window: retry."""
    now = [0.0]
    check = FirstContact(lambda: now[0], None, window=60.0, dials=3)
    assert check.wrong_endpoint(HTTPError(404), URL) is None
    now[0] = 100.0
    assert check.wrong_endpoint(HTTPError(404), URL) is None  # only the second dial
    stop = check.wrong_endpoint(HTTPError(404), URL)
    assert stop is not None and stop.status_code == 404


@pytest.mark.parametrize("status", [401, 403, 408, 429, 500, 502, 503])
def test_busy_and_credential_answers_are_not_wrong_endpoints(status: int) -> None:
    """A busy server (408/429/5xx) is retried without end; credentials are judged elsewhere."""
    now = [0.0]
    check = FirstContact(lambda: now[0], None, window=60.0, dials=3)
    for _ in range(10):
        now[0] += 100.0
        assert check.wrong_endpoint(HTTPError(status), URL) is None


def test_a_url_that_once_connected_is_retried_without_end() -> None:
    """After a welcome, a 404 (an ingress during a deploy) never stops the worker."""
    now = [0.0]
    check = FirstContact(lambda: now[0], None, window=60.0, dials=3)
    check.connected()
    for _ in range(10):
        now[0] += 100.0
        assert check.wrong_endpoint(HTTPError(404), URL) is None


def test_another_failure_restarts_the_count() -> None:
    """A network failure between 404s (the server restarting) starts the window again."""
    now = [0.0]
    check = FirstContact(lambda: now[0], None, window=60.0, dials=3)
    check.wrong_endpoint(HTTPError(404), URL)
    check.wrong_endpoint(HTTPError(404), URL)
    now[0] = 100.0
    check.wrong_endpoint(ConnectionRefusedError(), URL)
    assert check.wrong_endpoint(HTTPError(404), URL) is None
