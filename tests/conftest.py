"""Suite-wide guards. Fixtures for Orbit itself come from orbit_sync's pytest plugin."""

from __future__ import annotations

import threading

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any non-daemon thread outlives the suite: it would keep a process alive."""
    leftovers = [
        t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    ]
    for thread in leftovers:
        thread.join(timeout=2.0)
    alive = [t.name for t in leftovers if t.is_alive()]
    if alive:
        session.config.get_terminal_writer().line(
            f"non-daemon threads left running: {alive}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
