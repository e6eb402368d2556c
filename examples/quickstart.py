"""Quickstart: a Worker running a mixed batch against the embedded mock server.

    make demo            # or: python examples/quickstart.py [-v]

What happens, in a few seconds:

- eight ``thumbnail`` tasks succeed;
- two ``sync-inventory`` tasks fail retryably on their first attempt, then succeed on the second;
- one ``export`` task is cancelled while it runs (it stops at its next checkpoint: CANCELLED);
- one ``report`` task is running when the connection drops: the worker reconnects, resumes the
  attempt, keeps renewing its lease, and finishes it once.

Against a real Orbit server, build the Client with your ``wss://`` URL and token and use your
queue id; everything else stays the same.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
from typing import Any

from orbit_sync.client import Client
from orbit_sync.testing import MockOrbitServer
from orbit_sync.worker import Backoff, Fail, TaskContext, Worker

DONE = {"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"}

export_started = threading.Event()
report_started = threading.Event()


def build_worker(server: MockOrbitServer) -> Worker:
    """A worker for the server's queue with four handlers."""
    worker = Worker(
        Client(server.url, server.token),
        queue_id=server.queue_id,
        capacity=4,
        reconnect_backoff=Backoff(initial=0.05, maximum=0.5),
    )

    @worker.handler("thumbnail", version="1", payload_version="1")
    def thumbnail(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
        ctx.sleep(0.05)  # the "work"; returns early (raising) if the task is cancelled
        return {"thumbnail": f"{payload['image']}-128.png"}

    @worker.handler("sync-inventory")
    def sync_inventory(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
        if ctx.attempt == 1:
            # A transient upstream problem: FAILED, and the server retries after its backoff.
            raise Fail("UPSTREAM_BUSY", "warehouse API busy", retryable=True)
        return {"sku": payload["sku"], "synced_on_attempt": ctx.attempt}

    @worker.handler("export")
    def export(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
        export_started.set()
        rows = 0
        while rows < 1_000_000:
            ctx.raise_if_cancelled()  # a checkpoint: the cancel request stops us here
            ctx.sleep(0.02)
            rows += 1000
        return {"rows": rows}

    @worker.handler("report")
    def report(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
        report_started.set()
        for _ in range(24):  # about 1.2 s: long enough to live through a reconnect and a renewal
            ctx.sleep(0.05)
        return {"pages": 12}

    return worker


def main() -> int:
    """Run the batch and print a per-outcome summary; exit 0 when everything went as expected."""
    verbose = "-v" in sys.argv[1:]
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    with MockOrbitServer(lease_duration=2.0, assignment_rate=50) as server:
        tasks: dict[str, str] = {}
        for i in range(8):
            tasks[server.enqueue("thumbnail", {"image": f"img-{i}"})] = "thumbnail"
        for sku in ("A-1", "B-2"):
            tid = server.enqueue("sync-inventory", {"sku": sku}, backoff_initial=0.2)
            tasks[tid] = "sync-inventory"
        export_id = server.enqueue("export", {"table": "orders"})
        tasks[export_id] = "export"
        report_id = server.enqueue("report", {"month": "2026-09"})
        tasks[report_id] = "report"

        worker = build_worker(server)
        with worker:  # start() in the background; stop() (drain) on exit
            if not export_started.wait(10) or not report_started.wait(10):
                print("handlers did not start", file=sys.stderr)
                return 1
            server.request_cancel(export_id)
            # Say so before the worker's WARNING about it: the drop is part of the tour.
            print(
                "demo: cutting the worker's connection on purpose while 'report' runs; the "
                "WARNING below is expected (the worker reconnects and resumes it)",
                file=sys.stderr,
                flush=True,
            )
            server.disconnect()
            snaps = {tid: server.wait_for(tid, DONE, timeout=20) for tid in tasks}
        stats = worker.stats()

    print(f"{'task':<34} {'handler':<15} {'state':<10} attempts  result")
    for tid, snap in snaps.items():
        print(
            f"{tid:<34} {tasks[tid]:<15} {snap.state.value:<10} {len(snap.attempts):>8}  "
            f"{snap.result}"
        )
    outcomes = collections.Counter(snap.state.value for snap in snaps.values())
    print("\nper outcome: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    # The worker counts attempts, the table above tasks: a task retried after a FAILED attempt
    # ends SUCCEEDED, so "failed" here is not a failed task.
    print(
        f"worker, per attempt: succeeded={stats.succeeded} "
        f"failed={stats.failed} (first attempts the server retried) "
        f"cancelled={stats.cancelled} unknown={stats.unknown}"
    )
    print(
        f"worker, connection: renewals={stats.renewals} reconnects={stats.reconnects} "
        f"lease_losses={stats.lease_losses} renew_lag_max={stats.renew_lag_max * 1000:.1f}ms"
    )

    expected = collections.Counter({"SUCCEEDED": len(tasks) - 1, "CANCELLED": 1})
    ok = (
        outcomes == expected
        and snaps[export_id].state.value == "CANCELLED"
        and all(len(s.attempts) == 2 for t, s in snaps.items() if tasks[t] == "sync-inventory")
        and len(snaps[report_id].attempts) == 1
        and stats.reconnects >= 1
        and stats.lease_losses == 0
    )
    print("\nOK" if ok else "\nUNEXPECTED RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
