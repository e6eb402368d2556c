"""OpenTelemetry spans, Prometheus metrics and the health probe, on a real worker and server."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _worker_helpers import make_worker, running
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from orbit_sync.contrib import health
from orbit_sync.contrib.health import HealthProbe, check_heartbeat
from orbit_sync.contrib.otel import OpenTelemetryListener
from orbit_sync.contrib.prometheus import LEASE_LOSS_REASONS, PrometheusListener
from orbit_sync.models import Outcome
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import (
    AttemptEvent,
    AttemptFinished,
    DisconnectEvent,
    DrainEvent,
    Fail,
    LeaseEvent,
    SessionEvent,
    ShutdownReport,
    StuckEvent,
    TaskContext,
)

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def server() -> Any:
    """A mock server that assigns at once."""
    with MockOrbitServer(assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


def test_otel_span_per_attempt(server: MockOrbitServer) -> None:
    """Each attempt is one CONSUMER span with ids, handler and outcome; handler spans nest in it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("user-code")
    worker = make_worker(server, listeners=[OpenTelemetryListener(tracer_provider=provider)])

    @worker.handler("resize")
    def resize(ctx: TaskContext, payload: Any) -> Any:
        with tracer.start_as_current_span("download"):
            pass
        if payload == "fail":
            raise Fail("BAD_SIZE")
        if payload == "crash":
            raise ValueError("token=hunter2")
        return {"ok": True}

    with running(worker):
        ids = {p: server.enqueue("resize", p) for p in ("ok", "fail", "crash")}
        for task_id in ids.values():
            server.wait_for(task_id, DONE)
    provider.force_flush()
    spans = exporter.get_finished_spans()
    attempts = {s.attributes["orbit.task_id"]: s for s in spans if s.name == "orbit.process resize"}
    assert set(attempts) == set(ids.values())
    ok, fail, crash = (attempts[ids[p]] for p in ("ok", "fail", "crash"))
    assert ok.kind is trace.SpanKind.CONSUMER
    assert (
        ok.attributes["orbit.outcome"] == "SUCCEEDED" and ok.attributes["orbit.handler"] == "resize"
    )
    assert ok.attributes["orbit.attempt"] == 1 and ok.attributes["orbit.finish_delivered"] is True
    assert len(str(ok.attributes["orbit.attempt_id"])) == 32
    assert ok.status.status_code is trace.StatusCode.UNSET
    assert (fail.attributes["orbit.outcome"], fail.attributes["orbit.error_code"]) == (
        "FAILED",
        "BAD_SIZE",
    )
    assert fail.status.status_code is trace.StatusCode.ERROR
    assert [e.attributes["exception.type"] for e in crash.events] == ["ValueError"]
    assert "hunter2" not in repr([dict(s.attributes or {}) for s in spans])
    downloads = [s for s in spans if s.name == "download"]
    assert len(downloads) == 3
    assert {d.parent.span_id for d in downloads} == {  # type: ignore[union-attr]
        s.context.span_id for s in attempts.values()
    }


def test_prometheus_listener_counts_events() -> None:
    """Outcomes, durations, in-flight, renewal lag, losses and sessions land in the metrics."""
    registry = CollectorRegistry()
    metrics = PrometheusListener(registry=registry)
    started = AttemptEvent("t" * 32, "a" * 32, "resize", 1, 3)
    metrics.attempt_received(started)
    metrics.attempt_started(started)
    value = registry.get_sample_value
    assert value("orbit_attempts_in_flight", {"handler": "resize"}) == 1
    metrics.lease_renewed(LeaseEvent("t" * 32, "a" * 32, "resize", lag=0.02))
    metrics.lease_lost(LeaseEvent("t" * 32, "a" * 32, "resize", reason="lease_lost"))
    metrics.attempt_finished(
        AttemptFinished("t" * 32, "a" * 32, "resize", 1, Outcome.FAILED, "X", 0.5, True, False)
    )
    metrics.connected(SessionEvent("s" * 32, reconnect=False))
    assert value("orbit_connected") == 1
    assert value("orbit_attempts_in_flight", {"handler": "resize"}) == 0
    assert value("orbit_attempts_total", {"handler": "resize", "outcome": "FAILED"}) == 1
    assert value("orbit_attempts_received_total", {"handler": "resize"}) == 1
    assert value("orbit_finishes_undelivered_total", {"handler": "resize"}) == 1
    assert value("orbit_attempt_duration_seconds_sum", {"handler": "resize", "outcome": "FAILED"})
    assert value("orbit_lease_renewal_lag_seconds_bucket", {"le": "0.025"}) == 1
    assert value("orbit_lease_renewal_lag_seconds_bucket", {"le": "0.01"}) == 0
    assert value("orbit_lease_losses_total", {"reason": "lease_lost"}) == 1


