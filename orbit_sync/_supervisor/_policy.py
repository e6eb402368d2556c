"""The supervisor's decisions, apart from processes and time: which exit status is worst, when a
dead child is restarted, and when the supervisor gives up instead.

- A child that dies after its worker was ready (connected) is restarted after a short jittered
  delay (:data:`RESTART_BACKOFF` attempt 0: up to half a second): the host gets its capacity back
  at once, and a fleet of children killed together does not restart in step.
- A child that dies before it was ready is restarted with exponential backoff (1, 2, 4 s ...);
  after :data:`START_FAILURES` such deaths in a row (no child of the slot ready in between) the
  supervisor stops with that child's status. A status that says restarting cannot help (usage,
  credentials, protocol, a server not reached within ``--first-connect-timeout``: 2, 4, 5, 6)
  stops it at once. A child killed from outside while it starts
  (SIGKILL: the OOM killer, an operator; SIGTERM) is restarted with the same backoff but is no
  evidence that starting fails: it does not count toward giving up.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterable

import attrs

from .._cli_report import (
    EXIT_AUTH,
    EXIT_FAILED,
    EXIT_FORCED,
    EXIT_OK,
    EXIT_PROTOCOL,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from ..worker import Backoff

__all__ = ["RESTART_BACKOFF", "START_FAILURES", "Restarts", "worst"]

#: From best to worst. A status that says restarting will not help (usage, credentials,
#: protocol) wins over one that says it may (failure, forced stop).
SEVERITY = (
    EXIT_OK,
    EXIT_FORCED,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    EXIT_PROTOCOL,
    EXIT_AUTH,
    EXIT_USAGE,
)
#: Statuses that stop the supervisor when a child ends with them before it was ready (the user
#: asked for 6: a child that never reached the server within the bound is not restarted).
FATAL_AT_START = frozenset({EXIT_USAGE, EXIT_AUTH, EXIT_PROTOCOL, EXIT_UNREACHABLE})
#: Deaths before ready, in a row, after which the supervisor stops.
START_FAILURES = 3
#: Raw return codes of a child killed from outside (not by its own doing).
_KILLED_FROM_OUTSIDE = frozenset({-signal.SIGKILL, -signal.SIGTERM})
#: Delay before restart n: attempt 0 after a child that was ready, 1, 2, ... after start failures.
RESTART_BACKOFF = Backoff(initial=0.5, maximum=16.0)


def worst(statuses: Iterable[int]) -> int:
    """The worst of *statuses* per :data:`SEVERITY` (unknown ones count as failures)."""
    rank = {status: i for i, status in enumerate(SEVERITY)}
    return max(statuses, key=lambda s: rank.get(s, rank[EXIT_FAILED]), default=EXIT_OK)


def status_of(returncode: int, *, killed: bool, stopping: bool) -> int:
    """A child's exit status for the supervisor's own: a death by the supervisor's SIGKILL (the
    stop deadline passed) is a forced stop; by SIGTERM while stopping (the host's stop signal
    reaching the child directly, as systemd's default ``KillMode`` does), a clean one: the worker
    handles SIGTERM while it runs, so the signal found the child loading the application or
    exiting, with nothing running; any other signal death is a failure."""
    if returncode >= 0:
        return returncode
    if killed:
        return EXIT_FORCED
    if stopping and returncode == -signal.SIGTERM:
        return EXIT_OK
    return EXIT_FAILED


@attrs.define
class Restarts:
    """One slot's restart bookkeeping."""

    failures: int = 0  # deaths before ready, in a row (kills from outside excepted)
    starts: int = 0  # deaths before ready in a row, kills included: the backoff's attempt
    rng: random.Random = attrs.field(factory=random.Random)

    def ready(self) -> None:
        """A child of the slot reported ready: starting works."""
        self.failures = self.starts = 0

    def after_exit(
        self, status: int, *, was_ready: bool, returncode: int | None = None
    ) -> float | None:
        """The delay before the next child of this slot, or None: give up (stop the supervisor
        with *status*). *returncode* is the raw one (negative: the signal that ended it)."""
        if was_ready:
            self.ready()
            return RESTART_BACKOFF.delay(0, self.rng)
        self.starts += 1
        if returncode not in _KILLED_FROM_OUTSIDE:
            self.failures += 1
            if status in FATAL_AT_START or self.failures >= START_FAILURES:
                return None
        return RESTART_BACKOFF.delay(self.starts, self.rng)
