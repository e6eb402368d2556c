"""The public surface: a sorted ``__all__`` whose every name resolves."""

from __future__ import annotations

import importlib
import re
import time
import warnings
from typing import Any

import pytest

import orbit_sync


def test_all_sorted_and_resolvable() -> None:
    """``__all__`` is sorted, unique, and every name is importable from the package."""
    names = orbit_sync.__all__
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    for name in names:
        assert hasattr(orbit_sync, name), name


def test_error_tree() -> None:
    """Every public error derives from OrbitError; CallTimeout is also a TimeoutError."""
    for name in orbit_sync.__all__:
        obj = getattr(orbit_sync, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, orbit_sync.OrbitError), name
    assert issubclass(orbit_sync.CallTimeout, TimeoutError)


@pytest.mark.parametrize("package", ["orbit_sync.worker", "orbit_sync.testing"])
def test_subpackage_all_sorted_and_resolvable(package: str) -> None:
    """Each subpackage's ``__all__`` is sorted and unique, and every name resolves."""
    module = importlib.import_module(package)
    names = module.__all__
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a public name never resolves through a deprecation
        for name in names:
            assert getattr(module, name) is not None, name


#: (package, name, where it lives now, its name there): old paths that resolve with a
#: DeprecationWarning.
MOVED = [
    ("orbit_sync", "HandlerEnvironment", "orbit_sync.testing", "HandlerEnvironment"),
    ("orbit_sync.worker", "HandlerEnvironment", "orbit_sync.testing", "HandlerEnvironment"),
    ("orbit_sync.worker", "OutboxError", "orbit_sync", "OutboxError"),
    # The clocks folded into one protocol and its real implementation.
    ("orbit_sync.clock", "WorkerClock", "orbit_sync", "SystemClock"),
    ("orbit_sync.worker", "WorkerClock", "orbit_sync", "SystemClock"),
    ("orbit_sync.testing", "ServerClock", "orbit_sync", "Clock"),
    ("orbit_sync.testing", "Clock", "orbit_sync", "Clock"),
]


@pytest.mark.parametrize(("package", "name", "home", "new_name"), MOVED)
def test_an_old_import_path_warns_and_gives_the_same_object(
    package: str, name: str, home: str, new_name: str
) -> None:
    """A name that left a package's ``__all__`` still resolves there, with a DeprecationWarning
    naming its new home (and name), to the very object of the new home."""
    module = importlib.import_module(package)
    assert name not in module.__all__
    new = home if new_name == name else f"{home}.{new_name}"
    with pytest.warns(DeprecationWarning, match=rf"{package}\.{name} is .*{re.escape(new)}"):
        old = getattr(module, name)
    assert old is getattr(importlib.import_module(home), new_name)


@pytest.mark.parametrize(
    "name", ["InvariantError", "OrbitState", "SCOPE_CONNECT", "SCOPE_CONSUME", "queue_scope"]
)
def test_a_mock_server_internal_warns_without_naming_a_private_module(name: str) -> None:
    """The mock server's internals that left ``orbit_sync.testing`` still resolve there for one
    release, warning towards MockOrbitServer, never towards the private module they live in."""
    import orbit_sync.testing as testing

    assert name not in testing.__all__
    with pytest.warns(DeprecationWarning, match=r"internal to the mock server") as caught:
        old = getattr(testing, name)
    assert "._" not in str(caught[0].message)
    assert old is getattr(importlib.import_module("orbit_sync.testing._state"), name)


def test_outbox_error_is_exported_once() -> None:
    """OutboxError is public at the top, with the other errors, and in no subpackage."""
    exporters = [
        package
        for package in ("orbit_sync", "orbit_sync.worker", "orbit_sync.testing")
        if "OutboxError" in importlib.import_module(package).__all__
    ]
    assert exporters == ["orbit_sync"]


def test_send_many_is_the_public_batch_api() -> None:
    """Batches go through the public send_many, PendingCall and BatchCall (exported by the
    connection module); the old internal Pipeline and pipeline_of are gone."""
    import orbit_sync.connection as connection

    assert callable(orbit_sync.WorkerConnection.send_many)
    assert callable(orbit_sync.WorkerConnection.wake_on_end)
    assert isinstance(vars(orbit_sync.WorkerConnection)["assignments_received"], property)
    assert {"BatchCall", "PendingCall", "Settable"} <= set(connection.__all__)
    assert connection.BatchCall._fields == ("request_type", "body", "message_id", "timeout")
    assert callable(connection.PendingCall.result) and callable(connection.PendingCall.done)
    for gone in ("Pipeline", "pipeline_of"):
        assert not hasattr(connection, gone), gone
        assert gone not in connection.__all__
    for gone in ("submit", "submit_many", "take_assignment", "after_assignments"):
        assert not hasattr(orbit_sync.WorkerConnection, gone), gone


