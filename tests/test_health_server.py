"""The health probe's HTTP server is bounded: loopback by default, capped, timed, one thread."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from orbit_sync.contrib.health import HealthProbe, HealthServer
from orbit_sync.worker import SessionEvent


@pytest.fixture
def probe() -> HealthProbe:
    """A probe that has seen a session."""
    probe = HealthProbe()
    probe.connected(SessionEvent("s" * 32, reconnect=False))
    return probe


def _get(port: int, path: str = "/readyz") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def _idle(port: int, count: int) -> Iterator[socket.socket]:
    for _ in range(count):
        yield socket.create_connection(("127.0.0.1", port), timeout=10)


def test_listens_on_loopback_unless_told_otherwise(probe: HealthProbe) -> None:
    """The default host is 127.0.0.1; host="0.0.0.0" still listens on every interface."""
    with probe.serve(port=0) as endpoint:
        assert _get(endpoint.port)[0] == 200
        assert endpoint.address[0] == "127.0.0.1"
    with probe.serve(port=0, host="0.0.0.0") as endpoint:
        assert endpoint.address[0] == "0.0.0.0"
        assert _get(endpoint.port)[0] == 200


def test_state_has_no_session_id(probe: HealthProbe) -> None:
    """The JSON answer tells whether a session is up, never which one."""
    assert "session_id" not in probe.state()
    with probe.serve(port=0) as endpoint:
        status, body = _get(endpoint.port)
    assert status == 200 and b"s" * 32 not in body
    assert json.loads(body)["connected"] is True


def test_idle_connections_are_capped_on_one_thread(probe: HealthProbe) -> None:
    """Many idle sockets: no thread each, at most max_connections held (so at most that many
    descriptors), and a real probe still gets its answer (the oldest idle one makes way)."""
    with probe.serve(port=0, max_connections=4, timeout=60.0) as endpoint:
        threads = threading.active_count()
        fds = len(os.listdir("/proc/self/fd"))
        idle: list[socket.socket] = []
        try:
            for sock in _idle(endpoint.port, 40):
                idle.append(sock)
                if len(idle) > 4:
                    # Once all 4 slots hold idle sockets, each new one evicts the oldest: wait
                    # for that (it also keeps the connects from overflowing the listen queue,
                    # which the kernel would make wait out SYN retransmits of a second or more).
                    assert idle[-5].recv(1) == b""
            # Served in order of arrival: once this answer is in, every idle one was accepted.
            assert _get(endpoint.port)[0] == 200
            assert endpoint.open_connections <= 4
            assert threading.active_count() == threads
            # Ours are 40; the server's side holds at most 4 of its own.
            assert len(os.listdir("/proc/self/fd")) - fds <= 40 + 4
        finally:
            for sock in idle:
                sock.close()


def test_connection_that_never_sends_is_dropped_after_the_timeout(probe: HealthProbe) -> None:
    """A client that connects and says nothing (or trickles) is closed after *timeout*."""
    with probe.serve(port=0, timeout=0.3) as endpoint:
        sock = socket.create_connection(("127.0.0.1", endpoint.port), timeout=10)
        try:
            sock.sendall(b"GET /readyz HTTP/1.1\r\n")  # and never the end of the head
            assert sock.recv(100) == b""  # closed by the server, well before our 10 s
        finally:
            sock.close()
        assert endpoint.open_connections == 0


def test_bad_requests_get_clear_answers(probe: HealthProbe) -> None:
    """Unknown path 404, another method 405, garbage 400, an oversized head 400."""
    with probe.serve(port=0) as endpoint:
        assert _get(endpoint.port, "/nope")[0] == 404
        conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
        conn.request("POST", "/readyz", body=b"x")
        assert conn.getresponse().status == 405
        conn.close()
        for raw in (b"garbage\r\n\r\n", b"GET /" + b"a" * 10_000):
            with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as sock:
                sock.sendall(raw)
                assert sock.recv(100).startswith(b"HTTP/1.1 400 ")


def test_arguments_are_checked(probe: HealthProbe) -> None:
    """A non-positive cap or timeout is refused before anything listens."""
    with pytest.raises(ValueError, match="max_connections"):
        HealthServer(probe, "127.0.0.1", 0, max_connections=0)
    with pytest.raises(ValueError, match="timeout"):
        HealthServer(probe, "127.0.0.1", 0, timeout=0)
