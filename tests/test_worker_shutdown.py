"""Stopping a Worker: drain, cancel, abandon, signals in a child process, no leftover threads."""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _worker_helpers import Probe, events, has_event, make_worker, running, worker_threads

from orbit_sync.client import Client
from orbit_sync.errors import HTTPError
from orbit_sync.models import Outcome, TaskState
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import DrainEvent, ShutdownReport, TaskContext, Worker, WorkerListener

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
HELPER = Path(__file__).with_name("_worker_helpers.py")


@pytest.fixture
def server() -> Any:
    """A mock server with 2 s leases and no assignment rate limit."""
    with MockOrbitServer(lease_duration=2.0, assignment_rate=None) as srv:
        yield srv
        srv.check_invariants()


def _stop_in_background(worker: Worker, **kwargs: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(worker.stop(**kwargs)), daemon=True)
    thread.start()
    return thread, out


def test_drain_keeps_leases_renewed_and_takes_no_new_work() -> None:
    """stop(drain=True): drain is reported, the running handler keeps renewing and finishes
    (fake time: the server's clock, followed by the worker's, moves to the next renewal)."""
    manual = ManualClock()
    with MockOrbitServer(clock=manual, lease_duration=2.0, assignment_rate=None) as server:
        worker = make_worker(server, drain_timeout=20.0, clock=manual)
        _drain_keeps_renewing(server, worker)
        server.check_invariants()


def _drain_keeps_renewing(server: MockOrbitServer, worker: Worker) -> None:
    probe = Probe()

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        while not probe.release.wait(0.05):
            ctx.raise_if_cancelled()
        return {"cancelled": ctx.cancelled.is_set()}

    first = server.enqueue("work", {})
    worker.start()
    try:
        probe.wait_started()
        stopper, reports = _stop_in_background(worker)
        server.wait_until(lambda s: any(x.draining for x in s.sessions()), timeout=10)
        drained_at = events(server, "instance.draining")[-1].at
        later = server.enqueue("work", {})
        server.advance(server.lease_duration / 2)  # still renewed while draining
        server.wait_until(
            lambda s: any(e.at > drained_at for e in events(s, "attempt.renewed", first)),
            timeout=10,
        )
        probe.release.set()
        stopper.join(15)
    finally:
        worker.stop(drain=False)
    [report] = reports
    assert report == ShutdownReport(drained=True)
    snap = server.task(first)
    assert snap.state is TaskState.SUCCEEDED and snap.result == {"cancelled": False}
    assert server.task(later).state is TaskState.WAITING, "a draining worker takes no new work"
    assert probe.runs[later] == 0


