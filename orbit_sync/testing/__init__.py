"""``orbit_sync.testing``: a real ``pulse.worker.v1`` server for tests.

:class:`MockOrbitServer` listens on loopback and implements the server side of the protocol
(sessions and epochs, capacity, assignment, leases, recovery, idempotency, cancellation, limits),
with a Python API to enqueue tasks, inspect them, move server time and inject faults::

    from orbit_sync.testing import MockOrbitServer, ManualClock

    with MockOrbitServer(clock=ManualClock()) as server:
        task_id = server.enqueue("resize", {"w": 10})
        ...                                   # run a worker against server.url / server.token
        server.advance(32)                    # expire a lease without waiting
        snap = server.wait_for(task_id, {"SUCCEEDED", "NEEDS_REVIEW"})

The state machine behind it (:class:`OrbitState`) is plain Python with an injectable clock.
"""

from __future__ import annotations

from ._admin import AdminAPI, AdminClient, AdminError
from ._clock import Clock, ManualClock, SystemClock
from ._faults import Fault, Faults
from ._server import AdminHandler, MockOrbitServer
from ._snapshots import (
    AttemptSnapshot,
    EventRecord,
    EvidenceSnapshot,
    RetrySafety,
    SessionSnapshot,
    TaskPolicy,
    TaskSnapshot,
)
from ._state import SCOPE_CONNECT, SCOPE_CONSUME, InvariantError, OrbitState, queue_scope

__all__ = [
    "SCOPE_CONNECT",
    "SCOPE_CONSUME",
    "AdminAPI",
    "AdminClient",
    "AdminError",
    "AdminHandler",
    "AttemptSnapshot",
    "Clock",
    "EventRecord",
    "EvidenceSnapshot",
    "Fault",
    "Faults",
    "InvariantError",
    "ManualClock",
    "MockOrbitServer",
    "OrbitState",
    "RetrySafety",
    "SessionSnapshot",
    "SystemClock",
    "TaskPolicy",
    "TaskSnapshot",
    "queue_scope",
]
