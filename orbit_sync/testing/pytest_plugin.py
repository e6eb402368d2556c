"""pytest plugin (registered through the ``pytest11`` entry point): Orbit fixtures.

``orbit_server`` is a running :class:`~orbit_sync.testing.MockOrbitServer` on loopback, stopped
after the test; ``orbit_client`` is a :class:`~orbit_sync.client.Client` bound to it. Configure the
server with the ``orbit_server`` marker, whose keyword arguments go to the server's constructor::

    @pytest.mark.orbit_server(lease_duration=2.0, assignment_rate=100)
    def test_my_handler(orbit_server, orbit_client): ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from orbit_sync.client import Client
    from orbit_sync.testing import MockOrbitServer


def pytest_configure(config: pytest.Config) -> None:
    """Declare the marker so ``--strict-markers`` suites can use it."""
    config.addinivalue_line(
        "markers", "orbit_server(**kwargs): keyword arguments for the orbit_server fixture"
    )


@pytest.fixture
def orbit_server(request: pytest.FixtureRequest) -> Iterator[MockOrbitServer]:
    """A running mock Orbit server on 127.0.0.1 (port 0), stopped after the test."""
    from orbit_sync.testing import MockOrbitServer

    kwargs: dict[str, Any] = {}
    marker = request.node.get_closest_marker("orbit_server")
    if marker is not None:
        kwargs.update(marker.kwargs)
    with MockOrbitServer(**kwargs) as server:
        yield server


@pytest.fixture
def orbit_client(orbit_server: MockOrbitServer) -> Client:
    """A Client for ``orbit_server``, authenticated with its default token."""
    from orbit_sync.client import Client

    return Client(orbit_server.url, orbit_server.token)
