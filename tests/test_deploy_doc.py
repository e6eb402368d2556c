"""docs/deploy.md states signals, timeouts, exit statuses, probe paths and ports: each value it
states is the one the code uses."""

from __future__ import annotations

import inspect
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _worker_helpers import make_worker, running
from prometheus_client import CollectorRegistry

from orbit_sync import _cli_report, cli
from orbit_sync._supervisor import _cli as supervisor_cli
from orbit_sync._supervisor import _observe, _policy, _supervisor, _wire
from orbit_sync.contrib.prometheus import PrometheusListener
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import SessionEvent, TaskContext, Worker, WorkerListener
from orbit_sync.worker.runtime import _shutdown

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "deploy.md").read_text()
DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(Worker).parameters.items()
    if name in ("drain_timeout", "cancel_grace", "flush_timeout")
}
BOUND = sum(DEFAULTS.values()) + _supervisor.STOP_MARGIN


def find(pattern: str) -> re.Match[str]:
    """The page's text matching *pattern* (whitespace-insensitive); fails if absent."""
    match = re.search(pattern.replace(" ", r"\s+"), PAGE)
    assert match, f"docs/deploy.md no longer says {pattern!r}"
    return match


def test_worker_defaults_and_the_stop_bound() -> None:
    """The three defaults, the margin, the bound's arithmetic and the orphan bound."""
    for name, value in DEFAULTS.items():
        assert float(find(rf"`{name}` \(default `(\d+)` s\)").group(1)) == value
    assert float(find(r"flush_timeout \+ (\d+)` seconds after").group(1)) == (
        _supervisor.STOP_MARGIN
    )
    a, b, c, d, total = map(float, find(r"(\d+) \+ (\d+) \+ (\d+) \+ (\d+) = (\d+) s").groups())
    assert (a, b, c) == (
        DEFAULTS["drain_timeout"],
        DEFAULTS["cancel_grace"],
        DEFAULTS["flush_timeout"],
    )
    assert d == _supervisor.STOP_MARGIN and total == BOUND
    allowance, orphan = map(
        float, find(r"flush_timeout \+ ([\d.]+)` seconds \(([\d.]+) s").groups()
    )
    assert allowance == _shutdown.CLOSE_ALLOWANCE
    assert orphan == sum(DEFAULTS.values()) + _shutdown.CLOSE_ALLOWANCE
    drain, needed = map(float, find(r"--drain-timeout (\d+)` needs at least (\d+)").groups())
    assert needed == drain + DEFAULTS["cancel_grace"] + DEFAULTS["flush_timeout"] + d


def test_process_manager_timeouts_exceed_the_bound() -> None:
    """Kubernetes, systemd and supervisord are given more than the supervisor's stop bound."""
    for pattern in (
        r"terminationGracePeriodSeconds: (\d+)\n",
        r"TimeoutStopSec=(\d+)\n",
        r"stopwaitsecs=(\d+)\n",
    ):
        assert float(find(pattern).group(1)) > BOUND
    assert find(r"kills \(SIGKILL\) any process still running")  # what happens at the bound


def test_signals_are_the_ones_handled() -> None:
    """KillSignal and stopsignal name a signal the supervisor drains on."""
    names = {s.name for s in _supervisor._STOP_SIGNALS}
    assert names == {"SIGTERM", "SIGINT"} and "first SIGTERM or SIGINT" in PAGE
    assert find(r"KillSignal=(\w+)").group(1) in names
    assert "SIG" + find(r"stopsignal=(\w+)").group(1) in names


def test_exit_statuses_and_their_order() -> None:
    """The status table names every status of the command, and the stated order is the code's."""
    rows = dict(re.findall(r"^\| (\d) \| (.+) \|$", PAGE, re.M))
    codes = {
        _cli_report.EXIT_OK: "clean stop",
        _cli_report.EXIT_FAILED: "failed",
        _cli_report.EXIT_USAGE: "configuration error",
        _cli_report.EXIT_FORCED: "forced stop",
        _cli_report.EXIT_AUTH: "credentials",
        _cli_report.EXIT_PROTOCOL: "protocol",
        _cli_report.EXIT_UNREACHABLE: "not reached",
    }
    assert {int(k) for k in rows} == set(codes)
    for code, word in codes.items():
        assert word in rows[str(code)]
    order = [int(x) for x in find(r"(\d( < \d){6})").group(1).split(" < ")]
    assert tuple(order) == _policy.SEVERITY
    fatal = {int(x) for x in find(r"Statuses (\d), (\d), (\d) and (\d) \(").groups()}
    assert fatal == _policy.FATAL_AT_START
    assert {int(x) for x in find(r"RestartPreventExitStatus=([\d ]+)\n").group(1).split()} == fatal
    assert {int(x) for x in find(r"exitcodes=([\d,]+)\n").group(1).split(",")} == fatal | {0}