def test_every_clock_speaks_the_one_clock_protocol() -> None:
    """Real time (SystemClock) and the test clock (ManualClock, from a date or from zero) are
    Clocks; a bare function is not."""
    from orbit_sync.testing import ManualClock

    for clock in (orbit_sync.SystemClock(), ManualClock(), ManualClock(0.0)):
        assert isinstance(clock, orbit_sync.Clock), clock
    assert not isinstance(time.monotonic, orbit_sync.Clock)


def test_one_clock_protocol_one_real_and_one_test_clock_are_public() -> None:
    """The public clocks are orbit_sync.Clock (the protocol), orbit_sync.SystemClock (real
    time) and orbit_sync.testing.ManualClock (tests), and nothing else named a clock."""
    import orbit_sync.testing as testing
    import orbit_sync.worker as worker

    def clocks(module: Any) -> set[str]:
        return {name for name in module.__all__ if "Clock" in name}

    assert clocks(orbit_sync) == {"Clock", "SystemClock"}
    assert clocks(testing) == {"ManualClock"}
    assert clocks(worker) == set()


def test_a_function_as_dial_clock_is_deprecated_but_still_anchors_leases() -> None:
    """dial_worker(clock=function) warns for one release and still reads time from it; a
    non-clock is refused before anything is sent; Worker(clock=function) is refused."""
    from _scripted import registration

    from orbit_sync.testing import MockOrbitServer

    with MockOrbitServer(assignment_rate=None) as server:
        client = orbit_sync.Client(server.url, server.token)
        reg = registration(queue_id=server.queue_id)
        with pytest.warns(DeprecationWarning, match=r"orbit_sync\.Clock") as caught:
            conn = client.dial_worker(reg, clock=lambda: 1000.0)
        assert caught[0].filename == __file__  # points at the caller
        try:
            conn.capacity(orbit_sync.CapacityReport(sequence=1, capacity=1))
            server.enqueue("resize", {})
            lease = conn.start(conn.next_assignment(5.0).attempt).lease
            assert lease.deadline is not None and 1000.0 < lease.deadline <= 1000.0 + 30
        finally:
            conn.close()
        sessions = len(server.sessions())
        with pytest.raises(TypeError, match=r"orbit_sync\.Clock"):
            client.dial_worker(reg, clock=object())  # type: ignore[arg-type]
        assert len(server.sessions()) == sessions  # refused before any hello
        with pytest.raises(TypeError, match=r"orbit_sync\.Clock"):
            orbit_sync.Worker(client, queue_id=server.queue_id, clock=time.monotonic)  # type: ignore[arg-type]


def test_the_old_fake_clock_warns_and_keeps_its_behaviour() -> None:
    """testing.FakeClock and worker.FakeClock warn towards ManualClock; the old class still counts
    from 0 and advances by hand."""
    import orbit_sync.testing as testing
    import orbit_sync.worker as worker
    from orbit_sync.testing import ManualClock

    with pytest.warns(DeprecationWarning, match=r"testing\.FakeClock.*testing\.ManualClock"):
        fake_clock = testing.FakeClock
    with pytest.warns(DeprecationWarning, match=r"worker\.FakeClock"):
        assert worker.FakeClock is fake_clock
    alone = fake_clock()
    alone.advance(2.5)
    assert alone.now() == 2.5
    assert isinstance(alone, ManualClock) and isinstance(alone, orbit_sync.Clock)
    # Following a ManualClock: test_worker_clock.py's deprecated-FakeClock test.


def test_the_old_testing_system_clock_warns_and_still_advances() -> None:
    """testing.SystemClock warns towards orbit_sync.SystemClock; the old class still reads POSIX
    seconds, moves forward with advance(), and runs a mock server."""
    import orbit_sync.testing as testing
    from orbit_sync.testing import MockOrbitServer

    with pytest.warns(DeprecationWarning, match=r"use orbit_sync\.SystemClock"):
        old = testing.SystemClock
    clock = old()
    assert isinstance(clock, orbit_sync.Clock)
    assert abs(clock.now() - time.time()) < 60
    before = clock.now()
    clock.advance(3600)
    assert clock.now() - before >= 3600
    with MockOrbitServer(clock=clock) as server:
        assert abs(server.now().timestamp() - clock.now()) < 60
