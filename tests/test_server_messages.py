"""The mock server's Python API names what is wrong and what would be right."""

from __future__ import annotations

import pytest

from orbit_sync.testing import MockOrbitServer


def test_an_unknown_task_state_lists_the_valid_ones() -> None:
    """``wait_for``/``task_page`` given a state that does not exist name the valid ones."""
    with MockOrbitServer() as server:
        task_id = server.enqueue("echo", {})
        expected = (
            r"'UNKNOWN' is not a task state; expected one of WAITING, LEASED, RUNNING, "
            r"SUCCEEDED, FAILED, CANCELLED, NEEDS_REVIEW"
        )
        with pytest.raises(ValueError, match=expected):
            server.wait_for(task_id, {"UNKNOWN"}, timeout=0.1)
        with pytest.raises(ValueError, match="'DONE' is not a task state"):
            server.wait_for(task_id, "DONE", timeout=0.1)
        with pytest.raises(ValueError, match="'UNKNOWN' is not a task state"):
            server.task_page(states=["UNKNOWN"])