def test_restart_and_report_timings() -> None:
    """Restart delays, the give-up count, the report interval and the staleness bound."""
    backoff = _policy.RESTART_BACKOFF
    assert float(find(r"at most ([\d.]+) s\. Its running").group(1)) == backoff.cap(0)
    lo1, hi1, lo2, hi2 = map(
        float, find(r"\(([\d.]+)-([\d.]+) s, then ([\d.]+)-([\d.]+) s").groups()
    )
    assert (lo1, hi1, lo2, hi2) == (
        backoff.cap(1) / 2,
        backoff.cap(1),
        backoff.cap(2) / 2,
        backoff.cap(2),
    )
    assert int(find(r"After (\d+) such deaths in a row").group(1)) == _policy.START_FAILURES
    assert float(find(r"supervisor every ([\d.]+) s").group(1)) == _wire.STATE_INTERVAL
    assert float(find(r"has not reported for (\d+) s").group(1)) == _observe.STALE_REPORT
    low, high = map(int, find(r"one supervisor \((\d+)-(\d+)\)").groups())
    assert (low, high) == (1, supervisor_cli.MAX_PROCESSES)


def test_options_exist_and_ports_match_the_probes(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option the page names is accepted; the manifest's ports are the probes' ports."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["worker", "--help"])
    assert exited.value.code == 0
    known = set(re.findall(r"(--[a-z][a-z-]+)", capsys.readouterr().out))
    # Every option on the page but the benchmarks' (`benchmarks/run.py --only=...`, and what
    # follows `benchmarks/rollout.py` on its line or in its code span).
    page = re.sub(r"rollout\.py[^`]*", "", PAGE)
    named = set(re.findall(r"(?<!run\.py )(--[a-z][a-z-]+)", page))
    assert named - {"--drain-timeout"} and named <= set(known), named - set(known)
    health = find(r"--health-port=(\d+)").group(1)
    assert re.findall(r"port: (\d+)\}", PAGE) == [health, health]
    assert find(r'prometheus.io/port: "(\d+)"').group(1) == find(r"--metrics-port=(\d+)").group(1)
    assert find(r"--http-host=([\d.]+)\n").group(1) == "0.0.0.0"  # reachable by the kubelet


def test_probe_paths_are_served() -> None:
    """Every path the page sends a probe to is answered (200 or 503, never 404)."""
    paths = set(re.findall(r"(/(?:livez|readyz|healthz|[a-z]+z))\b", PAGE))
    assert paths == {"/livez", "/readyz", "/healthz"}
    health = _observe.HostHealth(1)
    server = health.serve(port=0, host="127.0.0.1")
    try:
        for path in sorted(paths):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}") as r:
                    status = r.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status in (200, 503), path
    finally:
        server.close()


def test_the_keda_query_reads_the_saturation_of_a_pool_with_a_draining_pod() -> None:
    """The ScaledObject's query, summed over two real workers' metrics (two pods): 4 + 2 of
    4 + 4 slots busy read 0.75; once the first pod drains (its 4 handlers running on) its slots
    and its busy ones leave the sum: 2 of 4, 0.5, under the threshold, not (4 + 2) / 4."""
    query = find(r"query: (.+)\n").group(1)
    match = re.fullmatch(
        r"sum\((\w+)\{[^}]*\}\) / clamp_min\(sum\((\w+)\{[^}]*\}\), 1\)", query.strip()
    )
    assert match, query
    busy_name, slots_name = match.groups()
    threshold = float(
        find(r'metricType: Value\n\s+metadata:(?:\n.*)*?threshold: "(0\.\d+)"').group(1)
    )
    release = threading.Event()
    started = threading.Semaphore(0)
    pods: dict[Worker, threading.Event] = {}

    class Offered(WorkerListener):
        def __init__(self) -> None:
            self.event = threading.Event()

        def connected(self, event: SessionEvent) -> None:
            self.event.set()  # after the metrics' own listener, which comes first

    def pod(server: MockOrbitServer) -> tuple[Worker, CollectorRegistry]:
        registry = CollectorRegistry()
        offered = Offered()
        worker = make_worker(
            server, capacity=4, listeners=[PrometheusListener(registry=registry), offered]
        )
        pods[worker] = offered.event

        @worker.handler("hold")
        def hold(ctx: TaskContext, payload: Any) -> Any:
            started.release()
            release.wait(10)
            return {}

        return worker, registry

    def saturation(*registries: CollectorRegistry) -> float:
        def total(name: str) -> float:
            return sum(r.get_sample_value(name) or 0.0 for r in registries)

        return total(busy_name) / max(total(slots_name), 1.0)

    def hold(server: MockOrbitServer, n: int) -> list[str]:
        ids = [server.enqueue("hold", {}) for _ in range(n)]
        for _ in ids:
            assert started.acquire(timeout=10)
        return ids

    with MockOrbitServer(assignment_rate=None) as server:
        try:
            (first, one), (second, two) = pod(server), pod(server)
            with running(first):
                assert pods[first].wait(10)
                ids = hold(server, 4)  # the first pod is full
                assert saturation(one) == 1.0
                with running(second):
                    assert pods[second].wait(10)
                    ids += hold(server, 2)  # only the second has free slots
                    assert saturation(one, two) == 0.75
                    assert two.get_sample_value("orbit_slot_wait_seconds_count") == 2
                    first.request_stop()  # scaled in, or rolled: it drains
                    server.wait_until(lambda s: any(x.draining for x in s.sessions()), 10)
                    assert one.get_sample_value(slots_name) == 0
                    assert saturation(one, two) == 0.5 < threshold
                    release.set()
                    for task_id in ids:
                        server.wait_for(task_id, {"SUCCEEDED"})
        finally:
            release.set()  # a failed check must not leave handlers waiting
