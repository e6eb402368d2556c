"""The low-level API used the way a script would: one connection, one task, blocking calls.

Runs against the embedded mock server, so it needs nothing else::

    python examples/blocking_script.py

Against a real Orbit server, replace the mock server with your URL, token and queue id
(``wss://`` URLs verify certificates; pass ``ssl_context=`` for a private CA).
"""

from __future__ import annotations

import logging
import sys

from orbit_sync.client import Client
from orbit_sync.errors import OrbitError
from orbit_sync.models import (
    Capability,
    CapacityReport,
    Finish,
    Outcome,
    Registration,
)
from orbit_sync.testing import MockOrbitServer

log = logging.getLogger("blocking_script")


def resize(payload: dict[str, int]) -> dict[str, int]:
    """The business work: pretend to resize an image."""
    return {"width": payload["w"] * 2, "height": payload["h"] * 2}


def main() -> int:
    """Enqueue one task on the mock server, run it through the low-level API, check the result."""
    with MockOrbitServer() as server:
        task_id = server.enqueue("resize", {"w": 10, "h": 5})

        client = Client(server.url, server.token)
        registration = Registration(
            queue_id=server.queue_id,
            capabilities=[Capability("resize", "1", "1")],
            capacity=1,
        )
        with client.dial_worker(registration) as conn:
            # No assignment arrives before the first capacity report is acknowledged.
            conn.capacity(CapacityReport(sequence=1, capacity=1))
            assignment = conn.next_assignment(timeout=10)
            log.info("assigned task %s", assignment.task.task_id)

            # The assignment is a reservation; only a start whose lease allows it grants the run.
            started = conn.start(assignment.attempt)
            if not started.lease.may_run():
                log.warning("the server did not grant the run; nothing to do")
                return 1

            result = resize(assignment.task.payload)
            if not started.lease.may_run():
                # Past the local deadline: the result is still sent, and kept as evidence.
                log.warning("lease expired while working")

            finished = conn.finish(Finish(assignment.attempt, Outcome.SUCCEEDED, result))
            log.info(
                "finish %s: task is %s", finished.receipt.disposition, finished.receipt.task_state
            )

        snapshot = server.wait_for(task_id, {"SUCCEEDED"}, timeout=10)
        print(f"task {task_id} {snapshot.state.value}: {snapshot.result}")
        return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(main())
    except OrbitError as exc:
        print(f"orbit error: {exc}", file=sys.stderr)
        sys.exit(2)