class _StopOnFirstAssignment(WorkerListener):
    """Asks the worker to stop when its first assignment arrives (on the connection's reader,
    before the next frame is read: the rest of the server's burst is still on its way)."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self.fired = threading.Event()

    def attempt_received(self, event: Any) -> None:
        if not self.fired.is_set():
            self.fired.set()
            self._worker.request_stop()


def test_assignments_on_their_way_when_the_worker_stops_run_there(
    server: MockOrbitServer,
) -> None:
    """Stop asked while the server's assignments are on their way: each is started and finished
    by the draining worker, so one allowed attempt is enough (one side effect per task)."""
    effects: collections.Counter[str] = collections.Counter()
    worker = make_worker(server, capacity=4)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        effects[ctx.task_id] += 1
        return {}

    stopper = _StopOnFirstAssignment(worker)
    worker.add_listener(stopper)
    ids = [server.enqueue("work", {"n": n}, max_attempts=1) for n in range(4)]
    worker.start()
    try:
        assert stopper.fired.wait(10), "no assignment arrived"
        snaps = [server.wait_for(t, DONE) for t in ids]
        report = worker.stop()
    finally:
        worker.stop(drain=False)
    assert [s.state for s in snaps] == [TaskState.SUCCEEDED] * 4
    assert all(len(s.attempts) == 1 for s in snaps)
    assert effects == {t: 1 for t in ids}
    assert report == ShutdownReport(drained=True)


def test_drain_waits_for_an_assignment_sent_before_the_drain_was_answered() -> None:
    """The drain ends once the server answered the drain report, not once nothing runs: an
    assignment it sent before applying the report still runs (fake time: the drain report is
    refused once as UNAVAILABLE, and its retry waits until the clock moves)."""
    effects: collections.Counter[str] = collections.Counter()
    manual = ManualClock()
    with MockOrbitServer(clock=manual, lease_duration=2.0, assignment_rate=None) as server:
        clock = manual
        worker = make_worker(
            server, capacity=1, drain_timeout=20.0, renew_retry_delay=1.0, clock=clock
        )

        @worker.handler("work")
        def work(ctx: TaskContext, payload: Any) -> Any:
            effects[ctx.task_id] += 1
            return {}

        worker.start()
        try:
            assert worker.wait_ready(10)
            refused = server.faults.reply_error("worker.capacity", "UNAVAILABLE")
            stopper, reports = _stop_in_background(worker)
            assert refused.wait(10), "the drain was never reported"
            # Nothing runs and the server does not know of the drain: it assigns this task.
            task_id = server.enqueue("work", {}, max_attempts=1)
            snap = server.wait_for(task_id, DONE)
            assert stopper.is_alive(), "the drain ended before the server answered it"
            assert clock.wait_for_sleepers(1, "orbit-worker-connection")
            server.advance(1.0)  # the drain report's retry: answered, the drain ends
            stopper.join(10)
        finally:
            worker.stop(drain=False)
        server.check_invariants()
    assert snap.state is TaskState.SUCCEEDED and len(snap.attempts) == 1
    assert effects == {task_id: 1}
    assert reports == [ShutdownReport(drained=True)]


def test_handler_ignoring_cancellation_is_abandoned_unknown(
    server: MockOrbitServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the drain timeout: cooperative handlers stop; a stubborn one is finished UNKNOWN;
    each task the stop cut short is named at WARNING."""
    caplog.set_level(logging.WARNING, "orbit_sync.worker")
    probe = Probe()
    stubborn_released = threading.Event()
    worker = make_worker(server, drain_timeout=0.1, cancel_grace=0.3)

    @worker.handler("stubborn")
    def stubborn(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        stubborn_released.wait(30)  # ignores its context entirely
        return {"late": True}

    @worker.handler("polite")
    def polite(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        ctx.sleep(30)
        return {"never": True}

    stubborn_id = server.enqueue("stubborn", {})
    polite_id = server.enqueue("polite", {})
    worker.start()
    probe.wait_started(2)
    began = time.monotonic()
    report = worker.stop()
    elapsed = time.monotonic() - began
    assert elapsed < 5.0, "stop() is bounded"
    assert not report.drained
    assert [a.task_id for a in report.abandoned] == [stubborn_id]
    assert [a.task_id for a in report.cancelled] == [polite_id]
    assert report.unreported == ()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    held = next(w for w in warnings if w.startswith("drain ended with 2 attempt(s) still held"))
    assert stubborn_id in held and polite_id in held
    (stopped,) = [w for w in warnings if w.startswith("worker stopped:")]
    assert stopped.endswith(
        f"; cancelled: task {polite_id} (attempt {report.cancelled[0].attempt_id})"
        "; abandoned, finished UNKNOWN SHUTDOWN_TIMEOUT:"
        f" task {stubborn_id} (attempt {report.abandoned[0].attempt_id})"
    )

    attempt = server.task(stubborn_id).attempts[-1]
    assert (attempt.outcome, attempt.error_code) == (Outcome.UNKNOWN, "SHUTDOWN_TIMEOUT")
    attempt = server.task(polite_id).attempts[-1]
    assert (attempt.outcome, attempt.error_code, attempt.retryable) == (
        Outcome.FAILED,
        "WORKER_SHUTDOWN",
        True,
    )
    # The stubborn handler returns later: its result is dropped, never sent a second time.
    stubborn_released.set()
    probe.threads[stubborn_id].join(5)
    assert not probe.threads[stubborn_id].is_alive()
    assert server.task(stubborn_id).evidence == ()
    assert worker_threads() == []


def test_stop_is_repeatable_and_leaves_no_threads(server: MockOrbitServer) -> None:
    """stop() twice returns the same report; every worker and connection thread is gone."""
    worker = make_worker(server, capacity=3)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        return payload

    ids = [server.enqueue("work", {"i": i}) for i in range(6)]
    with running(worker):
        for task_id in ids:
            server.wait_for(task_id, DONE)
        assert worker_threads(), "the worker runs on its own threads"
    first = worker.stop()
    assert worker.stop(drain=False) is first
    assert worker_threads() == []
    assert not [t.name for t in threading.enumerate() if not t.daemon and t.name != "MainThread"]


def test_stop_from_a_handler_is_refused_but_request_stop_works(server: MockOrbitServer) -> None:
    """A handler cannot wait for its own worker to stop; request_stop() does the job."""
    outcome: list[str] = []
    worker = make_worker(server)

    @worker.handler("quit")
    def quit_(ctx: TaskContext, payload: Any) -> Any:
        try:
            worker.stop()
        except RuntimeError:
            outcome.append("refused")
        worker.request_stop(drain=True)
        return {"ok": True}

    task_id = server.enqueue("quit", {})
    worker.start()
    server.wait_for(task_id, DONE)
    report = worker.stop(timeout=10)  # already stopping: returns the same report
    assert outcome == ["refused"]
    assert report.drained
    assert server.task(task_id).state is TaskState.SUCCEEDED


def test_request_stop_returns_while_a_capacity_report_is_unanswered() -> None:
    """request_stop() returns at once even while a capacity report waits for its answer, and
    the drain report goes out behind it (fake time: the server's clock, followed by the
    worker's, moves to the next heartbeat)."""
    probe = Probe()
    returned = threading.Event()
    manual = ManualClock()
    # 1.5 s sessions: the report is repeated (a heartbeat) every half second.
    with MockOrbitServer(
        clock=manual, lease_duration=2.0, session_window=1.5, assignment_rate=None
    ) as server:
        worker = make_worker(server, call_timeout=5.0, clock=manual)

        @worker.handler("work")
        def work(ctx: TaskContext, payload: Any) -> Any:
            probe.enter(ctx)
            probe.release.wait(10)
            return {"ok": True}

        task_id = server.enqueue("work", {})
        worker.start()
        try:
            probe.wait_started()
            # The next heartbeat is sent and never answered: that call waits up to 5 s.
            dropped = server.faults.drop_reply("worker.capacity")
            server.advance(server.session_window / 3)
            assert dropped.wait(10), "the worker never repeated its capacity report"
            asker = threading.Thread(
                target=lambda: (worker.request_stop(), returned.set()), daemon=True
            )
            asker.start()
            assert returned.wait(1.0), "request_stop() waited for the capacity report's answer"
            probe.release.set()
            report = worker.stop()
            stats = worker.stats()
        finally:
            probe.release.set()
            worker.stop(drain=False)
        snap = server.wait_for(task_id, DONE)
        reports = [e.detail for e in server.events() if e.kind == "session.capacity"]
    assert report.drained and report.unreported == ()
    # The drain report went out behind the unanswered one on the same session, not after that
    # one's call bound.
    assert stats.reconnects == 0
    assert [r for r in reports if r.endswith("drain=true")], reports
    assert snap.state is TaskState.SUCCEEDED
    assert worker_threads() == []


def test_bad_token_stops_run_with_the_error(server: MockOrbitServer) -> None:
    """Credentials the server refuses end run() with that error instead of retrying forever."""
    worker = Worker(Client(server.url, "not-the-token"), queue_id=server.queue_id)

    @worker.handler("work")
    def work(ctx: TaskContext, payload: Any) -> Any:
        return payload

    with pytest.raises(HTTPError) as info:
        worker.run()
    assert info.value.status_code == 401
    assert "not-the-token" not in str(info.value)
    assert worker_threads() == []


# ----------------------------------------------------------------------------- signals


def _spawn(server: MockOrbitServer, flag: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(HELPER), server.url, server.token, server.queue_id, str(flag), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_drains_in_a_subprocess(server: MockOrbitServer, tmp_path: Path) -> None:
    """SIGTERM: drain reported, the running handler finishes normally, the process exits 0."""
    flag = tmp_path / "release"
    task_id = server.enqueue("slow", {})
    proc = _spawn(server, flag, "drain")
    try:
        server.wait_for(task_id, {"RUNNING"}, timeout=15)
        proc.send_signal(signal.SIGTERM)
        server.wait_until(lambda s: any(x.draining for x in s.sessions()), timeout=10)
        later = server.enqueue("slow", {})
        flag.touch()
        report = _report(proc)
    finally:
        proc.kill()
        proc.wait()
    assert report == {
        "drained": True,
        "cancelled": [],
        "abandoned": [],
        "unreported": [],
        "non_daemon": [],
    }
    snap = server.task(task_id)
    assert snap.state is TaskState.SUCCEEDED and snap.result["cancelled"] is False
    assert server.task(later).state is TaskState.WAITING


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_second_sigterm_stops_at_once(server: MockOrbitServer, tmp_path: Path) -> None:
    """A second signal stops without waiting for the drain; a stuck handler is left UNKNOWN."""
    task_id = server.enqueue("slow", {})
    proc = _spawn(server, tmp_path / "never", "announce")
    try:
        # The handler's own line, not the server's RUNNING: the server sees the attempt start
        # before the handler is entered, and an attempt cancelled before its handler ran is
        # finished FAILED (never ran), not abandoned.
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"running {task_id}"
        proc.send_signal(signal.SIGTERM)
        server.wait_until(has_event("instance.draining"), timeout=10)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        report = _report(proc)
        elapsed = time.monotonic() - began
    finally:
        proc.kill()
        proc.wait()
    assert elapsed < 10.0, "the 20 s drain timeout was not waited for"
    assert report["abandoned"] == [task_id] and report["non_daemon"] == []
    attempt = server.task(task_id).attempts[-1]
    assert (attempt.outcome, attempt.error_code) == (Outcome.UNKNOWN, "SHUTDOWN_TIMEOUT")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_signal_delivered_to_another_thread_still_stops_run(server: MockOrbitServer) -> None:
    """run() on the main thread stops on a SIGTERM that the kernel hands to another thread."""
    worker = make_worker(server, handle_signals=True)
    worker.handler("work")(lambda ctx, payload: payload)
    stopped_by_signal = threading.Event()

    class Listener(WorkerListener):
        def draining(self, event: DrainEvent) -> None:
            if event.drain:  # the signal's drain, not the fallback stop below
                stopped_by_signal.set()

    worker.add_listener(Listener())

    def deliver() -> None:
        assert worker.wait_ready(10.0)
        # A process-directed signal may land on any thread that does not block it; this one
        # lands here while the main thread sleeps in run(). Python runs the handler only on the
        # main thread, so run() must be woken by the signal itself, not by its handler.
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        if not stopped_by_signal.wait(5.0):
            worker.request_stop(drain=False)  # unblock run() so the test fails instead of hanging

    sender = threading.Thread(target=deliver, daemon=True)
    sender.start()
    report = worker.run()
    sender.join(15)
    assert stopped_by_signal.is_set(), "run() slept through a SIGTERM delivered to another thread"
    assert report.drained
    assert signal.set_wakeup_fd(-1) == -1, "run() left its wakeup fd installed"
    assert worker_threads() == []


def test_abandoned_finishes_go_out_while_every_handler_thread_is_held(
    server: MockOrbitServer,
) -> None:
    """With listeners (whose calls stay off the connection's thread) and every handler thread
    held by a handler that ignores cancellation, shutdown still delivers each UNKNOWN finish:
    the shutdown thread sends them itself instead of queueing them behind the stuck handlers."""
    probe = Probe()
    released = threading.Event()
    finished: list[Any] = []

    class Finished(WorkerListener):
        def attempt_finished(self, event: Any) -> None:
            """Record the finish."""
            finished.append(event)

    worker = make_worker(
        server, capacity=2, drain_timeout=0.1, cancel_grace=0.2, listeners=[Finished()]
    )

    @worker.handler("stubborn")
    def stubborn(ctx: TaskContext, payload: Any) -> Any:
        probe.enter(ctx)
        released.wait(30)  # ignores its context entirely
        return None

    ids = [server.enqueue("stubborn", {}) for _ in range(2)]
    worker.start()
    try:
        probe.wait_started(2)
        report = worker.stop()
    finally:
        released.set()
    assert sorted(a.task_id for a in report.abandoned) == sorted(ids)
    assert report.unreported == ()
    for task_id in ids:
        attempt = server.task(task_id).attempts[-1]
        assert (attempt.outcome, attempt.error_code) == (Outcome.UNKNOWN, "SHUTDOWN_TIMEOUT")
    assert sorted(e.task_id for e in finished if e.delivered) == sorted(ids)
    for task_id in ids:
        probe.threads[task_id].join(5)


class _Stopped(WorkerListener):
    """Hands the shutdown report over to the test."""

    def __init__(self) -> None:
        self.report: ShutdownReport | None = None
        self.event = threading.Event()

    def stopped(self, report: ShutdownReport) -> None:
        """Keep the report."""
        self.report = report
        self.event.set()


def _unanswered_finish(
    server: MockOrbitServer, clock: ManualClock, **kwargs: Any
) -> tuple[Worker, str, _Stopped]:
    """A started worker on a ManualClock nobody moves, whose one finish the server never answers."""
    dropped = server.faults.drop_reply("task.finish", count=1_000)
    stopped = _Stopped()
    worker = make_worker(
        server,
        clock=clock,
        cancel_grace=0.05,
        flush_timeout=0.05,
        listeners=[stopped],
        **kwargs,
    )
    worker.register("quick", lambda ctx, payload: {"ok": True})
    task_id = server.enqueue("quick", {})
    worker.start()
    assert worker.wait_ready(10)
    server.wait_until(lambda _: dropped.fired >= 1)
    return worker, task_id, stopped


class _LogLine(logging.Handler):
    """Sets an event once a log record whose message contains *text* is emitted."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


@pytest.mark.parametrize("with_outbox", [False, True], ids=["no-outbox", "outbox"])
def test_shutdown_on_a_clock_that_never_moves_ends_in_real_time_and_loses_nothing(
    server: MockOrbitServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, with_outbox: bool
) -> None:
    """A finish the server never answers, on a worker clock nobody moves: the shutdown still
    ends within its bound in real time (its own alarm: nobody waits in stop()), the attempt
    reported unreported and kept in the outbox (the worker cannot know the server applied it)."""
    path = tmp_path / "outbox.sqlite"
    worker, task_id, stopped = _unanswered_finish(
        server, ManualClock(0.0), outbox=path if with_outbox else None
    )
    worker.request_stop(drain=False)
    # The bound is 0.05 + 0.05 s plus the close allowance: well inside.
    assert stopped.event.wait(10), "the shutdown hangs on a clock that never moves"
    assert stopped.report is not None
    assert [a.task_id for a in stopped.report.unreported] == [task_id]
    assert "overran its bound" in caplog.text
    assert worker.stop() is stopped.report
    assert not [t for t in worker_threads() if t.startswith("orbit-worker")]
    if with_outbox:  # the finish was kept: the next worker on the outbox delivers it
        server.faults.clear()
        after = make_worker(server, outbox=path)
        after.register("quick", lambda ctx, payload: {"ok": True})
        (kept,) = stopped.report.unreported
        delivered = f"outbox: delivered SUCCEEDED of attempt {kept.attempt_id}"
        line = _LogLine(delivered)
        logging.getLogger("orbit_sync").addHandler(line)
        try:
            with caplog.at_level(logging.INFO, logger="orbit_sync"), running(after):
                assert line.seen.wait(10), "the next worker never delivered the kept finish"
        finally:
            logging.getLogger("orbit_sync").removeHandler(line)
        assert f"{delivered} (task {task_id})" in caplog.text


def test_stop_that_shortens_a_drain_ends_in_real_time(server: MockOrbitServer) -> None:
    """stop(drain=False) after a 30 s drain was asked, on a clock nobody moves: stop() cuts the
    shutdown short past its own bound, though the shutdown's alarm was set for the drain."""
    clock = ManualClock(0.0)
    worker, task_id, _ = _unanswered_finish(server, clock)
    worker.request_stop(drain=True)
    assert clock.wait_for_sleepers(1, "orbit-worker-shutdown")  # draining, alarm set
    thread, out = _stop_in_background(worker, drain=False)
    thread.join(10)
    assert not thread.is_alive(), "stop() hangs on a clock that never moves"
    (report,) = out
    assert [a.task_id for a in report.unreported] == [task_id]
    assert report.error is None  # the shutdown thread's own report: its close ran, none was stuck


def test_stop_returns_when_a_stopped_listener_never_does(
    server: MockOrbitServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A listener whose stopped() never returns cannot hold stop() past its bound: it returns
    the published report and logs that the shutdown is stuck."""
    release = threading.Event()

    class Blocking(WorkerListener):
        def stopped(self, report: ShutdownReport) -> None:
            """Block until the test ends."""
            release.wait(30)

    worker = make_worker(server, cancel_grace=0.05, flush_timeout=0.05, listeners=[Blocking()])
    worker.register("quick", lambda ctx, payload: None)
    worker.start()
    try:
        assert worker.wait_ready(10)
        thread, out = _stop_in_background(worker, drain=False)
        thread.join(10)
        assert not thread.is_alive(), "stop() waits for a listener that never returns"
        (report,) = out
        assert report.error is None and report.unreported == ()
        assert "shutdown is stuck" in caplog.text
    finally:
        release.set()
