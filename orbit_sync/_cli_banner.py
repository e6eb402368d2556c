"""The banner ``orbit-sync worker`` prints on standard error before the worker starts: what is
about to run, in a user's words (never the token)."""

from __future__ import annotations

import os
import platform
import sys
from typing import TYPE_CHECKING, Any

from ._cli_report import say

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["banner"]


#: The listeners orbit-sync ships, in a user's words (the banner names others by class).
_LISTENER_WORDS = {
    "orbit_sync.contrib.health.HealthProbe": "health probe",
    "orbit_sync.contrib.prometheus.PrometheusListener": "Prometheus metrics",
    "orbit_sync.contrib.otel.OpenTelemetryListener": "OpenTelemetry traces",
    "orbit_sync.contrib.django._db.CloseOldConnections": "Django database connections closed"
    " around each task",
}


def _listener_words(listener: object) -> str:
    kind = type(listener)
    return _LISTENER_WORDS.get(f"{kind.__module__}.{kind.__qualname__}", kind.__name__)


def _supervised(link: Any) -> str:
    """What a supervised process does for its supervisor, in a user's words."""
    s = link.settings
    parts = [f"pid {s.supervisor_pid}, which gets this process's health and drains it"]
    limits = []
    if s.max_tasks is not None:
        limits.append(f"{s.max_tasks} tasks")
    if s.max_memory_mb is not None:
        limits.append(f"{s.max_memory_mb} MB RSS")
    if limits:
        parts.append(f"recycled after {' or '.join(limits)}")
    if s.metrics:
        parts.append("metrics in its Prometheus target")
    return "; ".join(parts)


def banner(worker: Worker, target: str, link: Any = None) -> None:
    """What is about to run, on stderr (stdout stays the application's). Never the token.
    A process replacing another in its supervisor's slot says so in one line: the banner of
    the first one is above it, and is the same."""
    replaces = link.settings.replaces if link is not None else None
    if replaces is not None:
        say(
            f"worker {target} started again, replacing worker process"
            f" {replaces} (with the settings of the first one's banner)"
        )
        return
    options = worker.options
    registration = worker.registration
    client = worker.client
    server = getattr(client, "base_url", None) or type(client).__name__
    in_process = {key for key, executor in worker.executors.items() if executor == "process"}
    limits = worker.time_limits

    def described(c: Any) -> str:
        key = (c.handler, c.handler_version, c.payload_version)
        limit = limits.get(key)
        return (
            f"{c.handler} ({c.handler_version}/{c.payload_version}"
            f"{', process' if key in in_process else ''}"
            f"{'' if limit is None else f', time limit {limit:g} s'})"
        )

    handlers = ", ".join(described(c) for c in registration.capabilities)
    outbox = options.outbox
    # The supervisor's own listeners are described on their own line, not by class name.
    own = link.attached if link is not None else ()
    listeners = ", ".join(
        _listener_words(x) for x in worker.listeners if not any(x is y for y in own)
    )
    lines = [
        f"orbit-sync {_version()} worker {target} (pid {os.getpid()},"
        f" Python {platform.python_version()})",
        f"  server:    {server}",
        f"  queue:     {registration.queue_id}",
        f"  capacity:  {registration.capacity}, drain timeout {options.drain_timeout:g} s",
        f"  handlers:  {handlers}",
        f"  outbox:    {os.fspath(outbox) if outbox is not None else 'none'}",
        f"  listeners: {listeners or 'none'}",
    ]
    if link is not None:
        lines.append(f"  supervisor: {_supervised(link)}")
    lines.append("SIGTERM or Ctrl-C drains; a second signal stops at once.")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _version() -> str:
    from ._version import __version__

    return __version__
