"""Suite-wide guards. Fixtures for Orbit itself come from orbit_sync's pytest plugin."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from _cli_process import procs  # noqa: F401 (the fixture, for the tests that run processes)
from hypothesis import HealthCheck, settings

import orbit_sync.testing

# orbit_sync.testing imports its exports on first use, and an inner pytester run
# (test_plugin_fixtures, test_freezegun, test_readme) removes every module it imported first when
# it ends: a later test would then import a second MockOrbitServer class beside the one
# orbit_sync.testing keeps, or miss a module it saw. Importing them all here, before any inner
# run, keeps one of each for the whole session.
for _name in orbit_sync.testing.__all__:
    getattr(orbit_sync.testing, _name)

# Property tests check what is generated, not how fast: on a loaded 2-core CI machine the
# per-example deadline and the slow-generation health check fail runs whose every example passed.
settings.register_profile("orbit-sync", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("orbit-sync")


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


@pytest.fixture(autouse=True)
def _no_orbit_sync_threads_left() -> Iterator[None]:
    """Fail a test that leaves one of the SDK's or mock server's threads running."""
    before = set(threading.enumerate())
    yield
    left = [
        t for t in threading.enumerate() if t not in before and t.name.startswith("orbit-sync-")
    ]
    for thread in left:
        thread.join(timeout=2.0)
    alive = [t.name for t in left if t.is_alive()]
    assert not alive, f"orbit-sync threads left running: {alive}"
