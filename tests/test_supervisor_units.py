"""The supervisor's parts on their own: exit-status ranking, restart decisions, the host's health
from its children's reports (fake clock), the metrics target, the recycling limits (fake RSS), the
message pipe."""

from __future__ import annotations

import os
import random
import signal
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from orbit_sync._cli_report import (
    EXIT_AUTH,
    EXIT_FAILED,
    EXIT_FORCED,
    EXIT_OK,
    EXIT_PROTOCOL,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from orbit_sync._supervisor._child import ChildLink, RecycleLimits, check_memory_limit
from orbit_sync._supervisor._observe import STALE_REPORT, HostHealth, MetricsTarget
from orbit_sync._supervisor._policy import START_FAILURES, Restarts, status_of, worst
from orbit_sync._supervisor._supervisor import Supervisor, SupervisorOptions
from orbit_sync._supervisor._wire import DRAIN, STOP_NOW, ChildSettings, LineReader, encode
from orbit_sync.contrib.health import HealthProbe
from orbit_sync.models import Outcome
from orbit_sync.testing import ManualClock
from orbit_sync.worker import (
    AttemptEvent,
    AttemptFinished,
    DisconnectEvent,
    LeaseEvent,
    SessionEvent,
    StuckEvent,
    WorkerOptions,
)


def test_worst_status_prefers_the_ones_restarting_cannot_fix() -> None:
    """0 < 3 < 1 < 6 < 5 < 4 < 2; nothing is 0; an unknown status counts as a failure."""
    assert worst([]) == EXIT_OK
    assert worst([EXIT_OK, EXIT_FORCED]) == EXIT_FORCED
    assert worst([EXIT_FORCED, EXIT_FAILED, EXIT_OK]) == EXIT_FAILED
    assert worst([EXIT_FAILED, EXIT_UNREACHABLE]) == EXIT_UNREACHABLE
    assert worst([EXIT_UNREACHABLE, EXIT_PROTOCOL]) == EXIT_PROTOCOL
    assert worst([EXIT_PROTOCOL, EXIT_AUTH]) == EXIT_AUTH
    assert worst([EXIT_AUTH, EXIT_USAGE, EXIT_OK]) == EXIT_USAGE
    assert worst([EXIT_FORCED, 77]) == 77


def test_signal_deaths_map_to_statuses() -> None:
    """Our SIGKILL is a forced stop; SIGTERM while stopping is clean; any other death is 1."""
    assert status_of(0, killed=False, stopping=False) == EXIT_OK
    assert status_of(4, killed=False, stopping=True) == EXIT_AUTH
    assert status_of(-signal.SIGKILL, killed=True, stopping=True) == EXIT_FORCED
    assert status_of(-signal.SIGTERM, killed=False, stopping=True) == EXIT_OK
    assert status_of(-signal.SIGTERM, killed=False, stopping=False) == EXIT_FAILED
    assert status_of(-signal.SIGKILL, killed=False, stopping=False) == EXIT_FAILED


def test_a_child_that_was_ready_is_restarted_quickly_every_time() -> None:
    """Deaths after ready never give up and wait at most half a second."""
    restarts = Restarts(rng=random.Random(1))
    for _ in range(10):
        delay = restarts.after_exit(EXIT_FAILED, was_ready=True)
        assert delay is not None and 0 <= delay <= 0.5


def test_start_failures_back_off_then_give_up() -> None:
    """Deaths before ready back off exponentially; the START_FAILURES-th gives up; a ready
    child in between resets the count."""
    restarts = Restarts(rng=random.Random(2))
    delays = [restarts.after_exit(EXIT_FAILED, was_ready=False) for _ in range(START_FAILURES)]
    assert delays[-1] is None
    first, second = delays[0], delays[1]
    assert first is not None and second is not None and 0.5 <= first <= 1.0 <= second <= 2.0
    restarts = Restarts()
    assert restarts.after_exit(EXIT_FAILED, was_ready=False) is not None
    assert restarts.after_exit(EXIT_FAILED, was_ready=True) is not None
    assert restarts.after_exit(EXIT_FAILED, was_ready=False) is not None


def test_kills_while_starting_back_off_but_never_give_up() -> None:
    """SIGKILL or SIGTERM before ready (the OOM killer, an operator): backoff grows, but only
    the slot's own start failures count toward giving up; a ready child resets both."""
    restarts = Restarts(rng=random.Random(3))
    for _ in range(START_FAILURES * 2):
        kill = restarts.after_exit(EXIT_FAILED, was_ready=False, returncode=-signal.SIGKILL)
        assert kill is not None
    assert restarts.starts == START_FAILURES * 2 and restarts.failures == 0
    for _ in range(START_FAILURES - 1):
        assert restarts.after_exit(EXIT_FAILED, was_ready=False, returncode=1) is not None
    restarts.ready()  # a child of the slot became ready: the count starts again
    for _ in range(START_FAILURES - 1):
        assert restarts.after_exit(EXIT_FAILED, was_ready=False, returncode=1) is not None
    assert restarts.after_exit(EXIT_FAILED, was_ready=False, returncode=-signal.SIGSEGV) is None


@pytest.mark.parametrize("status", [EXIT_USAGE, EXIT_AUTH, EXIT_PROTOCOL])
def test_statuses_that_restarting_cannot_fix_give_up_at_once(status: int) -> None:
    """Usage, credentials and protocol errors before ready stop the supervisor the first time."""
    assert Restarts().after_exit(status, was_ready=False) is None


READY = {"live": True, "ready": True, "connected": True, "in_flight": 2, "reconnects": 1}


def test_host_is_ready_only_when_every_slot_is() -> None:
    """Two slots: starting, one ready, both ready; a replacement starting makes it unready."""
    health = HostHealth(2, clock=ManualClock(100.0))
    assert health.state()["ready"] is False and health.state()["live"] is True
    health.child_started(0, 10)
    health.child_started(1, 11)
    health.child_reported(0, 10, READY)
    assert health.state()["ready"] is False
    health.child_reported(1, 11, READY)
    state = health.state()
    assert state["ready"] is True and state["in_flight"] == 4 and state["reconnects"] == 2
    health.child_gone(1, 11)  # recycled: its replacement starts
    health.child_started(1, 12)
    health.child_reported(1, 11, READY)  # the old child's late report does not count
    assert health.state()["ready"] is False
    health.child_reported(1, 12, READY)
    assert health.state()["ready"] is True
    health.stopping()
    assert health.state()["ready"] is False and health.state()["live"] is True
    health.stopped()
    assert health.state()["live"] is False


def test_a_silent_or_unlive_child_makes_the_host_unlive() -> None:
    """A child's own live=false, or no report for STALE_REPORT seconds, is not live."""
    clock = ManualClock(100.0)
    health = HostHealth(1, clock=clock)
    health.child_started(0, 10)
    health.child_reported(0, 10, READY)
    clock.advance(STALE_REPORT)
    assert health.state()["live"] is True
    clock.advance(0.1)
    assert health.state()["live"] is False
    health.child_reported(0, 10, {**READY, "live": False})
    assert health.state()["live"] is False
    health.child_reported(0, 10, READY)
    assert health.state()["live"] is True


def test_host_state_has_every_key_of_a_single_worker_combined_over_its_processes() -> None:
    """Top-level status, reached, unreached_s, ages and counts from the children's own probes:
    worst status first, unreached only until any process reached, the youngest ages (plus the
    report's age), counts kept across a recycle."""
    clock = ManualClock(100.0)
    health = HostHealth(2, clock=clock)
    assert set(health.state()) == set(HealthProbe().state()) | {"processes"}
    probes = {10: HealthProbe(clock=clock), 11: HealthProbe(clock=clock)}

    def report(slot: int, pid: int) -> None:
        health.child_reported(slot, pid, probes[pid].state())

    health.child_started(0, 10)
    health.child_started(1, 11)
    assert health.state()["status"] == "starting" and health.state()["unreached_s"] is None
    probes[10].dial_failed(DisconnectEvent("ConnectionRefusedError"))
    clock.advance(2.0)
    probes[10].dial_failed(DisconnectEvent("ConnectionRefusedError"))
    probes[11].dial_failed(DisconnectEvent("ConnectionRefusedError"))
    report(0, 10)
    report(1, 11)
    clock.advance(0.5)  # the reports are half a second old
    state = health.state()
    assert state["status"] == "unreached" and state["reached"] is False
    assert state["unreached_s"] == 2.5 and state["dial_failures"] == 3
    probes[11].connected(SessionEvent("s" * 32, reconnect=False, capacity=2))
    clock.advance(1.0)
    report(1, 11)
    state = health.state()
    # Slot 0 still fails its dials, but the host has reached the server: reconnecting.
    assert state["status"] == "reconnecting" and state["reached"] is True
    assert state["unreached_s"] is None and state["session_age_s"] == 1.0
    probes[10].connected(SessionEvent("t" * 32, reconnect=False, capacity=2))
    probes[11].lease_renewed(LeaseEvent("b" * 32, "a" * 32, "h"))
    probes[11].disconnected(DisconnectEvent("ConnectionClosedError"))
    probes[11].connected(SessionEvent("u" * 32, reconnect=True, capacity=2))
    clock.advance(0.25)
    report(0, 10)
    report(1, 11)
    clock.advance(0.25)
    state = health.state()
    assert state["status"] == "ready" and state["ready"] and state["connected"]
    assert state["session_age_s"] == 0.5 and state["last_renewal_age_s"] == 0.5
    assert state["reconnects"] == 1 and state["dial_failures"] == 3
    health.child_gone(1, 11)  # recycled: its replacement starts, its counts stay
    health.child_started(1, 12)
    state = health.state()
    assert state["status"] == "starting" and state["reached"] is True
    assert state["reconnects"] == 1 and state["dial_failures"] == 3
    assert state["session_age_s"] == 0.5 and state["last_renewal_age_s"] is None
    health.stopping()
    assert health.state()["status"] == "draining"
    health.stopped()
    assert health.state()["status"] == "stopped"


def finished() -> AttemptFinished:
    """An attempt-finished event (its fields do not matter to the limits)."""
    return AttemptFinished(
        attempt_id="a" * 32,
        task_id="b" * 32,
        handler="h",
        attempt=1,
        outcome=Outcome.SUCCEEDED,
        error_code=None,
        duration=0.01,
        delivered=True,
        ran=True,
    )


def started() -> AttemptEvent:
    """An attempt-started event (its fields do not matter to the limits)."""
    return AttemptEvent(
        task_id="b" * 32, attempt_id="a" * 32, handler="h", attempt=1, max_attempts=3
    )


def test_a_scrape_while_a_child_creates_its_metrics_file_still_sums_the_others() -> None:
    """The host's metrics answer while a child's file exists but is still empty (created, not
    yet sized), with every other child's values."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    target = MetricsTarget("127.0.0.1", 0)
    try:
        written = MmapedDict(os.path.join(target.directory, "counter_101.db"))
        key = mmap_key("orbit_attempts", "orbit_attempts_total", ["handler"], ["echo"], "Attempts")
        written.write_value(key, 3.0, 0.0)
        written.close()
        open(os.path.join(target.directory, "counter_102.db"), "wb").close()  # being created
        url = f"http://127.0.0.1:{target.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        assert 'orbit_attempts_total{handler="echo"} 3.0' in text, text
    finally:
        target.close()


def test_task_limit_fires_once_at_the_kth_start() -> None:
    """--max-tasks-per-child 3: the third attempt to start triggers, later ones do not again;
    finishes are not counted (their acknowledgements may come back late)."""
    reasons: list[str] = []
    limits = RecycleLimits(max_tasks=3, max_memory_mb=None, on_limit=reasons.append)
    for _ in range(2):
        limits.attempt_started(started())
    for _ in range(5):
        limits.attempt_finished(finished())
    assert reasons == []
    for _ in range(3):
        limits.attempt_started(started())
    assert reasons == ["3 tasks (--max-tasks-per-child 3)"]


def test_the_first_limit_reached_is_the_only_one_reported() -> None:
    """A memory limit after the task limit fired (or the other way round) is not reported again."""
    reasons: list[str] = []
    limits = RecycleLimits(
        max_tasks=1, max_memory_mb=1, on_limit=reasons.append, rss=lambda: 2 * 1024 * 1024
    )
    limits.attempt_started(started())
    limits.attempt_finished(finished())
    assert reasons == ["1 tasks (--max-tasks-per-child 1)"]


def test_memory_limit_is_checked_after_each_attempt() -> None:
    """--max-memory-per-child 100: RSS of exactly 100 MB passes, one byte more recycles."""
    rss = [100 * 1024 * 1024]
    reasons: list[str] = []
    limits = RecycleLimits(
        max_tasks=None, max_memory_mb=100, on_limit=reasons.append, rss=lambda: rss[0]
    )
    limits.attempt_finished(finished())
    assert reasons == []
    rss[0] += 1
    limits.attempt_finished(finished())
    assert reasons == ["RSS 100 MB (--max-memory-per-child 100)"]


def test_a_memory_limit_at_or_below_the_process_own_rss_is_refused_naming_it() -> None:
    """--max-memory-per-child 40 with 40 MB held before any task: refused with the figure; one
    byte less held is accepted, and so is no limit at all."""
    with pytest.raises(
        ValueError,
        match=r"is at or below this worker process's own RSS after"
        r" start \(40 MB\).*more than 40 MB plus what a task needs",
    ):
        check_memory_limit(40, rss=lambda: 40 * 1024 * 1024)
    check_memory_limit(40, rss=lambda: 40 * 1024 * 1024 - 1)
    check_memory_limit(None, rss=lambda: 1 << 40)


def test_the_memory_limit_says_when_the_first_task_passed_it() -> None:
    """first_task is set when the attempt that passed the limit was the process's first."""
    first = RecycleLimits(max_tasks=None, max_memory_mb=1, on_limit=print, rss=lambda: 2 << 20)
    first.attempt_finished(finished())
    assert first.first_task
    rss = [0]
    later = RecycleLimits(max_tasks=None, max_memory_mb=1, on_limit=print, rss=lambda: rss[0])
    later.attempt_finished(finished())
    rss[0] = 2 << 20
    later.attempt_finished(finished())
    assert not later.first_task


class _Retiring:
    """What the supervisor reads of a child that asks to be recycled."""

    def __init__(self, slot: int, pid: int) -> None:
        self.slot, self.pid, self.retiring = slot, pid, False


def test_processes_recycled_after_their_first_task_in_a_row_are_reported_once() -> None:
    """A slot whose processes pass the memory limit with their first task, twice in a row, is
    reported once (not at every recycle, and not for a single one or for a task limit)."""
    said: list[str] = []
    options = SupervisorOptions(processes=2, command=("true",), label="app:make")
    supervisor = Supervisor(options, out=said.append)
    supervisor._spawn = lambda slot: None  # type: ignore[method-assign]  # no real processes
    pid = iter(range(100, 200))

    def recycle(slot: int, *, first_task: bool) -> None:
        child = _Retiring(slot, next(pid))
        supervisor._current[slot] = child  # type: ignore[assignment]
        message = {"kind": "recycle", "reason": "RSS 41 MB (--max-memory-per-child 40)"}
        supervisor._on_message(child, {**message, "first_task": first_task})  # type: ignore[arg-type]

    recycle(0, first_task=True)
    recycle(0, first_task=False)
    recycle(1, first_task=True)
    assert said == []
    recycle(0, first_task=True)
    recycle(0, first_task=True)
    recycle(0, first_task=True)
    recycle(1, first_task=True)
    assert said == [
        "worker process 104 recycled after its first task, as the one before it in slot 0: RSS 41"
        " MB (--max-memory-per-child 40). Each process now runs about one task; give"
        " --max-memory-per-child more room (this is reported once)"
    ]
    assert supervisor.recycled == 7


def test_stuck_limit_recycles_once_n_slots_are_stuck() -> None:
    """--max-stuck-per-child 2: one stuck slot keeps the process, the second recycles it (once),
    whatever the other limits say."""
    reasons: list[str] = []
    limits = RecycleLimits(max_tasks=None, max_memory_mb=None, max_stuck=2, on_limit=reasons.append)

    def stuck(n: int) -> StuckEvent:
        return StuckEvent("b" * 32, f"{n:032x}", "h", "time_limit", n, 4)

    limits.handler_stuck(stuck(1))
    assert reasons == []
    limits.handler_stuck(stuck(2))
    limits.handler_stuck(stuck(3))
    assert reasons == ["2 of 4 slots stuck past a time limit (--max-stuck-per-child 2)"]


def test_messages_survive_arbitrary_splits_and_garbage_is_dropped() -> None:
    """The reader reassembles lines split across reads and skips what is not a message."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    reader = LineReader(r)
    try:
        line = encode("state", state=READY)
        os.write(w, b"not json\n" + line[:7])
        assert reader.read() == []
        os.write(w, line[7:] + b'["no kind"]\n' + encode("exit", status=4, message="x"))
        assert [m["kind"] for m in reader.read()] == ["state", "exit"]
        assert reader.read() == [] and not reader.eof
        os.close(w)
        assert reader.read() == [] and reader.eof
    finally:
        os.close(r)


def test_child_settings_round_trip_and_refuse_garbage() -> None:
    """What the supervisor puts in the environment is what the child reads back."""
    settings = ChildSettings(status_fd=5, control_fd=6, supervisor_pid=1, slot=0, max_tasks=3)
    assert ChildSettings.from_env(settings.to_env()) == settings
    with pytest.raises(ValueError, match="malformed"):
        ChildSettings.from_env('{"status_fd": 1}')


class FakeWorker:
    """What ChildLink needs of a Worker; records its stop requests."""

    def __init__(self) -> None:
        self.stops: list[bool] = []
        self.stopped = threading.Event()
        self.listeners: list[object] = []
        self.options = WorkerOptions(
            queue_id="f" * 32, drain_timeout=30.0, cancel_grace=5.0, flush_timeout=10.0
        )

    def add_listener(self, listener: object) -> None:
        self.listeners.append(listener)

    def request_stop(self, *, drain: bool = True) -> None:
        self.stops.append(drain)
        self.stopped.set()


@pytest.fixture
def link() -> Iterator[tuple[ChildLink, int, int]]:
    """A ChildLink on real pipes: (link, the supervisor's end of control, of status)."""
    status_r, status_w = os.pipe()
    control_r, control_w = os.pipe()
    settings = ChildSettings(
        status_fd=status_w, control_fd=control_r, supervisor_pid=os.getpid(), slot=0
    )
    child = ChildLink(settings)
    yield child, control_w, status_r
    child.exit(0, None)
    for fd in (status_r, status_w, control_r):
        os.close(fd)  # control_w: each test closes it (the supervisor's end going away)


def test_a_stop_asked_before_the_worker_runs_is_applied_once_it_is_attached(
    link: tuple[ChildLink, int, int],
) -> None:
    """STOP_NOW, then the supervisor's end, arrive while the application loads: attach()
    applies the stop at its first report; the end of the pipe does not soften it."""
    child, control_w, status_r = link
    os.write(control_w, STOP_NOW)
    os.close(control_w)
    child.watch_control()  # returns at the end of the pipe
    worker = FakeWorker()
    assert child.stop_requested and worker.stops == []
    child.attach(worker)
    assert worker.stopped.wait(5) and worker.stops[0] is False
    kinds = [m["kind"] for m in LineReader(status_r).read()]
    assert kinds[0] == "hello"


def test_stop_now_is_never_softened_and_the_end_of_the_pipe_drains(
    link: tuple[ChildLink, int, int],
) -> None:
    """STOP_NOW after DRAIN escalates; a later DRAIN or the pipe's end changes nothing."""
    child, control_w, _ = link
    worker = FakeWorker()
    child.attach(worker)
    os.write(control_w, DRAIN + DRAIN + STOP_NOW + DRAIN)
    os.close(control_w)  # the supervisor is gone
    child.watch_control()
    # Its reports apply the current request again (request_stop is idempotent): count changes.
    assert _changes(worker.stops) == [True, False]
    fresh = ChildLink(child.settings)
    other = FakeWorker()
    fresh.attach(other)
    fresh.watch_control()  # the pipe has ended: a drain
    fresh.exit(0, None)
    assert _changes(other.stops) == [True]


def _changes(stops: list[bool]) -> list[bool]:
    """*stops* without the repeats of the same request."""
    return [drain for i, drain in enumerate(stops) if i == 0 or stops[i - 1] != drain]