def test_prometheus_listener_follows_the_stuck_slots() -> None:
    """orbit_slots_stuck follows the handlers finished UNKNOWN that still run, up and down."""
    registry = CollectorRegistry()
    metrics = PrometheusListener(registry=registry)
    assert registry.get_sample_value("orbit_slots_stuck") == 0
    for n, stuck in enumerate([1, 2]):
        metrics.handler_stuck(StuckEvent("t" * 32, f"{n:032x}", "resize", "time_limit", stuck, 4))
    assert registry.get_sample_value("orbit_slots_stuck") == 2
    metrics.handler_unstuck(StuckEvent("t" * 32, "0" * 32, "resize", "time_limit", 1, 4))
    assert registry.get_sample_value("orbit_slots_stuck") == 1


def test_prometheus_listener_follows_slots_offered_busy_and_waited_for() -> None:
    """orbit_slots is the capacity while connected and not draining; orbit_slots_busy counts
    running handlers and stuck ones; each start observes its assignment's wait once."""
    registry = CollectorRegistry()
    metrics = PrometheusListener(registry=registry)
    value = registry.get_sample_value
    metrics.connected(SessionEvent("s" * 32, reconnect=False, capacity=4))
    assert value("orbit_slots") == 4 and value("orbit_slots_busy") == 0
    a, b = (AttemptEvent("t" * 32, n * 32, "resize", 1, 3) for n in "ab")
    for event in (a, b):
        metrics.attempt_received(event)
    metrics.attempt_started(a)
    assert value("orbit_slots_busy") == 1 and value("orbit_slot_wait_seconds_count") == 1
    # b never ran (its start was refused): no wait observed, nothing busy.
    metrics.attempt_finished(
        AttemptFinished("t" * 32, "b" * 32, "resize", 1, Outcome.FAILED, "X", None, False, True)
    )
    metrics.handler_stuck(StuckEvent("t" * 32, "a" * 32, "resize", "time_limit", 1, 4))
    metrics.attempt_finished(
        AttemptFinished("t" * 32, "a" * 32, "resize", 1, Outcome.UNKNOWN, "X", 9.0, True, True)
    )
    assert value("orbit_slots_busy") == 1, "a stuck handler still holds its slot"
    metrics.handler_unstuck(StuckEvent("t" * 32, "a" * 32, "resize", "time_limit", 0, 4))
    assert value("orbit_slots_busy") == 0 and value("orbit_slot_wait_seconds_count") == 1
    metrics.draining(DrainEvent(True, 30.0, 0))
    assert value("orbit_slots") == 0
    metrics.connected(SessionEvent("s" * 32, reconnect=True, capacity=4))
    metrics.disconnected(DisconnectEvent("WorkerDisconnected"))
    assert value("orbit_slots") == 0


def test_prometheus_busy_slots_count_only_while_slots_are_offered() -> None:
    """A handler running on through a disconnect or a drain holds no offered slot:
    orbit_slots_busy reads 0 with orbit_slots then (orbit_attempts_in_flight still counts it),
    and counts it again once the slots are offered."""
    registry = CollectorRegistry()
    metrics = PrometheusListener(registry=registry)
    value = registry.get_sample_value
    metrics.connected(SessionEvent("s" * 32, reconnect=False, capacity=4))
    metrics.attempt_started(AttemptEvent("t" * 32, "a" * 32, "resize", 1, 3))
    assert value("orbit_slots") == 4 and value("orbit_slots_busy") == 1
    metrics.disconnected(DisconnectEvent("WorkerDisconnected"))
    assert value("orbit_slots") == 0 and value("orbit_slots_busy") == 0
    assert value("orbit_attempts_in_flight", {"handler": "resize"}) == 1
    metrics.connected(SessionEvent("s" * 32, reconnect=True, capacity=4))
    assert value("orbit_slots_busy") == 1
    metrics.draining(DrainEvent(True, 30.0, 1))
    assert value("orbit_slots") == 0 and value("orbit_slots_busy") == 0
    metrics.handler_stuck(StuckEvent("t" * 32, "b" * 32, "resize", "shutdown", 1, 4))
    metrics.connected(SessionEvent("s" * 32, reconnect=True, capacity=0))  # drained: 0 offered
    assert value("orbit_slots") == 0 and value("orbit_slots_busy") == 0
    assert value("orbit_attempts_in_flight", {"handler": "resize"}) == 1


def test_prometheus_loss_and_undelivered_counters_read_zero_before_the_first() -> None:
    """Every lease-loss reason a worker reports, and each declared handler's undelivered
    finishes, read 0 before anything happened (an alert reads 0, not "no data")."""
    registry = CollectorRegistry()
    metrics = PrometheusListener(registry=registry)
    value = registry.get_sample_value
    for reason in LEASE_LOSS_REASONS:
        assert f"``{reason}``" in (LeaseEvent.__doc__ or "")  # the reasons a worker reports
        assert value("orbit_lease_losses_total", {"reason": reason}) == 0
    assert value("orbit_finishes_undelivered_total", {"handler": "resize"}) is None
    metrics.declare_handlers(["resize", "send"])
    for handler in ("resize", "send"):
        assert value("orbit_finishes_undelivered_total", {"handler": handler}) == 0


