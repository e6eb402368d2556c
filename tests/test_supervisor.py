"""``orbit-sync worker --processes N``: a supervisor of real worker processes against an
in-process mock server, driven with real signals."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _cli_process import Proc, clean_env, command
from _supervisor_chaos import children_of, wait_gone

from orbit_sync.contrib.health import HealthProbe
from orbit_sync.testing import MockOrbitServer

APP = Path(__file__).with_name("_supervised_app.py")
pytestmark = pytest.mark.slow  # real processes: a second or more each


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory holding the worker module."""
    shutil.copy(APP, tmp_path / "app.py")
    return tmp_path


def env_for(server: MockOrbitServer, **extra: str) -> dict[str, str]:
    """What the module reads to reach *server* (*extra* may replace any of it)."""
    orbit = {
        "ORBIT_URL": server.url,
        "ORBIT_TOKEN": server.token,
        "ORBIT_QUEUE_ID": server.queue_id,
    }
    return clean_env(**{**orbit, **extra})


#: ``orbit-sync`` whose supervisor restarts children after 0.05-0.4 s instead of 0.5-16 s: for
#: tests of *whether* it restarts (the delays themselves: test_supervisor_units.py).
SHORT_RESTART_BACKOFF = """
from orbit_sync._supervisor import _policy
from orbit_sync.cli import main
from orbit_sync.worker import Backoff

_policy.RESTART_BACKOFF = Backoff(initial=0.05, maximum=0.4)
raise SystemExit(main())
"""


def start(
    procs: list[Proc],
    server: MockOrbitServer,
    project: Path,
    *args: str,
    short_backoff: bool = False,
    **env: str,
) -> Proc:
    """``orbit-sync worker app:make *args`` for *server*, stopped at teardown if still running
    (*short_backoff*: with :data:`SHORT_RESTART_BACKOFF`)."""
    argv = command("worker", "app:make", *args)
    if short_backoff:
        argv = [sys.executable, "-c", SHORT_RESTART_BACKOFF, "worker", "app:make", *args]
    proc = Proc(argv, env=env_for(server, **env), cwd=project)
    procs.append(proc)
    return proc


def serving(server: MockOrbitServer, n: int, timeout: float = 30.0) -> list[str]:
    """Wait until *n* sessions are connected and not draining; their instance ids."""
    server.wait_until(lambda s: len(_serving(s)) == n, timeout)
    return _serving(server)


def _serving(server: MockOrbitServer) -> list[str]:
    return [s.instance_id for s in server.sessions() if s.connected and not s.draining]


