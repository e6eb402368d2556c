"""The worker's injectable clock: fake time for waits, idle pool threads, no polling."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from _scripted import WAIT
from _worker_helpers import Probe, make_worker, running

from orbit_sync import SystemClock
from orbit_sync.models import TaskState
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.worker import TaskContext
from orbit_sync.worker.runtime._link import Wakeup
from orbit_sync.worker.runtime._pool import EXTRA


def _pool_threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_manual_clock_wakes_a_timed_wait_when_advanced_past_its_deadline() -> None:
    """A Wakeup waiting 30 fake seconds returns once the clock is advanced, not before."""
    clock = ManualClock(0.0)
    wake = Wakeup(clock)
    waiting = threading.Event()
    result: list[bool] = []

    def wait() -> None:
        waiting.set()
        result.append(wake.wait(30.0))

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    assert waiting.wait(WAIT)
    clock.advance(10.0)
    thread.join(0.05)
    assert thread.is_alive(), "10 of 30 seconds must not end the wait"
    clock.advance(20.0)
    thread.join(WAIT)
    assert result == [False]
    assert clock.now() == 30.0


def test_the_old_fake_clock_following_a_manual_clock_wakes_its_waiters() -> None:
    """The deprecated FakeClock(follow=ManualClock) still moves, and wakes waiters, with it."""
    import orbit_sync.testing as testing

    with pytest.warns(DeprecationWarning, match=r"FakeClock"):
        fake_clock = testing.FakeClock
    manual = ManualClock()
    clock = fake_clock(5.0, follow=manual)
    wake = Wakeup(clock)
    done = threading.Event()
    threading.Thread(target=lambda: (wake.wait(2.0), done.set()), daemon=True).start()
    manual.advance(2.0)
    assert done.wait(WAIT)
    assert clock.now() == pytest.approx(7.0)
    with pytest.raises(RuntimeError):
        clock.advance(1.0)


def test_manual_clock_rejects_bad_steps_and_starts() -> None:
    """Time never moves backwards, by NaN, or by a non-number, nor starts at NaN or infinity."""
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            ManualClock(bad)
    clock = ManualClock(0.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            clock.advance(bad)
    with pytest.raises(TypeError):
        clock.advance("1")  # type: ignore[arg-type]


def test_worker_handler_threads_grow_to_a_burst_and_no_further() -> None:
    """A Worker(capacity=16) on a clock nobody moves runs sixteen handlers at once, on no more
    than sixteen handler threads and their EXTRA, and takes work after the burst (how idle
    threads retire: the handler threads' own tests)."""
    with MockOrbitServer(assignment_rate=None) as server:
        clock = ManualClock(0.0)
        together = threading.Barrier(16, timeout=WAIT)
        worker = make_worker(server, capacity=16, clock=clock)

        @worker.handler("burst")
        def burst(ctx: TaskContext, payload: Any) -> Any:
            together.wait()  # sixteen handler threads at once
            return {"ok": True}

        @worker.handler("one")
        def one(ctx: TaskContext, payload: Any) -> Any:
            return {"ok": True}

        with running(worker):
            ids = [server.enqueue("burst", {"i": i}) for i in range(16)]
            for task_id in ids:
                assert server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).state is (
                    TaskState.SUCCEEDED
                )
            assert 16 <= len(_pool_threads("orbit-handler")) <= 16 + EXTRA
            # And the worker still takes work.
            task_id = server.enqueue("one", {})
            assert server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).state is (
                TaskState.SUCCEEDED
            )


class _RecordingClock(SystemClock):
    """Real time, recording the deadlines the connection thread sleeps until."""

    def __init__(self) -> None:
        self.waits: list[tuple[float, float | None]] = []
        self._lock = threading.Lock()

    def wait(self, cond: threading.Condition, deadline: float | None) -> None:
        """Record (now, deadline) for the connection thread, then wait for real."""
        if threading.current_thread().name == "orbit-worker-connection":
            with self._lock:
                self.waits.append((self.now(), deadline))
        super().wait(cond, deadline)


def test_connection_thread_sleeps_until_the_heartbeat_and_wakes_for_a_drain() -> None:
    """The connection thread's only timed sleep ends at the next heartbeat (15 s away), and a
    stop request still reaches the server at once: it is woken, not polling."""
    clock = _RecordingClock()
    with MockOrbitServer(assignment_rate=None, session_window=45.0) as server:
        probe = Probe()
        worker = make_worker(server, clock=clock, drain_timeout=5.0)

        @worker.handler("slow")
        def slow(ctx: TaskContext, payload: Any) -> Any:
            probe.enter(ctx)
            probe.release.wait(WAIT)
            return None

        worker.start()
        try:
            assert worker.wait_ready(WAIT)
            server.enqueue("slow", {})
            probe.wait_started()
            worker.request_stop()  # drain: the report must go out while the handler runs
            server.wait_until(lambda s: any(sess.draining for sess in s.sessions()), timeout=WAIT)
        finally:
            probe.release.set()
            worker.stop()
        sleeps = [(now, deadline) for now, deadline in clock.waits if deadline is not None]
        assert sleeps, "the connection thread never slept on the worker's clock"
        for now, deadline in sleeps:
            assert deadline - now > 10.0, "woke up before the heartbeat was due: polling"


def test_one_manual_clock_drives_the_server_a_dial_and_a_worker() -> None:
    """The mock server's ManualClock, passed as is, anchors a dial's leases and a Worker's waits."""
    from _scripted import registration

    from orbit_sync import CapacityReport, Client, Clock

    manual = ManualClock()
    assert isinstance(manual, Clock)
    with MockOrbitServer(clock=manual, assignment_rate=None) as server:
        conn = Client(server.url, server.token).dial_worker(
            registration(queue_id=server.queue_id), clock=manual
        )
        try:
            conn.capacity(CapacityReport(sequence=1, capacity=1))
            server.enqueue("resize", {})
            started = conn.start(conn.next_assignment(WAIT).attempt)
            lease = started.lease
            assert lease.deadline is not None
            # Anchored on the manual clock (POSIX seconds of 2026), not on time.monotonic.
            window = lease.deadline - manual.now()
            assert 0 < window <= server.lease_duration
            assert lease.may_run(manual)
            server.advance(server.lease_duration)
            assert not lease.may_run(manual)
        finally:
            conn.close()

        worker = make_worker(server, clock=manual)

        @worker.handler("one")
        def one(ctx: TaskContext, payload: Any) -> Any:
            return {"ok": True}

        with running(worker):
            task_id = server.enqueue("one", {})
            assert server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).state is (
                TaskState.SUCCEEDED
            )
            # The connection thread waits for its next heartbeat on the same clock.
            assert manual.wait_for_sleepers(1, "orbit-worker-connection")


def test_handler_environment_takes_the_same_clock() -> None:
    """HandlerEnvironment's context counts its lease down on the Clock it is given."""
    from orbit_sync.testing import HandlerEnvironment

    clock = ManualClock(100.0)
    env = HandlerEnvironment(lease_seconds=30.0, clock=clock)

    def handler(ctx: TaskContext, payload: Any) -> Any:
        before = ctx.remaining()
        clock.advance(10.0)
        return [before, ctx.remaining()]

    assert env.run(handler, {}).result == [30.0, 20.0]
    with pytest.warns(DeprecationWarning, match=r"orbit_sync\.Clock"):
        HandlerEnvironment(clock=clock.now)
