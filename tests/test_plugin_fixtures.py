"""The pytest plugin's fixtures and marker, exercised in inner pytest runs (pytester)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "test_user_handler.py"


def orbit_threads() -> set[threading.Thread]:
    """Live threads started by the mock server or a worker."""
    return {t for t in threading.enumerate() if t.name.startswith("orbit-")}


def test_marker_keywords_reach_the_server_closest_first(pytester: pytest.Pytester) -> None:
    """Module and function markers merge, the closest winning, under --strict-markers."""
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.orbit_server(lease_duration=7.0, session_window=20.0)

        @pytest.mark.orbit_server(lease_duration=3.0)
        def test_closest_wins(orbit_server):
            assert orbit_server.lease_duration == 3.0
            assert orbit_server.session_window == 20.0

        def test_module_marker(orbit_server):
            assert orbit_server.lease_duration == 7.0
        """
    )
    pytester.runpytest("--strict-markers").assert_outcomes(passed=2)


def test_options_fixture_sets_suite_defaults(pytester: pytest.Pytester) -> None:
    """Overriding orbit_server_options in a conftest configures every server; markers still win."""
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def orbit_server_options():
            return {"lease_duration": 4.0, "assignment_rate": None}
        """
    )
    pytester.makepyfile(
        """
        import pytest

        def test_default(orbit_server):
            assert orbit_server.lease_duration == 4.0

        @pytest.mark.orbit_server(lease_duration=9.0)
        def test_marker(orbit_server):
            assert orbit_server.lease_duration == 9.0
        """
    )
    pytester.runpytest().assert_outcomes(passed=2)


def test_time_control(pytester: pytest.Pytester) -> None:
    """orbit_clock or manual_clock=True give a server whose time moves only by advance()."""
    pytester.makepyfile(
        """
        import pytest
        from orbit_sync.testing import ManualClock

        def test_orbit_clock(orbit_server, orbit_clock):
            assert orbit_server.clock is orbit_clock
            start = orbit_server.now()
            orbit_server.advance(5)
            assert (orbit_server.now() - start).total_seconds() == 5
            orbit_clock.advance(1.5)
            assert (orbit_server.now() - start).total_seconds() == 6.5

        def test_expired_lease_by_advance(orbit_server, orbit_clock):
            task_id = orbit_server.enqueue("resize", {"w": 1}, deadline=10.0)
            orbit_server.advance(10)
            assert orbit_server.task(task_id).state.value == "FAILED"

        @pytest.mark.orbit_server(manual_clock=True)
        def test_marker(orbit_server):
            assert isinstance(orbit_server.clock, ManualClock)

        def test_real_time_by_default(orbit_server):
            assert not isinstance(orbit_server.clock, ManualClock)
        """
    )
    pytester.runpytest().assert_outcomes(passed=4)


def test_marker_misuse_is_reported(pytester: pytest.Pytester) -> None:
    """Positional marker arguments, or a clock plus orbit_clock, are usage errors."""
    pytester.makepyfile(
        """
        import pytest
        from orbit_sync.testing import ManualClock

        @pytest.mark.orbit_server(3.0)
        def test_positional(orbit_server):
            pass

        @pytest.mark.orbit_server(clock=ManualClock())
        def test_two_clocks(orbit_server, orbit_clock):
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*takes keyword arguments only*", "*not both*"])


def test_server_is_stopped_after_each_test(pytester: pytest.Pytester) -> None:
    """The port of a finished test's server refuses connections."""
    pytester.makepyfile(
        """
        import socket
        import pytest

        SEEN = []

        def test_a(orbit_server):
            SEEN.append(int(orbit_server.url.rsplit(":", 1)[1]))

        def test_b():
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", SEEN[0]), timeout=5)
        """
    )
    pytester.runpytest().assert_outcomes(passed=2)


