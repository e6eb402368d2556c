"""The process executor's limits: children replaced between attempts after K tasks or past an
RSS, and a memory budget per attempt that fails the attempt, not the worker."""

from __future__ import annotations

from typing import Any

import _process_handlers as handlers
import pytest
from _worker_helpers import make_worker, running

from orbit_sync.models import Outcome, TaskState
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import Worker
from orbit_sync.worker.process._process_limits import HANDLER_MEMORY_LIMIT, ChildLimits

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}


pytestmark = pytest.mark.orbit_server(assignment_rate=None)


@pytest.fixture
def server(orbit_server: MockOrbitServer) -> MockOrbitServer:
    """The plugin's mock server, without an assignment rate limit."""
    return orbit_server


def pids(server: MockOrbitServer, handler: str, payloads: list[dict[str, Any]]) -> list[int]:
    """Run one task per payload, one after the other; the pid each ran in."""
    out = []
    for payload in payloads:
        snap = server.wait_for(server.enqueue(handler, payload), DONE, timeout=30)
        assert snap.state is TaskState.SUCCEEDED, snap
        out.append(snap.result["pid"])
    return out


def test_children_are_replaced_after_k_tasks(server: MockOrbitServer) -> None:
    """process_max_tasks_per_child=2: tasks 1-2 share a child, 3-4 the next, 5 a third."""
    worker = make_worker(server, process_pool=1, process_max_tasks_per_child=2)
    worker.register("pid", handlers.pid, executor="process")
    with running(worker):
        seen = pids(server, "pid", [{}] * 5)
    assert seen[0] == seen[1] != seen[2] == seen[3] != seen[4]


def test_children_are_replaced_past_an_rss(server: MockOrbitServer) -> None:
    """process_max_memory_per_child=60: a child that kept 64 MB is replaced after that
    attempt; one that kept 1 MB is not."""
    worker = make_worker(server, process_pool=1, process_max_memory_per_child=60)
    worker.register("hog", handlers.hog, executor="process")
    with running(worker):
        small = pids(server, "hog", [{"mb": 1}, {"mb": 1}])
        big = pids(server, "hog", [{"mb": 64}, {"mb": 1}])
    assert small[0] == small[1] == big[0] != big[1]


def test_an_attempt_over_its_memory_limit_fails_and_the_worker_carries_on(
    server: MockOrbitServer,
) -> None:
    """memory_limit=64: 256 MB ends FAILED HANDLER_MEMORY_LIMIT (not retryable by default);
    16 MB succeeds in the same child; the retryable variant says so."""
    worker = make_worker(server, process_pool=1)
    worker.register("allocate", handlers.allocate, executor="process", memory_limit=64)
    worker.register(
        "hog",
        handlers.allocate,
        executor="process",
        memory_limit=64,
        memory_limit_retryable=True,
    )
    with running(worker):
        over = server.wait_for(server.enqueue("allocate", {"mb": 256}), DONE, timeout=30)
        fine = pids(server, "allocate", [{"mb": 16}, {"mb": 16}])
        again = server.wait_for(
            server.enqueue("hog", {"mb": 256}, max_attempts=1), DONE, timeout=30
        )
    attempt = over.attempts[-1]
    assert (over.state, attempt.outcome, attempt.error_code) == (
        TaskState.FAILED,
        Outcome.FAILED,
        HANDLER_MEMORY_LIMIT,
    )
    assert attempt.retryable is False and len(over.attempts) == 1
    assert fine[0] == fine[1]
    assert again.attempts[-1].error_code == HANDLER_MEMORY_LIMIT
    assert again.attempts[-1].retryable is True


def test_limits_survive_with_options_and_bad_values_raise(server: MockOrbitServer) -> None:
    """with_options keeps a handler's memory_limit; wrong values raise before anything runs."""
    worker = make_worker(server, process_pool=1)
    worker.register("allocate", handlers.allocate, executor="process", memory_limit=64)
    copy = worker.with_options(capacity=2)
    with running(copy):
        over = server.wait_for(server.enqueue("allocate", {"mb": 256}), DONE, timeout=30)
    assert over.attempts[-1].error_code == HANDLER_MEMORY_LIMIT
    with pytest.raises(ValueError, match='memory_limit needs executor="process"'):
        worker.register("pid", handlers.pid, memory_limit=64)
    with pytest.raises(ValueError, match="memory_limit must be a positive int"):
        worker.register("pid", handlers.pid, executor="process", memory_limit=0)
    for name in ("process_max_tasks_per_child", "process_max_memory_per_child"):
        with pytest.raises(ValueError, match=name):
            make_worker(server, **{name: 0})
    assert isinstance(copy, Worker)


def test_child_limits_decide_after_each_job_and_read_rss_only_when_limited() -> None:
    """A child goes at its K-th job or past the RSS limit; RSS is read only when limited."""
    rss = {1: 10 * 1024 * 1024, 2: 0}
    limits = ChildLimits(max_tasks=3, max_memory_mb=10, rss=rss.get)
    assert [limits.after_job(2, jobs) for jobs in (1, 2)] == [None, None]
    assert limits.after_job(2, 3) == "3 tasks (process_max_tasks_per_child=3)"
    assert limits.after_job(1, 1) is None  # exactly at the limit
    rss[1] += 1
    assert limits.after_job(1, 2) == "RSS 10 MB (process_max_memory_per_child=10)"
    unlimited = ChildLimits(rss=lambda pid: pytest.fail(f"RSS of {pid} read"))
    assert unlimited.after_job(1, 10**6) is None
