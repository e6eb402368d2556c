"""Chaos runs of your own Worker: its real handlers against the mock server through a faulty
link, faults drawn from a seed, then the protocol's promises checked (docs/mock-server.md,
"Chaos runs")::

    from orbit_sync.testing import chaos

    report = chaos.run(worker, seed=7, tasks=200, profile="flaky-wifi")
    report.check()        # AssertionError with the summary, the seed and the replay line

In a handler, ``chaos.effect(ctx)`` says that its side effect happened: a task whose effect
happens more than once is reported as not idempotent.
"""

from __future__ import annotations

from ._chaos_check import DuplicateEffect, Violation
from ._chaos_plan import KINDS, PROFILES, FaultRates, PlannedFault, plan, profile
from ._chaos_report import ChaosReport, Progress
from ._chaos_run import effect, run

__all__ = [
    "KINDS",
    "PROFILES",
    "ChaosReport",
    "DuplicateEffect",
    "FaultRates",
    "PlannedFault",
    "Progress",
    "Violation",
    "effect",
    "plan",
    "profile",
    "run",
]