def test_client_and_worker_fixtures_run_a_handler(pytester: pytest.Pytester) -> None:
    """orbit_client dials the server; orbit_worker runs a handler and is stopped afterwards."""
    before = orbit_threads()
    pytester.makepyfile(
        """
        import pytest
        from orbit_sync.models import Capability, Registration, new_id, new_secret

        def test_client(orbit_server, orbit_client):
            reg = Registration(
                queue_id=orbit_server.queue_id,
                capabilities=[Capability("resize", "1", "1")],
                capacity=1,
                instance_id=new_id(),
                instance_secret=new_secret(),
            )
            conn = orbit_client.dial_worker(reg)
            assert conn.session_id == orbit_server.sessions()[0].session_id
            conn.close()

        @pytest.mark.orbit_server(assignment_rate=None)
        def test_worker(orbit_server, orbit_worker):
            worker = orbit_worker(capacity=1)

            @worker.handler("double")
            def double(ctx, payload):
                return {"n": payload["n"] * 2}

            worker.start()
            task_id = orbit_server.enqueue("double", {"n": 21})
            snap = orbit_server.wait_for(task_id, {"SUCCEEDED", "FAILED"}, timeout=10)
            assert snap.result == {"n": 42}
            assert worker.stats().connected
        """
    )
    pytester.runpytest().assert_outcomes(passed=2)
    leftovers = {t for t in orbit_threads() - before if not t.daemon or t.is_alive()}
    for thread in leftovers:
        thread.join(5)
    assert not [t.name for t in leftovers if t.is_alive()]


def test_worker_fixture_runs_on_the_servers_clock(pytester: pytest.Pytester) -> None:
    """orbit_worker() takes the server's clock (orbit_clock, or orbit_server_options' clock):
    moving server time renews a running handler's lease; an explicit clock= still wins."""
    pytester.makeconftest(
        """
        import pytest
        from orbit_sync.testing import ManualClock

        @pytest.fixture
        def orbit_server_options(request):
            if "options_clock" in request.node.name:
                return {"clock": ManualClock(), "assignment_rate": None}
            return {"assignment_rate": None}
        """
    )
    pytester.makepyfile(
        """
        import threading
        from orbit_sync import SystemClock
        from orbit_sync.testing import ManualClock
        from orbit_sync.worker import WorkerListener

        def renewed_after_a_move(orbit_server, worker):
            renewed, started, release = threading.Event(), threading.Event(), threading.Event()

            class Renewals(WorkerListener):
                def lease_renewed(self, event):
                    renewed.set()

            worker.add_listener(Renewals())

            @worker.handler("slow")
            def slow(ctx, payload):
                started.set()
                release.wait(10)
                return {}

            worker.start()
            task_id = orbit_server.enqueue("slow", {})
            assert started.wait(10)
            orbit_server.advance(orbit_server.lease_duration / 2)
            try:
                assert renewed.wait(5), "no renewal after server time moved"
            finally:
                release.set()
            assert orbit_server.wait_for(task_id, {"SUCCEEDED"}, timeout=10).result == {}

        def test_orbit_clock(orbit_server, orbit_clock, orbit_worker):
            worker = orbit_worker()
            assert worker.options.clock is orbit_clock
            renewed_after_a_move(orbit_server, worker)

        def test_options_clock(orbit_server, orbit_worker):
            assert isinstance(orbit_server.clock, ManualClock)
            worker = orbit_worker()
            assert worker.options.clock is orbit_server.clock
            renewed_after_a_move(orbit_server, worker)

        def test_explicit_clock_wins(orbit_server, orbit_clock, orbit_worker):
            other = ManualClock()
            assert orbit_worker(clock=other).options.clock is other
            assert isinstance(orbit_worker(clock=None).options.clock, SystemClock)
        """
    )
    pytester.runpytest().assert_outcomes(passed=3)


def test_admin_fixture(pytester: pytest.Pytester) -> None:
    """orbit_admin talks to the server's admin API; a replaced admin_handler is an error."""
    pytester.makepyfile(
        """
        import pytest

        def test_admin(orbit_server, orbit_admin):
            assert orbit_admin.get("/server")["url"] == orbit_server.url
            task_id = orbit_admin.enqueue("resize", {"w": 1})
            assert orbit_server.task(task_id).payload == {"w": 1}
            assert orbit_server.token not in repr(orbit_admin)

        @pytest.mark.orbit_server(admin_handler=lambda server, conn, request: None)
        def test_replaced(orbit_admin):
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*replaced admin_handler*"])


def test_example_user_handler_suite_passes(pytester: pytest.Pytester) -> None:
    """examples/test_user_handler.py passes when run on its own with pytest."""
    result = pytester.runpytest_subprocess(str(EXAMPLE), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
