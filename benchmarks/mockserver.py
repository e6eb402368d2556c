"""The mock server in its own process: CPU per task against the worker's as the waiting list
grows, bulk enqueue through the admin API, and memory under a steady request load."""

from __future__ import annotations

import time
from typing import Any

from benchmarks._common import proc_status
from benchmarks.roundtrip import RawSession
from orbit_sync import _codec
from orbit_sync.models import CapacityReport, new_message_id


def cpu_flatness(
    drain: Any, waiting: int, drained: int, timeout: float, servers: Any
) -> dict[str, Any]:
    """Drain *drained* no-op tasks while *waiting* more stay queued; server and worker CPU."""
    server, info = servers.open()
    try:
        enq = server.send({"op": "enqueue", "n": waiting + drained, "handler": "noop"})
        figures = drain(server, info, drained, timeout)
        figures["enqueue_seconds"] = enq["seconds"]
        figures["bulk"] = enq["bulk"]
    finally:
        servers.done(server)
    done = max(1, figures["tasks"])
    figures["server_per_task"] = figures["server_cpu"] / done
    figures["worker_per_task"] = figures["cpu"] / done
    figures["waiting"] = waiting
    return figures


#: AdminClient methods a bulk enqueue may have, newest first.
ADMIN_BULK = ("enqueue_many", "enqueue_bulk", "bulk_enqueue")


def admin_enqueue(n: int, per_task_n: int, servers: Any) -> dict[str, Any]:
    """Enqueue through the admin API: the bulk endpoint for *n* tasks when it exists, else the
    per-task endpoint for *per_task_n* tasks; against the Python API in the server's process."""
    from orbit_sync.testing import AdminClient

    server, info = servers.open()
    try:
        admin = AdminClient(info["url"], info["admin_token"])
        bulk = next((getattr(admin, m) for m in ADMIN_BULK if hasattr(admin, m)), None)
        start = time.perf_counter()
        if bulk is not None:
            count = n
            done = 0
            while done < n:
                chunk = min(10_000, n - done)
                bulk([{"handler": "noop", "payload": {"i": done + i}} for i in range(chunk)])
                done += chunk
        else:
            count = per_task_n
            for i in range(count):
                admin.enqueue("noop", {"i": i})
        seconds = time.perf_counter() - start
        # Listing them all: page by page where the client can, else one GET /tasks; against
        # the same snapshots through the Python API in the server's process.
        start = time.perf_counter()
        if hasattr(admin, "tasks"):
            listed = len(admin.tasks())
            first = time.perf_counter()
            admin.get("/tasks", limit=1000)
            page_seconds: float | None = time.perf_counter() - first
        else:
            listed = int(admin.get("/tasks")["count"])
            page_seconds = None
        list_seconds = time.perf_counter() - start - (page_seconds or 0.0)
        list_base = server.send({"op": "list"})
    finally:
        servers.done(server)
    # The same count through the Python API, in a fresh server process (the floor).
    server, _ = servers.open()
    try:
        base = server.send({"op": "enqueue", "n": count, "handler": "noop"})
    finally:
        servers.done(server)
    return {
        "bulk": bulk is not None,
        "count": count,
        "seconds": seconds,
        "base_seconds": base["seconds"],
        "base_bulk": base["bulk"],
        "estimate_100k": seconds * 100_000 / count,
        "listed": listed,
        "list_seconds": list_seconds,
        "list_base_seconds": list_base["seconds"],
        "page_seconds": page_seconds,
    }


def memory_under_load(
    marks: list[int], servers: Any, sessions_every: int = 10_000
) -> dict[str, Any]:
    """RSS of the server process after each count in *marks* of requests (capacity heartbeats,
    each with a fresh ``message_id``, 32 in flight; a new session every *sessions_every*)."""
    server, info = servers.open()
    errors = 0
    out: dict[str, Any] = {"idle_rss": proc_status(server.pid)["VmRSS"], "marks": {}}
    try:
        sent = 0
        start = time.perf_counter()
        window = 32
        for mark in marks:
            while sent < mark:
                raw = RawSession(info["url"], info["token"], info["queue_id"], 1, "load")
                try:
                    report = CapacityReport(sequence=1, capacity=1)
                    todo = min(sessions_every, mark - sent)
                    while todo > 0:
                        burst = min(window, todo)
                        for _ in range(burst):
                            raw.ws.send(
                                _codec.encode_request(
                                    "worker.capacity", new_message_id(), raw.session_id, report
                                )
                            )
                        for _ in range(burst):
                            head = raw.ws.recv()[:80].replace(" ", "")
                            if '"type":"error"' in head:
                                errors += 1
                        todo -= burst
                        sent += burst
                finally:
                    raw.close()
            out["marks"][str(mark)] = proc_status(server.pid)["VmRSS"]
        out["seconds"] = time.perf_counter() - start
        out["errors"] = errors
    finally:
        servers.done(server)
    return out
