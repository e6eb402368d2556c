"""The supervisor under random SIGKILLs and recycling, and under a leaking handler (small runs;
``make supervisor-chaos`` runs the full ones)."""

from __future__ import annotations

import pytest
from _supervisor_chaos import chaos, leak

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_chaos_recycling_and_kills_lose_nothing() -> None:
    """2 processes recycled every 50 tasks, a child SIGKILLed every 0.3-1 s, 4 times at most
    (the run takes a few seconds, so it sees kills): every task SUCCEEDED, at most one run per
    attempt, no orphan."""
    result = chaos(
        tasks=300,
        processes=2,
        recycle=50,
        seed=7,
        time_limit=150,
        kill_every=(0.3, 1.0),
        max_kills=4,
    )
    assert result["violations"] == [], result
    assert result["recycled"] >= 2 and result["kills"] >= 1, result


@pytest.mark.timeout(180)
def test_a_leaking_handler_is_recycled_within_the_memory_limit() -> None:
    """1 MB leaked per task, --max-memory-per-child 100: every child stays bounded, no task
    fails."""
    # A child starts at ~35 MB: of 200 tasks over 2 processes, one process runs at least 100,
    # past the limit, so at least one child is recycled (and one would pass the bound if not).
    result = leak(tasks=200, limit=100, time_limit=150)
    assert result["violations"] == [], result
    assert result["children"] >= 3, result  # at least one child was recycled
