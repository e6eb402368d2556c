"""The mock server in its own process, driven by JSON lines on stdin.

Started by the harness (:func:`start`); prints one ready line with its URL, tokens and pid, then
answers commands until stdin closes:

- ``{"op": "enqueue", "n": N, "handler": H}``: N tasks through the Python API in this process
  (the bulk method when the server has one), answers ``{"seconds": s, "bulk": bool}``; an
  optional ``"options"`` object adds enqueue options to each (``{"max_attempts": 1}``).
- ``{"op": "list"}``: snapshots of every task through the Python API (``server.tasks()``),
  answers ``{"seconds": s, "count": n}``.
- ``{"op": "sessions", "n": N, "timeout": s}``: waits until N sessions are connected, answers
  ``{"ok": bool}``.
- ``{"op": "done", "timeout": s}``: waits until every task SUCCEEDED, answers ``{"ok": bool}``
  (it waits on the first task not done yet, again until there is none: no polling).
- ``{"op": "settled", "timeout": s}``: the same, until every task is terminal (whatever its
  outcome).
- ``{"op": "attempts"}``: every task's state and attempts (id, state, finish time in seconds
  since the epoch) and how many results it kept only as evidence, answers ``{"tasks": [...]}``.

Tokens travel only over the pipe to the harness; nothing here prints them elsewhere.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import Child, commands, emit

#: Task states nothing moves on from.
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}
#: Names a bulk enqueue method may have on MockOrbitServer, newest first.
BULK_METHODS = ("enqueue_many", "enqueue_bulk", "bulk_enqueue")


def _bulk(server: Any) -> Any:
    """The server's bulk enqueue taking a list of specs, or None."""
    for name in BULK_METHODS:
        method = getattr(server, name, None)
        if method is not None:
            return method
    # Until the server has one, its state machine's, applied the way MockOrbitServer.enqueue
    # applies one task (under its lock, then its actions committed).
    state = getattr(server, "_state", None)
    many = getattr(state, "enqueue_many", None)
    commit, lock = getattr(server, "_commit", None), getattr(server, "_cond", None)
    if many is None or commit is None or lock is None:
        return None

    def apply(specs: list[dict[str, Any]]) -> None:
        with lock:
            commit(many(specs)[1])

    return apply


def enqueue(
    server: Any, n: int, handler: str, options: dict[str, Any] | None = None
) -> tuple[float, bool]:
    """Enqueue *n* no-op tasks (with enqueue *options*); return (seconds, whether a bulk method
    was used)."""
    options = options or {}
    start = time.perf_counter()
    bulk = _bulk(server)
    if bulk is not None:
        done = 0
        while done < n:
            chunk = min(10_000, n - done)
            bulk(
                [{"handler": handler, "payload": {"i": done + i}, **options} for i in range(chunk)]
            )
            done += chunk
        return time.perf_counter() - start, True
    for i in range(n):
        server.enqueue(handler, {"i": i}, **options)
    return time.perf_counter() - start, False


def attempts(server: Any) -> list[dict[str, Any]]:
    """Each task's state, its attempts and its evidence count, as plain JSON."""
    return [
        {
            "task_id": task.task_id,
            "state": task.state.value,
            "evidence": len(task.evidence),
            "attempts": [
                {
                    "attempt_id": a.attempt_id,
                    "state": a.state.value,
                    "finished_at": a.finished_at.timestamp() if a.finished_at else None,
                }
                for a in task.attempts
            ],
        }
        for task in server.tasks()
    ]


def _connected(n: int) -> Any:
    return lambda server: sum(s.connected for s in server.sessions()) >= n


def _wait(server: Any, predicate: Any, timeout: float) -> bool:
    try:
        server.wait_until(predicate, timeout)
    except TimeoutError:
        return False
    return True


def _all_in(server: Any, states: set[str], timeout: float) -> bool:
    """Wait until every task is in one of *states*; False after *timeout*."""
    from orbit_sync.models import TaskState

    pending = [s for s in TaskState if s.value not in states]
    end = time.monotonic() + timeout
    while True:
        page, _ = server.task_page(states=pending, limit=1)
        if not page:
            return True
        try:
            server.wait_for(page[0].task_id, states, max(0.0, end - time.monotonic()))
        except TimeoutError:
            return False


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lease-duration", type=float, default=30.0)
    parser.add_argument("--session-window", type=float, default=45.0)
    parser.add_argument("--max-connections", type=int, default=128)
    args = parser.parse_args()

    from orbit_sync.testing import AdminAPI, MockOrbitServer

    api = AdminAPI()
    server = MockOrbitServer(
        lease_duration=args.lease_duration,
        session_window=args.session_window,
        assignment_rate=None,
        max_connections=args.max_connections,
        admin_handler=api,
    )
    with server:
        emit(
            {
                "url": server.url,
                "token": server.token,
                "queue_id": server.queue_id,
                "admin_token": api.token,
            }
        )
        for command in commands():
            if command["op"] == "enqueue":
                seconds, bulk = enqueue(
                    server, int(command["n"]), str(command["handler"]), command.get("options")
                )
                emit({"seconds": seconds, "bulk": bulk})
            elif command["op"] == "attempts":
                emit({"tasks": attempts(server)})
            elif command["op"] == "list":
                start = time.perf_counter()
                count = len(server.tasks())
                emit({"seconds": time.perf_counter() - start, "count": count})
            elif command["op"] == "sessions":
                emit({"ok": _wait(server, _connected(int(command["n"])), command["timeout"])})
            elif command["op"] == "done":
                emit({"ok": _all_in(server, {"SUCCEEDED"}, float(command["timeout"]))})
            elif command["op"] == "settled":
                emit({"ok": _all_in(server, TERMINAL, float(command["timeout"]))})
            else:
                emit({"error": f"unknown op {command['op']!r}"})
    return 0


def start(
    *, lease_duration: float = 30.0, max_connections: int = 128
) -> tuple[Child, dict[str, Any]]:
    """Start the server process; return it and its ready line (url, token, queue_id, ...)."""
    child = Child(
        [
            str(Path(__file__).resolve()),
            "--lease-duration",
            str(lease_duration),
            "--max-connections",
            str(max_connections),
        ]
    )
    return child, child.read()


if __name__ == "__main__":
    raise SystemExit(main())