def get(url: str) -> tuple[int, dict[str, object]]:
    """GET *url*: status and JSON body."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def probe(url: str, status: int, timeout: float = 10.0) -> dict[str, object]:
    """GET *url* every 0.1 s until it answers *status*; its JSON body."""
    stop = threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        got, body = get(url)
        if got == status:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} still answers {got}: {body}")
        stop.wait(0.1)


def port_line(proc: Proc, what: str) -> int:
    """The port the supervisor said it serves *what* on."""
    line = proc.wait_stderr(f"{what} of every worker process on port")
    return int(line.rsplit(" ", 1)[1])


@pytest.mark.orbit_server(assignment_rate=None)
def test_two_processes_share_the_queue_and_sigterm_drains_both(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """Two children with their own instance ids run tasks; one SIGTERM drains both; exit 0.
    Every line on the shared standard error names the process that wrote it."""
    proc = start(procs, orbit_server, project, "--processes", "2", "--health-port", "0")
    health = port_line(proc, "health")
    assert len(set(serving(orbit_server, 2))) == 2
    # Children report every half second: probe the way Kubernetes does, a few times.
    state = probe(f"http://127.0.0.1:{health}/readyz", 200)
    assert state["ready"] and len(state["processes"]) == 2  # type: ignore[arg-type]
    ids = [orbit_server.enqueue("echo", {"n": n}) for n in range(20)]
    for task_id in ids:
        assert orbit_server.wait_for(task_id, {"SUCCEEDED"}, timeout=15)
    assert proc.stop(signal.SIGTERM, timeout=30) == 0
    me = f"orbit-sync supervisor pid {proc.popen.pid}: "
    assert f"{me}SIGTERM received: draining 2 worker processes" in proc.stderr
    assert f"{me}supervisor stopped (2 processes started, 0 recycled, 0 restarted; exit 0)" in (
        proc.stderr
    )
    child = r"worker pid (\d+) slot ([01])"
    stopped = re.findall(rf"^orbit-sync {child}: worker stopped \(drained=True", proc.stderr, re.M)
    drains = re.findall(
        rf"^\[{child}\] .* the supervisor asks to drain: draining$", proc.stderr, re.M
    )
    assert sorted(stopped) == sorted(drains), proc.stderr
    assert {slot for _, slot in drains} == {"0", "1"}
    assert len({pid for pid, _ in drains}) == 2 and str(proc.popen.pid) not in dict(drains)
    # Log records (they start with their time) all carry a name; so do the command's lines.
    assert not re.search(r"^(\d{4}-\d\d-\d\d |orbit-sync: )", proc.stderr, re.M), proc.stderr
    assert orbit_server.token not in proc.stderr + proc.stdout


@pytest.mark.orbit_server(assignment_rate=None)
def test_second_signal_stops_every_child_at_once_and_exits_3(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """A second SIGINT is forwarded: running handlers are cancelled, the worst status (3) wins."""
    proc = start(procs, orbit_server, project, "--processes", "2", "--drain-timeout", "60")
    serving(orbit_server, 2)
    task_id = orbit_server.enqueue("slow", {"n": 1}, max_attempts=1)
    assert proc.line().startswith("started ")
    proc.popen.send_signal(signal.SIGINT)
    proc.wait_stderr("SIGINT received: draining 2 worker processes")
    orbit_server.wait_until(lambda s: all(x.draining for x in s.sessions() if x.connected), 10)
    proc.popen.send_signal(signal.SIGINT)
    assert proc.wait(30) == 3, proc.stderr
    assert "SIGINT received again: stopping worker processes now" in proc.stderr
    assert "worker stopped (drained=False, cancelled=1" in proc.stderr
    snap = orbit_server.wait_for(task_id, {"FAILED", "NEEDS_REVIEW"}, timeout=10)
    assert snap.error_code == "WORKER_SHUTDOWN"


@pytest.mark.orbit_server(assignment_rate=None)
def test_a_killed_child_is_restarted_and_work_goes_on(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """SIGKILL of a running child: the supervisor restarts it; the queue is served again."""
    argv = ("--processes", "2", "--health-port", "0")
    proc = start(procs, orbit_server, project, *argv, short_backoff=True)
    probe(f"http://127.0.0.1:{port_line(proc, 'health')}/readyz", 200)  # both seen ready
    (victim, *_) = sorted(children_of(proc.popen.pid))
    os.kill(victim, signal.SIGKILL)
    proc.wait_stderr(f"worker process {victim} was killed by SIGKILL unexpectedly; restarting")
    orbit_server.wait_until(lambda s: len(children_of(proc.popen.pid) - {victim}) == 2, 15)
    serving(orbit_server, 2)
    ids = [orbit_server.enqueue("echo", {"n": n}) for n in range(6)]
    for task_id in ids:
        assert orbit_server.wait_for(task_id, {"SUCCEEDED"}, timeout=15)
    assert proc.stop(signal.SIGTERM, timeout=30) == 0
    assert "1 restarted; exit 0" in proc.stderr


def probe_until(url: str, done: Callable[[dict[str, Any]], bool], timeout: float = 15.0) -> Any:
    """GET *url* every 0.1 s until its JSON body satisfies *done* (any status); that body."""
    stop = threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        _, body = get(url)
        if done(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} still answers {body}")
        stop.wait(0.1)


#: Every key a single worker's HealthProbe serves, and the host's list of its processes.
HOST_KEYS = set(HealthProbe().state()) | {"processes"}


@pytest.mark.orbit_server(assignment_rate=None)
def test_host_health_has_the_single_worker_keys_ready_then_draining(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """--health-port's JSON has every HealthProbe key at its top level, combined over the
    processes: ready and reached once both serve, then draining while a handler runs on."""
    argv = ("--processes", "2", "--health-port", "0", "--drain-timeout", "60")
    proc = start(procs, orbit_server, project, *argv)
    url = f"http://127.0.0.1:{port_line(proc, 'health')}/readyz"
    state = probe(url, 200)
    assert set(state) == HOST_KEYS, state
    assert state["status"] == "ready" and state["reached"] is True and state["connected"] is True
    assert state["unreached_s"] is None and state["dial_failures"] == 0
    assert isinstance(state["session_age_s"], float) and state["session_age_s"] >= 0
    orbit_server.enqueue("slow", {"n": 1}, max_attempts=1)
    assert proc.line().startswith("started ")
    proc.popen.send_signal(signal.SIGTERM)
    # The process running the handler reports its drain at once (the idle one may exit first).
    state = probe_until(
        url, lambda s: any(c.get("draining") and c.get("in_flight") for c in s["processes"])
    )
    assert state["status"] == "draining"
    assert state["ready"] is False and state["draining"] is True and state["in_flight"] == 1
    proc.popen.send_signal(signal.SIGTERM)  # the second: the handler is cancelled
    assert proc.wait(30) == 3, proc.stderr


def test_host_health_says_unreached_for_a_url_nothing_listens_on(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """Both processes fail every dial: the host's own status is unreached, reached false, with
    unreached_s and the dial failures of both processes; SIGTERM still exits 0."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # bound, never listening: every connection is refused
        nowhere = f"ws://127.0.0.1:{held.getsockname()[1]}"
        argv = ("--processes", "2", "--health-port", "0")
        proc = start(procs, orbit_server, project, *argv, ORBIT_URL=nowhere)
        url = f"http://127.0.0.1:{port_line(proc, 'health')}/readyz"
        state = probe_until(
            url, lambda s: all(c.get("dial_failures") for c in s.get("processes", ()))
        )
        assert set(state) == HOST_KEYS, state
        assert state["status"] == "unreached" and state["reached"] is False, state
        assert state["unreached_s"] > 0 and state["dial_failures"] >= 2
        assert state["ready"] is False and state["live"] is True and state["connected"] is False
        assert get(url)[0] == 503
        assert proc.stop(signal.SIGTERM, timeout=30) == 0, proc.stderr
    assert orbit_server.sessions() == ()