def test_prometheus_example_runs() -> None:
    """examples/prometheus_metrics.py runs tasks and prints the scrape and the readiness probe."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "prometheus_metrics.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "GET /readyz -> 200 True" in lines
    assert 'orbit_attempts_total{handler="resize",outcome="SUCCEEDED"} 2.0' in lines
    assert 'orbit_attempts_total{handler="resize",outcome="FAILED"} 1.0' in lines
    assert 'orbit_attempts_in_flight{handler="resize"} 0.0' in lines


def test_health_probe_states() -> None:
    """Ready needs a session and no drain; live fails when running work sees no renewal."""
    clock = ManualClock(100.0)
    probe = HealthProbe(stale_after=10.0, clock=clock)
    assert probe.state()["live"] and not probe.state()["ready"]
    probe.connected(SessionEvent("s" * 32, reconnect=False))
    clock.advance(4)
    state = probe.state()
    assert state["ready"] and state["connected"] and state["session_age_s"] == 4.0
    probe.attempt_started(AttemptEvent("t" * 32, "a" * 32, "resize", 1, 3))
    clock.advance(8)
    probe.lease_renewed(LeaseEvent("t" * 32, "a" * 32, "resize"))
    clock.advance(9)
    assert probe.state()["live"] and probe.state()["last_renewal_age_s"] == 9.0
    clock.advance(2)  # 11 s with a handler running and no renewal: wedged
    assert not probe.state()["live"]
    probe.attempt_finished(
        AttemptFinished("t" * 32, "a" * 32, "resize", 1, Outcome.SUCCEEDED, None, 1.0, True, True)
    )
    assert probe.state()["live"] and probe.state()["in_flight"] == 0
    probe.draining(DrainEvent(drain=True, timeout=30.0, running=0))
    assert not probe.state()["ready"] and probe.state()["live"]
    probe.stopped(ShutdownReport(drained=True))
    assert not probe.state()["live"] and not probe.state()["connected"]


def _get(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        body = err.read()
        return err.code, json.loads(body) if err.code == 503 else body


def test_health_endpoint_and_heartbeat_follow_a_real_worker(
    server: MockOrbitServer, tmp_path: Path
) -> None:
    """/readyz and /livez, and the heartbeat file, follow the worker from start to stop."""
    probe = HealthProbe()
    worker = make_worker(server, listeners=[probe])

    @worker.handler("resize")
    def resize(ctx: TaskContext, payload: Any) -> Any:
        return {}

    beat_path = tmp_path / "health.json"
    with probe.serve(port=0, host="127.0.0.1") as endpoint:
        assert _get(endpoint.port, "/readyz")[0] == 503
        beat = probe.write_heartbeat(beat_path, interval=60.0)
        with running(worker):
            status, state = _get(endpoint.port, "/readyz")
            assert status == 200 and state["connected"]
            assert "session_id" not in state
            assert _get(endpoint.port, "/livez")[0] == 200
            assert _get(endpoint.port, "/nope")[0] == 404
            beat.write()
            assert check_heartbeat(beat_path) == (True, "ok")
        assert _get(endpoint.port, "/healthz")[0] == 503
        beat.close()
    assert json.loads(beat_path.read_text())["stopped"] is True
    assert check_heartbeat(beat_path) == (False, "worker is not live")
    assert health.main([str(beat_path)]) == 1
    assert health.main([str(tmp_path / "missing.json")]) == 1


def test_heartbeat_check_passes_on_a_fresh_live_file(tmp_path: Path) -> None:
    """The exec-probe command exits 0 on a fresh, live heartbeat and 1 on a stale one."""
    probe = HealthProbe()
    path = tmp_path / "beat.json"
    beat = probe.write_heartbeat(path, interval=60.0)
    beat.close()
    cmd = [sys.executable, "-m", "orbit_sync.contrib.health", str(path), "--max-age", "30"]
    assert subprocess.run(cmd, capture_output=True, timeout=30, check=False).returncode == 0
    assert health.main([str(path), "--max-age", "0"]) == 1


def test_missing_extras_name_the_extra() -> None:
    """Without opentelemetry-api or prometheus_client, importing the module says what to install."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry"] = None
        sys.modules["prometheus_client"] = None
        for name in ("otel", "prometheus"):
            try:
                __import__(f"orbit_sync.contrib.{name}")
            except ImportError as exc:
                print(exc)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    assert "pip install 'orbit-sync[otel]'" in proc.stdout
    assert "pip install 'orbit-sync[prometheus]'" in proc.stdout


def test_an_unreadable_heartbeat_is_named_with_its_path_and_reason(tmp_path: Path) -> None:
    """The exec probe names the heartbeat file it could not read and why (missing, not JSON)."""
    missing = tmp_path / "missing.json"
    cmd = [sys.executable, "-m", "orbit_sync.contrib.health", str(missing), "--max-age", "30"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 1
    assert done.stdout + done.stderr == (
        f"cannot read heartbeat {missing}: No such file or directory\n"
    )
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    ok, why = check_heartbeat(broken)
    assert not ok and why.startswith(f"cannot read heartbeat {broken}: not JSON (")
