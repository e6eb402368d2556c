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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._admin import AdminAPI
    from ._admin_client import AdminClient, AdminError
    from ._clock import Clock, ManualClock, SystemClock
    from ._cutlink import CuttingLink
    from ._faults import Fault, Faults
    from ._server import AdminHandler, MockOrbitServer
    from ._snapshots import (
        AttemptSnapshot,
        EventLog,
        EventRecord,
        EvidenceSnapshot,
        RetrySafety,
        SessionSnapshot,
        TaskPolicy,
        TaskSnapshot,
    )
    from ._state import SCOPE_CONNECT, SCOPE_CONSUME, InvariantError, OrbitState, queue_scope

# Imported on first use (PEP 562): the pytest plugin lives in this package and is loaded by every
# pytest run of a project that installed orbit-sync, even without the ``testing`` extra; the mock
# server's WebSocket side (websockets) must not be needed until a test actually uses it.
_EXPORTS: dict[str, str] = {
    "AdminAPI": "._admin",
    "AdminClient": "._admin_client",
    "AdminError": "._admin_client",
    "AdminHandler": "._server",
    "AttemptSnapshot": "._snapshots",
    "Clock": "._clock",
    "CuttingLink": "._cutlink",
    "EventLog": "._snapshots",
    "EventRecord": "._snapshots",
    "EvidenceSnapshot": "._snapshots",
    "Fault": "._faults",
    "Faults": "._faults",
    "InvariantError": "._state",
    "ManualClock": "._clock",
    "MockOrbitServer": "._server",
    "OrbitState": "._state",
    "RetrySafety": "._snapshots",
    "SCOPE_CONNECT": "._state",
    "SCOPE_CONSUME": "._state",
    "SessionSnapshot": "._snapshots",
    "SystemClock": "._clock",
    "TaskPolicy": "._snapshots",
    "TaskSnapshot": "._snapshots",
    "queue_scope": "._state",
}

__all__ = [
    "SCOPE_CONNECT",
    "SCOPE_CONSUME",
    "AdminAPI",
    "AdminClient",
    "AdminError",
    "AdminHandler",
    "AttemptSnapshot",
    "Clock",
    "CuttingLink",
    "EventLog",
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module, __name__), name)
    except ImportError as exc:
        raise ImportError(
            f"orbit_sync.testing.{name} needs the 'testing' extra: "
            "pip install 'orbit-sync[testing]'"
        ) from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
