"""``reconnects`` counts sessions established after the first, ``dial_failures`` the connection
attempts that failed: in ``Worker.stats()``, the health probe's JSON and the Prometheus
counters, against the real mock server."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import pytest
from _worker_helpers import make_worker, running

from orbit_sync.contrib.health import HealthProbe
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import SessionEvent, WorkerListener

prometheus_client = pytest.importorskip("prometheus_client")
from orbit_sync.contrib.prometheus import PrometheusListener  # noqa: E402


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server."""
    with MockOrbitServer() as srv:
        yield srv


class _Sessions(WorkerListener):
    """Hands each established session to the test."""

    def __init__(self) -> None:
        self.events: queue.Queue[SessionEvent] = queue.Queue()

    def connected(self, event: SessionEvent) -> None:
        self.events.put(event)


def _counts(worker: Any, probe: HealthProbe, registry: Any) -> dict[str, tuple[Any, ...]]:
    stats = worker.stats()
    state = probe.state()
    return {
        "reconnects": (
            stats.reconnects,
            state["reconnects"],
            registry.get_sample_value("orbit_reconnects_total"),
        ),
        "dial_failures": (
            stats.dial_failures,
            state["dial_failures"],
            registry.get_sample_value("orbit_dial_failures_total"),
        ),
    }


def test_failed_dials_are_counted_apart_from_reconnects(server: MockOrbitServer) -> None:
    """Three refused dials before the first welcome are 3 dial failures and 0 reconnects; a
    session lost and re-established is then 1 reconnect, everywhere it is shown."""
    server.faults.refuse_connections(count=3, status=503)
    probe = HealthProbe()
    registry = prometheus_client.CollectorRegistry()
    sessions = _Sessions()
    worker = make_worker(server, listeners=[probe, PrometheusListener(registry=registry), sessions])
    worker.register("noop", lambda ctx, payload: None)
    with running(worker):
        assert sessions.events.get(timeout=10).reconnect is False
        assert _counts(worker, probe, registry) == {
            "reconnects": (0, 0, 0.0),
            "dial_failures": (3, 3, 3.0),
        }
        server.disconnect()
        assert sessions.events.get(timeout=10).reconnect is True
        assert _counts(worker, probe, registry) == {
            "reconnects": (1, 1, 1.0),
            "dial_failures": (3, 3, 3.0),
        }
