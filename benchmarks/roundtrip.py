"""Round trip of one ``task.renew`` through WorkerConnection, against a raw echo baseline.

The baseline is the floor: websocket-client sending the same frame text to a websockets echo server
on loopback and reading it back. The ratio is what our connection (encode, slot table, reader
thread hand-off, strict decode, lease checks) plus the mock server's processing cost on top.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import websocket
from websockets.sync.server import ServerConnection, serve

from orbit_sync import _codec
from orbit_sync.client import Client
from orbit_sync.models import Capability, CapacityReport, Registration
from orbit_sync.testing import MockOrbitServer

ROUNDS = 400


def _median_per_call(fn: Any, rounds: int = ROUNDS, repeat: int = 5) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        samples.append((time.perf_counter() - start) / rounds)
    return statistics.median(samples)


def _echo(connection: ServerConnection) -> None:
    for message in connection:
        connection.send(message)


def bench_baseline(frame: str) -> float:
    """Raw websocket-client round trip of *frame* to an echo server."""
    with serve(_echo, "127.0.0.1", 0, compression=None, ping_interval=None) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        port = server.socket.getsockname()[1]
        ws = websocket.create_connection(f"ws://127.0.0.1:{port}/", skip_utf8_validation=True)
        try:

            def once() -> None:
                ws.send(frame)
                ws.recv()

            return _median_per_call(once)
        finally:
            ws.close()
            server.shutdown()
            thread.join(timeout=5)


def bench_round_trip() -> tuple[float, float]:
    """(ours, baseline) seconds per renew round trip."""
    with MockOrbitServer(assignment_rate=1000, lease_duration=60.0) as server:
        server.enqueue("bench", {"n": 1})
        registration = Registration(server.queue_id, [Capability("bench", "1", "1")], 1)
        with Client(server.url, server.token).dial_worker(registration) as conn:
            conn.capacity(CapacityReport(sequence=1, capacity=1))
            ref = conn.next_assignment(timeout=10).attempt
            conn.start(ref)
            ours = _median_per_call(lambda: conn.renew(ref))
            frame = _codec.encode_request("task.renew", "4" * 32, conn.session_id, ref)
    return ours, bench_baseline(frame)