def test_a_refused_token_stops_the_supervisor_with_status_4(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """A child that exits 4 (credentials) before it was ready is not restarted: the supervisor
    stops the others and exits 4 with the child's message."""
    proc = start(
        procs, orbit_server, project, "--processes", "2", ORBIT_TOKEN="wrong-token-0123456789"
    )
    assert proc.wait(30) == 4
    assert re.search(
        r"worker process \d+ exited with status 4 before it was ready: worker stopped on"
        r" \w+: .*; not restarting it: stopping",
        proc.stderr,
    )
    assert "wrong-token-0123456789" not in proc.stderr


def test_a_memory_limit_below_the_idle_process_is_refused_with_its_rss(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """--max-memory-per-child 1 (every Python process holds more): the children exit 2 naming
    their own RSS before they connect, the supervisor says so once (not once per process as
    well) and stops with 2 instead of recycling forever."""
    proc = start(procs, orbit_server, project, "--processes", "2", "--max-memory-per-child", "1")
    assert proc.wait(30) == 2
    assert proc.stderr.count("--max-memory-per-child 1 is at or below") == 1, proc.stderr
    assert "running 2 worker processes" in proc.stderr
    assert re.search(
        r"worker process \d+ exited with status 2 before it was ready: error:"
        r" --max-memory-per-child 1 is at or below this worker process's own RSS after start"
        r" \(\d+ MB\).*; not restarting it: stopping",
        proc.stderr,
    ), proc.stderr
    assert orbit_server.sessions() == ()


def test_a_child_that_cannot_load_the_app_is_retried_then_given_up(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """An import error (status 1) is retried with backoff, then the supervisor stops with 1."""
    argv = ("--processes", "1")
    proc = start(procs, orbit_server, project, *argv, short_backoff=True, APP_IMPORT_ERROR="1")
    assert proc.wait(30) == 1
    assert proc.stderr.count("exited with status 1 before it was ready: cannot load app:make") == 3
    assert proc.stderr.count("; restarting it in") == 2
    assert "running 1 worker process of app:make," in proc.stderr  # not "1 worker processes"
    assert "not restarting it: stopping" in proc.stderr


@pytest.mark.orbit_server(assignment_rate=None)
def test_children_drain_and_exit_when_the_supervisor_is_killed(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
    tmp_path: Path,
) -> None:
    """SIGKILL of the supervisor: each child drains (its running handler finishes) and exits."""
    proc = start(procs, orbit_server, project, "--processes", "2")
    serving(orbit_server, 2)
    children = children_of(proc.popen.pid)
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    task_id = orbit_server.enqueue("gate", {"n": 1, "fifo": str(fifo)})
    assert proc.line().startswith("started ")
    proc.popen.kill()
    proc.popen.wait(10)  # not proc.wait(): the children still hold its output pipes
    # Each child drains: the busy one says so, and its handler still finishes.
    proc.wait_stderr("SIGTERM received: draining 1 task")
    # A child also sees its control pipe end (the guard where the kernel sends no SIGTERM). The
    # idle one may exit on its SIGTERM before its pipe watcher runs; the busy one, held until
    # released below, is certain to say so.
    proc.wait_stderr("the supervisor is gone: draining")
    release(fifo, "released", proc)
    assert orbit_server.wait_for(task_id, {"SUCCEEDED"}, timeout=15).result["line"] == "released"
    orbit_server.wait_until(lambda s: not any(x.connected for x in s.sessions()), 20)
    for pid in children:
        assert wait_gone(pid, 15), f"worker process {pid} outlived its supervisor"
    proc.wait()  # the children were the last holders of its output pipes


def release(fifo: Path, line: str, proc: Proc) -> None:
    """Write *line* to the gate handler blocked on *fifo* (which must be waiting on it)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:  # ENXIO: nobody reads it: the gated handler is gone
        raise AssertionError(f"the gated handler is not running ({exc}): {proc.stderr}") from None
    with os.fdopen(fd, "w") as out:
        out.write(line + "\n")


@pytest.mark.orbit_server(assignment_rate=None, lease_duration=2.0)
def test_recycling_starts_the_replacement_before_the_old_child_exits(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
    tmp_path: Path,
) -> None:
    """Past --max-tasks-per-child the child drains (a running task finishes) while its
    replacement is already serving: no capacity gap."""
    proc = start(
        procs,
        orbit_server,
        project,
        "--processes",
        "1",
        "--max-tasks-per-child",
        "3",
        APP_CAPACITY="4",
    )
    (first,) = serving(orbit_server, 1)
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    gated = orbit_server.enqueue("gate", {"n": 0, "fifo": str(fifo)})
    assert proc.line().startswith("started ")
    # The gate is the first task started, these two the second and third.
    for n in range(2):
        orbit_server.wait_for(orbit_server.enqueue("echo", {"n": n}), {"SUCCEEDED"}, 15)
    # The old child is draining (its gate still runs) and a new one serves the queue.
    orbit_server.wait_until(lambda s: _serving(s) not in ([], [first]), 30)
    old = [s for s in orbit_server.sessions() if s.instance_id == first and s.connected]
    assert old and old[0].draining
    after = orbit_server.enqueue("echo", {"n": 99})
    assert orbit_server.wait_for(after, {"SUCCEEDED"}, 15)
    release(fifo, "done", proc)
    assert orbit_server.wait_for(gated, {"SUCCEEDED"}, 15).result["line"] == "done"
    assert proc.stop(signal.SIGTERM, timeout=30) == 0
    assert "recycling this worker process after 3 tasks (--max-tasks-per-child 3)" in proc.stderr
    assert "1 recycled" in proc.stderr
    # The banner of each process says what the supervisor does, in words, not class names.
    assert "  supervisor: pid " in proc.stderr and "; recycled after 3 tasks" in proc.stderr
    assert "listeners: none" in proc.stderr
    assert "ChildLink" not in proc.stderr and "RecycleLimits" not in proc.stderr


@pytest.mark.orbit_server(assignment_rate=None)
def test_a_process_with_a_stuck_slot_is_recycled_and_the_host_keeps_serving(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """--time-limit 0.5: a handler blocked in C past its limit and the cancel grace finishes
    UNKNOWN HANDLER_TIMEOUT; its process (one stuck slot: the default --max-stuck-per-child)
    drains and is replaced, and the next task runs on the new one."""
    proc = start(procs, orbit_server, project, "--processes", "1", "--time-limit", "0.5")
    (first,) = serving(orbit_server, 1)
    hung = orbit_server.enqueue("hang", {"n": 0}, max_attempts=1)
    stuck_pid = int(proc.line().split()[1])  # "started PID 0"
    snap = orbit_server.wait_for(hung, {"NEEDS_REVIEW", "FAILED"}, 15)
    assert (snap.attempts[0].outcome.value, snap.attempts[0].error_code) == (
        "UNKNOWN",
        "HANDLER_TIMEOUT",
    )
    orbit_server.wait_until(lambda s: _serving(s) not in ([], [first]), 30)
    after = orbit_server.enqueue("echo", {"n": 1})
    assert orbit_server.wait_for(after, {"SUCCEEDED"}, 15).result["pid"] != stuck_pid
    assert proc.stop(signal.SIGTERM, timeout=30) == 0
    assert (
        "recycling this worker process after 1 of 2 slots stuck past a time limit"
        " (--max-stuck-per-child 1)" in proc.stderr
    )


@pytest.mark.orbit_server(assignment_rate=None, lease_duration=2.0, exact_recovery=True)
def test_recycling_burns_no_attempt(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
    tmp_path: Path,
) -> None:
    """Children recycled every 8 tasks while finishes keep freeing slots: what the server
    assigns a child before it applies the drain runs there, so 80 tasks allowed one attempt
    each all succeed, each handler run once."""
    marks = tmp_path / "marks"
    argv = ["--processes", "1", "--max-tasks-per-child", "8"]
    proc = start(
        procs, orbit_server, project, *argv, APP_CAPACITY="4", APP_MARKS=str(marks), APP_QUIET="1"
    )
    serving(orbit_server, 1)
    ids = [orbit_server.enqueue("echo", {"n": n}, max_attempts=1) for n in range(80)]
    try:
        snaps = [orbit_server.wait_for(t, {"SUCCEEDED", "FAILED"}, 30) for t in ids]
    except TimeoutError:
        raise AssertionError(proc.stderr) from None
    assert [s.state.value for s in snaps] == ["SUCCEEDED"] * len(ids), proc.stderr
    runs = marks.read_text().split()[::2]
    assert sorted(runs) == sorted(s.attempts[0].attempt_id for s in snaps)
    assert proc.stop(signal.SIGTERM, timeout=30) == 0
    assert "recycled" in proc.stderr
    # The first child prints the banner; each replacement one line.
    assert proc.stderr.count("SIGTERM or Ctrl-C drains; a second signal stops at once.") == 1
    replaced = re.findall(r"started again, replacing worker process (\d+)", proc.stderr)
    assert replaced and len(replaced) == len(set(replaced)), proc.stderr


@pytest.mark.orbit_server(assignment_rate=None)
def test_metrics_of_every_child_are_summed_on_one_port(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """--metrics-port: one scrape counts the tasks of both children and of recycled ones."""
    argv = ["--processes", "2", "--metrics-port", "0", "--max-tasks-per-child", "4"]
    proc = start(procs, orbit_server, project, *argv, APP_DELAY="0.05", APP_QUIET="1")
    port = port_line(proc, "metrics")
    serving(orbit_server, 2)
    # A child starts 4 tasks, plus those assigned to it before the server applied its drain
    # (slots freed by finishes meanwhile: few, as each task takes 50 ms): two children cannot
    # run 30 tasks, so some replacement child ran a part of them.
    ids = [orbit_server.enqueue("echo", {"n": n}, max_attempts=1) for n in range(30)]
    try:
        pids = {orbit_server.wait_for(t, {"SUCCEEDED"}, 15).result["pid"] for t in ids}
    except TimeoutError:
        raise AssertionError(proc.stderr) from None
    assert len(pids) >= 3
    succeeded = re.compile(
        r'^orbit_attempts_total\{handler="echo",outcome="SUCCEEDED"\} (\S+)$', re.M
    )

    def scrape_until(done: Callable[[str], bool]) -> str:
        # A child counts a finish once the server has acknowledged it, a moment after the
        # server's own state changed: scrape a few times, as Prometheus does.
        stop = threading.Event()
        for _ in range(100):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            if done(text):
                return text
            stop.wait(0.1)
        raise AssertionError(text)

    def counted(text: str) -> float:
        match = succeeded.search(text)
        return float(match.group(1)) if match else 0.0

    text = scrape_until(lambda text: counted(text) >= len(ids))
    assert counted(text) == len(ids), text  # every child's finishes, recycled ones included, once
    # Gauges count live processes only: two connected once recycling settles, offering their
    # 2 slots each (the saturation an autoscaler reads is orbit_slots_busy over this).
    text = scrape_until(lambda text: re.search(r"^orbit_connected 2\.0$", text, re.M) is not None)
    assert re.search(r"^orbit_slots 4\.0$", text, re.M), text
    assert re.search(r"^orbit_slots_busy 0\.0$", text, re.M), text
    assert re.search(r"^orbit_slot_wait_seconds_count (\S+)$", text, re.M), text
    assert proc.stop(signal.SIGTERM, timeout=30) == 0


@pytest.mark.orbit_server(assignment_rate=None)
def test_summed_metrics_start_at_zero_and_a_draining_process_has_no_busy_slot(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
) -> None:
    """--metrics-port: lease losses and undelivered finishes read 0 from the start; after
    SIGTERM the draining process's running handler leaves orbit_slots_busy with orbit_slots (the
    KEDA saturation does not read it as demand) and stays in orbit_attempts_in_flight."""
    argv = ("--processes", "1", "--metrics-port", "0", "--drain-timeout", "60")
    proc = start(procs, orbit_server, project, *argv)
    port = port_line(proc, "metrics")

    def scrape_until(pattern: str) -> str:
        stop = threading.Event()
        for _ in range(100):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            if re.search(pattern, text, re.M):
                return text
            stop.wait(0.1)
        raise AssertionError(text)

    text = scrape_until(r"^orbit_connected 1\.0$")
    for reason in ("lease_expired", "lease_lost", "session_replaced"):
        assert re.search(rf'^orbit_lease_losses_total\{{reason="{reason}"\}} 0\.0$', text, re.M)
    for handler in ("echo", "slow"):
        assert re.search(
            rf'^orbit_finishes_undelivered_total\{{handler="{handler}"\}} 0\.0$', text, re.M
        ), text
    orbit_server.enqueue("slow", {"n": 1}, max_attempts=1)
    assert proc.line().startswith("started ")
    assert re.search(r"^orbit_slots 2\.0$", scrape_until(r"^orbit_slots_busy 1\.0$"), re.M)
    proc.popen.send_signal(signal.SIGTERM)
    text = scrape_until(r"^orbit_slots 0\.0$")
    assert re.search(r"^orbit_slots_busy 0\.0$", text, re.M), text
    assert re.search(r'^orbit_attempts_in_flight\{handler="slow"\} 1\.0$', text, re.M), text
    proc.popen.send_signal(signal.SIGTERM)  # the second: the handler is cancelled
    assert proc.wait(30) == 3, proc.stderr


def test_supervisor_options_are_checked_before_anything_starts(project: Path) -> None:
    """A bad --processes or --max-memory-per-child is a usage error (2)."""
    for bad in (["--processes", "0"], ["--max-memory-per-child", "x"], ["--health-port", "-1"]):
        argv = command("worker", "app:make", *bad)
        proc = Proc(argv, env=clean_env(), cwd=project)
        assert proc.wait(15) == 2
        assert "error: argument" in proc.stderr


@pytest.mark.orbit_server(assignment_rate=None)
def test_sigterm_to_every_process_of_the_unit_still_drains(
    orbit_server: MockOrbitServer,
    project: Path,
    procs: list[Proc],
    tmp_path: Path,
) -> None:
    """systemd's default KillMode signals the supervisor and every child at once: each child
    counts one stop (the supervisor asks over a pipe, not with a second signal), so a running
    handler still finishes and the exit is 0."""
    proc = start(procs, orbit_server, project, "--processes", "2")
    serving(orbit_server, 2)
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    task_id = orbit_server.enqueue("gate", {"n": 1, "fifo": str(fifo)})
    assert proc.line().startswith("started ")
    for pid in (proc.popen.pid, *children_of(proc.popen.pid)):
        os.kill(pid, signal.SIGTERM)
    proc.wait_stderr("SIGTERM received: draining 1 task")
    proc.wait_stderr("SIGTERM received: draining 2 worker processes")
    release(fifo, "finished", proc)
    assert proc.wait(30) == 0, proc.stderr
    assert orbit_server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).result["line"] == "finished"
    assert "stopping now" not in proc.stderr and "received again" not in proc.stderr
