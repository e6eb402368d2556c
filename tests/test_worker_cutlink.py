"""A real Worker through a real TCP proxy that adds latency and cuts connections (a small fixed
seed; ``make chaos`` runs the long ones)."""

from __future__ import annotations

import argparse
import dataclasses
import socket
import threading

from _cutlink_run import RunResult, Timeline, missed_targets, run
from _scripted import WAIT

from orbit_sync.testing import CuttingLink


def _echo_server() -> tuple[socket.socket, threading.Thread]:
    """A TCP server that echoes one connection's bytes back."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    thread = threading.Thread(target=serve, name="echo", daemon=True)
    thread.start()
    return listener, thread


def test_link_delivers_in_order_and_cuts_on_demand() -> None:
    """Bytes cross the link in order, both ways; cut_now() resets the open connection."""
    listener, thread = _echo_server()
    port = listener.getsockname()[1]
    with listener, CuttingLink(f"ws://127.0.0.1:{port}", rtt=0.01) as link:
        with socket.create_connection(("127.0.0.1", link.port), timeout=WAIT) as client:
            for i in range(20):
                client.sendall(f"{i:02d}".encode())
            got = b""
            while len(got) < 40:
                got += client.recv(4096)
            assert got == b"".join(f"{i:02d}".encode() for i in range(20))
            assert link.cut_now() == 1
            assert client.recv(4096) == b"", "the cut connection must end"
        assert link.cuts == 1 and link.connections == 1
    thread.join(WAIT)


def test_worker_through_a_cutting_link_loses_nothing_and_runs_nothing_twice() -> None:
    """Fifty tasks of 0-0.3 s through a 20 ms link cut every ~0.3 s: all terminal, at most once
    per attempt, every stored result the handler's own."""
    # The handlers' time (about 2 s at capacity 4) keeps the run long enough for several cuts
    # however quickly the worker gets through its sessions.
    timeline = Timeline()
    result = run(
        tasks=50,
        rtt=0.02,
        mean_cut=0.3,
        seed=13,
        capacity=4,
        time_limit=40.0,
        task_max=0.3,
        timeline=timeline,
    )
    assert result.violations == [], result
    assert result.cuts >= 3, "the link must really have cut the worker's connections"
    assert result.reconnects >= 2, "and the worker must have come back through it"
    assert result.states == {"SUCCEEDED": 50}, result.states
    _check_timeline(timeline, result)


def _check_timeline(timeline: Timeline, result: RunResult) -> None:
    """The timeline holds every attempt the server created, each task ending on a SUCCEEDED
    one, and what the worker saw of the cuts, on the run's time axis."""
    assert len(timeline.attempts) == result.attempts
    last = {task: state for task, _, state, _, _, _ in timeline.attempts}
    assert sorted(last) == list(range(50)) and set(last.values()) == {"SUCCEEDED"}
    # The server stamps attempts on the wall clock, the run is timed on the monotonic one.
    for _, _, _, assigned, started, finished in timeline.attempts:
        assert finished is not None and 0 <= assigned <= finished <= result.seconds + 1
        assert started is None or assigned <= started <= finished
    # Each event is stamped on its own thread before it is appended: nearly, not quite, sorted.
    assert all(0 <= at <= result.seconds + 5 for at, _, _ in timeline.events)
    kinds = {kind for _, kind, _ in timeline.events}
    assert {"connected", "disconnected", "finished"} <= kinds
    assert kinds <= {"connected", "disconnected", "dial_failed", "lease_lost", "finished"}


def test_chaos_targets_fail_the_run_that_misses_them() -> None:
    """make chaos fails a seed whose ratio, longest gap or settle time misses its target."""
    args = argparse.Namespace(min_ratio=0.2, max_gap=10.0, max_settle=30.0)
    result = RunResult(
        tasks=10,
        seconds=50.0,
        states={"SUCCEEDED": 10},
        not_terminal=0,
        cuts=1,
        connections=2,
        reconnects=1,
        repeated=[],
        wrong_results=[],
        unreported=0,
        longest_gap=9.9,
        settle_seconds=30.0,
    )
    assert missed_targets(args, 0.2, result) == []
    slow = dataclasses.replace(result, longest_gap=10.0, settle_seconds=30.1)
    assert missed_targets(args, 0.19, slow) == [
        "ratio 0.190 < 0.2",
        "10.0 s without a finish while cutting",
        "all terminal 30.1 s after the cuts stopped",
    ]
    unchecked = argparse.Namespace(min_ratio=None, max_gap=None, max_settle=None)
    assert missed_targets(unchecked, 0.0, slow) == []
