"""pytest plugin (registered through the ``pytest11`` entry point): Orbit fixtures.

Fixtures (all function-scoped; every server, worker and thread they start is stopped after the
test):

``orbit_server``
    A running :class:`~orbit_sync.testing.MockOrbitServer` on 127.0.0.1 (port 0).
``orbit_client``
    A :class:`~orbit_sync.client.Client` bound to it with its default worker token.
``orbit_clock``
    A :class:`~orbit_sync.testing.ManualClock`. Requesting it makes ``orbit_server`` run on it:
    server time then moves only through ``orbit_server.advance(seconds)`` (or
    ``orbit_clock.advance``), which runs every lease expiry, recovery scan and backoff that falls
    due on the way, before returning.
``orbit_worker``
    A factory: ``orbit_worker(capacity=2, **worker_kwargs)`` returns an unstarted
    :class:`~orbit_sync.worker.Worker` for the server's default queue, on the server's clock
    (``orbit_server.clock``: the ``orbit_clock`` when the test requests it, or the ``clock`` of
    ``orbit_server_options`` or the marker), so that moving server time moves the worker's
    renewals, heartbeats and timed waits too; ``clock=...`` gives it another. Register
    handlers, then ``start()`` it. It is stopped (without draining) after the test.
``orbit_admin``
    An :class:`~orbit_sync.testing.AdminClient` for the server's JSON admin API, for a worker
    under test that runs in another process or language.
``orbit_chaos``
    A chaos run of your own Worker: ``orbit_chaos(worker, tasks=200, profile="flaky-wifi")``
    runs it against its own mock server through a faulty link (``orbit_sync.testing.chaos``,
    docs/mock-server.md "Chaos runs"), fails the test with the summary, the seed and the command
    that replays it when a promise broke or a handler's ``chaos.effect(ctx)`` happened twice for
    a task (``check=False``: return the report instead), and returns the report. The seed is
    ``seed=`` if given, else ``$ORBIT_CHAOS_SEED``, else 0.
``orbit_server_options``
    The default constructor keywords of ``orbit_server`` (empty). Override it in a
    ``conftest.py``, module or class to configure every server of a suite.

The ``orbit_server`` marker adds keywords for one test (or module, or class; the closest wins)::

    @pytest.mark.orbit_server(lease_duration=2.0, assignment_rate=None, manual_clock=True)
    def test_my_handler(orbit_server, orbit_client): ...

Besides the constructor's keywords (``lease_duration``, ``session_window``, ``assignment_rate``,
``clock``, ...), it takes ``manual_clock=True``, the same as requesting ``orbit_clock``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from orbit_sync.client import Client
    from orbit_sync.testing import ManualClock, MockOrbitServer
    from orbit_sync.testing._admin import AdminAPI, AdminClient
    from orbit_sync.testing.chaos import ChaosReport
    from orbit_sync.worker import Worker

#: The environment variable that gives ``orbit_chaos`` its seed when the test names none.
CHAOS_SEED_ENV = "ORBIT_CHAOS_SEED"

_ADMIN_KEY: pytest.StashKey[AdminAPI] = pytest.StashKey()

#: Worker settings that keep a failing test short: a handler that ignores cancellation holds the
#: teardown for ``cancel_grace``, an undeliverable finish for ``flush_timeout``.
_WORKER_DEFAULTS: dict[str, Any] = {
    "capacity": 2,
    "drain_timeout": 5.0,
    "cancel_grace": 1.0,
    "flush_timeout": 2.0,
    "handle_signals": False,
}


def pytest_configure(config: pytest.Config) -> None:
    """Declare the marker so ``--strict-markers`` suites can use it."""
    config.addinivalue_line(
        "markers",
        "orbit_server(**kwargs): keyword arguments for the orbit_server fixture "
        "(MockOrbitServer's, plus manual_clock=True)",
    )


def _marker_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    options: dict[str, Any] = {}
    # iter_markers yields the closest first: apply the farthest first so the closest wins.
    for marker in reversed(list(request.node.iter_markers("orbit_server"))):
        if marker.args:
            raise pytest.UsageError("@pytest.mark.orbit_server takes keyword arguments only")
        options.update(marker.kwargs)
    return options


@pytest.fixture
def orbit_server_options() -> dict[str, Any]:
    """Default keyword arguments of ``orbit_server``; override this fixture to change them."""
    return {}


@pytest.fixture
def orbit_clock() -> ManualClock:
    """A manual clock; a test that requests it gets an ``orbit_server`` driven by it."""
    from orbit_sync.testing import ManualClock

    return ManualClock()


@pytest.fixture
def orbit_server(
    request: pytest.FixtureRequest, orbit_server_options: dict[str, Any]
) -> Iterator[MockOrbitServer]:
    """A running mock Orbit server on 127.0.0.1 (port 0), stopped after the test."""
    from orbit_sync.testing import MockOrbitServer
    from orbit_sync.testing._admin import AdminAPI

    kwargs: dict[str, Any] = dict(orbit_server_options)
    kwargs.update(_marker_options(request))
    manual = bool(kwargs.pop("manual_clock", False))
    if manual or "orbit_clock" in request.fixturenames:
        if kwargs.get("clock") is not None:
            raise pytest.UsageError(
                "orbit_server: pass either clock=... or manual_clock/orbit_clock, not both"
            )
        kwargs["clock"] = request.getfixturevalue("orbit_clock")
    if kwargs.get("admin_handler") is None:
        api = AdminAPI()
        kwargs["admin_handler"] = api
        request.node.stash[_ADMIN_KEY] = api
    with MockOrbitServer(**kwargs) as server:
        yield server


@pytest.fixture
def orbit_client(orbit_server: MockOrbitServer) -> Client:
    """A Client for ``orbit_server``, authenticated with its default token."""
    from orbit_sync.client import Client

    return Client(orbit_server.url, orbit_server.token)


@pytest.fixture
def orbit_worker(
    orbit_server: MockOrbitServer, orbit_client: Client
) -> Iterator[Callable[..., Worker]]:
    """A factory of unstarted Workers for the default queue, on the server's clock (unless
    ``clock=`` says otherwise), each stopped after the test."""
    from orbit_sync.worker import Worker

    made: list[Worker] = []

    def make(**kwargs: Any) -> Worker:
        # The server's clock: a worker on real time beside a server on a manual clock would
        # never renew when the test moves time, and would lose its lease at the next move.
        options = {
            **_WORKER_DEFAULTS,
            "queue_id": orbit_server.queue_id,
            "clock": orbit_server.clock,
            **kwargs,
        }
        worker = Worker(orbit_client, **options)
        made.append(worker)
        return worker

    yield make
    # Stopped before orbit_server (which this fixture depends on) shuts down.
    for worker in reversed(made):
        worker.stop(drain=False)


@pytest.fixture
def orbit_admin(request: pytest.FixtureRequest, orbit_server: MockOrbitServer) -> AdminClient:
    """A client of ``orbit_server``'s JSON admin API (base URL and admin token)."""
    from orbit_sync.testing._admin import AdminClient

    api = request.node.stash.get(_ADMIN_KEY, None)
    if api is None:
        raise pytest.UsageError("orbit_admin: the orbit_server marker replaced admin_handler")
    return AdminClient(orbit_server.url, api.token)


@pytest.fixture
def orbit_chaos(request: pytest.FixtureRequest) -> Callable[..., ChaosReport]:
    """Run a chaos run of a Worker (``orbit_sync.testing.chaos.run``'s keywords); fail the
    test on a finding unless ``check=False``; return the report."""
    from orbit_sync.testing import chaos

    text = os.environ.get(CHAOS_SEED_ENV)
    if text is not None and not text.lstrip("-").isdigit():
        raise pytest.UsageError(f"${CHAOS_SEED_ENV} must be a whole number, not {text!r}")
    default_seed = 0 if text is None else int(text)

    def run(
        worker: Any, *, seed: int | None = None, check: bool = True, **kwargs: Any
    ) -> ChaosReport:
        chosen = default_seed if seed is None else seed
        if "replay" not in kwargs:
            # This test again, the seed where it came from: the one command that replays it.
            prefix = "" if seed is not None else f"{CHAOS_SEED_ENV}={chosen} "
            kwargs["replay"] = f"{prefix}python -m pytest {shlex.quote(request.node.nodeid)}"
        report = chaos.run(worker, seed=chosen, **kwargs)
        print(report.summary())
        return report.check() if check else report

    return run
