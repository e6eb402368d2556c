"""What the worker reports about itself: live counters and the shutdown report."""

from __future__ import annotations

import attrs

__all__ = ["AttemptInfo", "ShutdownReport", "WorkerStats"]


@attrs.frozen
class WorkerStats:
    """A snapshot of :meth:`Worker.stats() <orbit_sync.worker.Worker.stats>`.

    ``succeeded``/``failed``/``cancelled``/``unknown`` count finishes the server acknowledged, by
    the outcome the worker reported; ``evidence_only`` counts those of them the server kept only
    as evidence (the lease was already gone). ``renew_lag_*`` is how late the lease watchdog woke
    up compared with its schedule (CPU-bound handlers delay it; see the README).
    ``reconnects`` counts sessions established after the first one; ``dial_failures`` counts
    connection attempts that failed (a worker that cannot reach its server shows 0 reconnects
    and a growing ``dial_failures``). ``stuck`` counts handlers finished ``UNKNOWN`` while
    still running (past their time limit and the cancel grace, or at shutdown): each holds one
    of ``capacity``'s slots until it returns.
    """

    connected: bool
    running: int
    succeeded: int
    failed: int
    cancelled: int
    unknown: int
    evidence_only: int
    finish_rejected: int
    renewals: int
    renew_failures: int
    renew_lag_last: float
    renew_lag_max: float
    lease_losses: int
    reconnects: int
    skipped_assignments: int
    dial_failures: int = 0
    stuck: int = 0


@attrs.frozen
class AttemptInfo:
    """Which attempt a shutdown report entry is about."""

    task_id: str
    attempt_id: str
    handler: str


@attrs.frozen
class ShutdownReport:
    """What :meth:`Worker.run`/:meth:`Worker.stop` return once the worker has stopped.

    - ``drained``: every handler returned before its context had to be cancelled;
    - ``cancelled``: handlers whose context was cancelled with ``shutdown`` and that then returned;
    - ``abandoned``: handlers still running after the cancel grace: finished ``UNKNOWN`` with
      ``SHUTDOWN_TIMEOUT`` (their effect is uncertain); their thread is a daemon and a late result
      is dropped;
    - ``unreported``: attempts whose finish could not be delivered before the end (no
      connection): the server will recover them when their lease expires;
    - ``error``: the error that stopped the worker (bad credentials, ...), if any.
    """

    drained: bool
    cancelled: tuple[AttemptInfo, ...] = ()
    abandoned: tuple[AttemptInfo, ...] = ()
    unreported: tuple[AttemptInfo, ...] = ()
    error: BaseException | None = attrs.field(default=None, eq=False)
