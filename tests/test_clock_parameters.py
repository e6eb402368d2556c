"""Every public ``clock`` parameter takes an ``orbit_sync.Clock``; a bare function still works for
one release, with a DeprecationWarning pointing at the caller; anything else is refused."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
from _scripted import WAIT
from _worker_helpers import leased_task, make_worker, running

from orbit_sync.contrib.health import HealthProbe
from orbit_sync.models import AttemptState, Lease, TaskState, new_id
from orbit_sync.testing import HandlerEnvironment, ManualClock, MockOrbitServer
from orbit_sync.worker import SessionEvent, TaskContext

DEPRECATED = r"function as clock is deprecated.*orbit_sync\.Clock"
NOT_A_CLOCK = r"clock must be an orbit_sync\.Clock"


def _lease() -> Lease:
    """A running lease with a 30 s window, its local deadline anchored at 100 (so 129.75)."""
    now = dt.datetime(2026, 9, 17, 8, 0, tzinfo=dt.timezone.utc)
    return Lease(True, AttemptState.RUNNING, now + dt.timedelta(seconds=30), now).with_deadline(
        100.0
    )


def test_lease_may_run_and_remaining_read_the_clock_given() -> None:
    """Lease.may_run/remaining decide on the Clock passed, however far real time is from it."""
    lease = _lease()
    clock = ManualClock(129.0)
    assert lease.may_run(clock) and lease.remaining(clock) == pytest.approx(0.75)
    clock.advance(0.75)
    assert not lease.may_run(clock) and lease.remaining(clock) == 0.0


def test_lease_takes_a_function_with_a_warning_and_refuses_a_non_clock() -> None:
    """A function still decides may_run/remaining, warning at the caller; an object is refused."""
    lease = _lease()
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as caught:
        assert lease.may_run(lambda: 129.7)
        assert not lease.may_run(lambda: 129.75)
        assert lease.remaining(lambda: 120.0) == pytest.approx(9.75)
    assert [w.filename for w in caught] == [__file__] * 3
    with pytest.raises(TypeError, match=NOT_A_CLOCK):
        lease.may_run(object())  # type: ignore[arg-type]


def test_task_context_counts_down_on_its_clock() -> None:
    """TaskContext(clock=Clock): remaining() follows the fake clock, not real time."""
    clock = ManualClock(50.0)
    ctx = TaskContext(leased_task(), new_id(), deadline=80.0, clock=clock)
    assert ctx.remaining() == 30.0
    clock.advance(29.5)
    assert ctx.remaining() == 0.5
    clock.advance(1.0)
    assert ctx.remaining() == 0.0


def test_task_context_takes_a_function_with_a_warning_and_refuses_a_non_clock() -> None:
    """TaskContext(clock=function) warns at the caller and still counts down on it."""
    now = [50.0]
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as caught:
        ctx = TaskContext(leased_task(), new_id(), deadline=80.0, clock=lambda: now[0])
    assert caught[0].filename == __file__
    now[0] = 70.0
    assert ctx.remaining() == 10.0
    with pytest.raises(TypeError, match=NOT_A_CLOCK):
        TaskContext(leased_task(), new_id(), clock=42.0)  # type: ignore[arg-type]


def test_health_probe_measures_ages_on_its_clock() -> None:
    """HealthProbe(clock=Clock): the session age is fake time elapsed."""
    clock = ManualClock(10.0)
    probe = HealthProbe(clock=clock)
    probe.connected(SessionEvent("s" * 32, reconnect=False))
    clock.advance(7.5)
    assert probe.state()["session_age_s"] == 7.5


def test_health_probe_takes_a_function_with_a_warning_and_refuses_a_non_clock() -> None:
    """HealthProbe(clock=function) warns at the caller and still reads it."""
    now = [10.0]
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as caught:
        probe = HealthProbe(clock=lambda: now[0])
    assert caught[0].filename == __file__
    probe.connected(SessionEvent("s" * 32, reconnect=False))
    now[0] = 12.0
    assert probe.state()["session_age_s"] == 2.0
    with pytest.raises(TypeError, match=NOT_A_CLOCK):
        HealthProbe(clock="monotonic")  # type: ignore[arg-type]


def test_handler_environment_counts_down_on_a_deprecated_function() -> None:
    """HandlerEnvironment(clock=function) warns once and its contexts read that function."""
    now = [100.0]
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as caught:
        env = HandlerEnvironment(lease_seconds=30.0, clock=lambda: now[0])
    assert len(caught) == 1 and caught[0].filename == __file__

    def handler(ctx: TaskContext, payload: Any) -> Any:
        before = ctx.remaining()
        now[0] += 12.0
        return [before, ctx.remaining()]

    assert env.run(handler, {}).result == [30.0, 18.0]


def test_the_worker_gives_each_handler_context_its_clock() -> None:
    """A handler's ctx.remaining() runs on the Worker's clock: server.advance moves it."""
    manual = ManualClock()
    entered, go = threading.Event(), threading.Event()
    seen: list[float] = []
    with MockOrbitServer(clock=manual, assignment_rate=None) as server:
        worker = make_worker(server, clock=manual)

        @worker.handler("resize")
        def resize(ctx: TaskContext, payload: Any) -> Any:
            seen.append(ctx.remaining())
            entered.set()
            assert go.wait(WAIT)
            seen.append(ctx.remaining())
            return None

        with running(worker):
            task_id = server.enqueue("resize", {})
            assert entered.wait(WAIT)
            server.advance(5.0)  # less than half the lease: no renewal moves the deadline
            go.set()
            assert server.wait_for(task_id, {"SUCCEEDED"}, timeout=WAIT).state is (
                TaskState.SUCCEEDED
            )
    window = server.lease_duration - 0.25
    assert seen == [pytest.approx(window), pytest.approx(window - 5.0)]
