"""Prometheus metrics and a health endpoint for a Worker, against the embedded mock server.

    pip install 'orbit-sync[prometheus,testing]'
    python examples/prometheus_metrics.py

Runs a few tasks, then prints what a Prometheus scrape of ``/metrics`` and a Kubernetes probe of
``/readyz`` would see. In a real deployment, call ``start_http_server(9100)`` (prometheus_client)
and ``probe.serve(port=8080, host="0.0.0.0")`` (a kubelet connects to the pod's address; the
default is loopback) once at startup and point the scraper and the probes at them.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from orbit_sync.client import Client
from orbit_sync.contrib.health import HealthProbe
from orbit_sync.contrib.prometheus import PrometheusListener
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import Fail, TaskContext, Worker

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


def main() -> None:
    """Run three tasks with metrics and a health probe; print the scrape and the probe."""
    registry = CollectorRegistry()  # the global REGISTRY is the default; a private one here
    probe = HealthProbe()
    with MockOrbitServer(assignment_rate=None) as server:
        worker = Worker(
            Client(server.url, server.token),
            queue_id=server.queue_id,
            capacity=2,
            handle_signals=False,
            listeners=[PrometheusListener(registry=registry), probe],
        )

        @worker.handler("resize")
        def resize(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
            if payload["w"] < 0:
                raise Fail("BAD_SIZE", "width must be positive")
            return {"w": payload["w"] // 2}

        with probe.serve(port=0, host="127.0.0.1") as health, worker:
            assert worker.wait_ready(10)
            ids = [server.enqueue("resize", {"w": w}) for w in (640, 320, -1)]
            for task_id in ids:
                server.wait_for(task_id, DONE)
            url = f"http://127.0.0.1:{health.port}/readyz"
            with urllib.request.urlopen(url, timeout=5) as answer:
                print(f"GET /readyz -> {answer.status} {json.loads(answer.read())['connected']}")
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(("orbit_attempts_total", "orbit_attempts_in_flight", "orbit_connected")):
            print(line)


if __name__ == "__main__":
    main()
