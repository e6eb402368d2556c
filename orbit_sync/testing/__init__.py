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

Also here for tests of code that uses the worker: :class:`HandlerEnvironment` (run a handler
without a server) and :class:`ManualClock`, the :class:`orbit_sync.Clock` for tests: pass the
server's ``ManualClock`` to ``Worker(clock=...)`` and ``dial_worker(clock=...)`` and
``server.advance()`` moves the worker's time too (``ManualClock(follow=frozen)`` follows
freezegun's frozen time instead).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._deprecated import deprecated, moved

if TYPE_CHECKING:
    from ._admin import AdminAPI
    from ._admin_client import AdminClient, AdminError
    from ._clock import ManualClock
    from ._cutlink import CuttingLink
    from ._environment import HandlerEnvironment
    from ._faults import Fault, Faults
    from ._http import AdminExchange, HttpRequest
    from ._options import EnqueueOptions
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

# Imported on first use (PEP 562): the pytest plugin lives in this package and is loaded by every
# pytest run of a project that installed orbit-sync, even without the ``testing`` extra; the mock
# server's WebSocket side (websockets) must not be needed until a test actually uses it.
_EXPORTS: dict[str, str] = {
    "AdminAPI": "._admin",
    "AdminClient": "._admin_client",
    "AdminError": "._admin_client",
    "AdminExchange": "._http",
    "AdminHandler": "._server",
    "AttemptSnapshot": "._snapshots",
    "CuttingLink": "._cutlink",
    "EnqueueOptions": "._options",
    "EventLog": "._snapshots",
    "EventRecord": "._snapshots",
    "EvidenceSnapshot": "._snapshots",
    "Fault": "._faults",
    "Faults": "._faults",
    "HandlerEnvironment": "._environment",
    "HttpRequest": "._http",
    "ManualClock": "._clock",
    "MockOrbitServer": "._server",
    "RetrySafety": "._snapshots",
    "SessionSnapshot": "._snapshots",
    "TaskPolicy": "._snapshots",
    "TaskSnapshot": "._snapshots",
}
#: Clocks folded into ManualClock and orbit_sync.SystemClock: the class in ._clock that keeps
#: the old behaviour for one more release (its INSTEAD says what to use).
_OLD_CLOCKS = {"FakeClock": "FakeClock", "SystemClock": "AdvancingSystemClock"}
#: The server state machine's internals: no longer public, reachable for one more release
#: (with no public home to point at).
_INTERNAL = ("InvariantError", "OrbitState", "SCOPE_CONNECT", "SCOPE_CONSUME", "queue_scope")

__all__ = [
    "AdminAPI",
    "AdminClient",
    "AdminError",
    "AdminExchange",
    "AdminHandler",
    "AttemptSnapshot",
    "CuttingLink",
    "EnqueueOptions",
    "EventLog",
    "EventRecord",
    "EvidenceSnapshot",
    "Fault",
    "Faults",
    "HandlerEnvironment",
    "HttpRequest",
    "ManualClock",
    "MockOrbitServer",
    "RetrySafety",
    "SessionSnapshot",
    "TaskPolicy",
    "TaskSnapshot",
]


def __getattr__(name: str) -> Any:
    if name in ("Clock", "ServerClock"):
        # orbit_sync.Clock is the one clock protocol: the server takes it too.
        return moved(__name__, name, "orbit_sync", "Clock")
    if name in _OLD_CLOCKS:
        from . import _clock

        old = getattr(_clock, _OLD_CLOCKS[name])
        return deprecated(__name__, name, old.INSTEAD, old)
    if name in _INTERNAL:
        from . import _state

        instead = "it is internal to the mock server: drive it through MockOrbitServer"
        return deprecated(__name__, name, instead, getattr(_state, name))
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
