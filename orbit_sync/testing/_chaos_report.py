"""What a chaos run hands back: :class:`ChaosReport` (its figures, its findings, the replay
line) and :class:`Progress` (a long run's progress line)."""

from __future__ import annotations

import collections

import attrs

from ._chaos_check import DuplicateEffect, Violation
from ._chaos_plan import FaultRates, PlannedFault
from ._snapshots import TaskSnapshot

__all__ = ["ChaosReport", "Progress"]


@attrs.frozen
class Progress:
    """How far a run is: tasks terminal of *tasks*, faults fired, seconds so far."""

    terminal: int
    tasks: int
    faults: int
    seconds: float

    def __str__(self) -> str:
        return (
            f"chaos: {self.terminal}/{self.tasks} tasks terminal, {self.faults} faults, "
            f"{self.seconds:.1f} s"
        )


@attrs.frozen
class ChaosReport:
    """What a chaos run did and found. ``violations`` are broken promises of the worker (ours
    to fix); ``duplicate_effects`` are tasks whose handler's side effect happened more than
    once (the handler is not idempotent: yours to fix)."""

    seed: int
    profile: str
    rates: FaultRates
    tasks: int
    seconds: float
    #: Tasks by final state (``SUCCEEDED``, ...).
    states: dict[str, int]
    #: Attempts the server created (more than *tasks* once faults made it assign again).
    attempts: int
    #: Handler calls the run saw.
    invocations: int
    #: The whole schedule the seed drew, in firing order.
    planned: tuple[PlannedFault, ...]
    #: ``(seconds from the start, fault)`` of each fault fired, in order.
    fired: tuple[tuple[float, PlannedFault], ...]
    violations: tuple[Violation, ...]
    duplicate_effects: tuple[DuplicateEffect, ...]
    #: ``chaos.effect(ctx)`` calls.
    effects: int
    #: Workers started (one, plus one per deploy).
    workers: int
    reconnects: int
    #: Connections the link carried, and how many times it cut them.
    connections: int
    cuts: int
    #: Finishes not delivered when a worker stopped (each worker's ``ShutdownReport``).
    unreported: int
    #: The one call (or command) that replays this run's fault schedule.
    replay: str
    #: Every task as the server stored it at the end, in enqueue order.
    snapshots: tuple[TaskSnapshot, ...] = attrs.field(repr=False, eq=False)
    #: Wall-clock moment the run started (the server stamps attempts on the wall clock).
    started_wall: float = attrs.field(default=0.0, repr=False)

    @property
    def ok(self) -> bool:
        """No violation and no duplicate effect."""
        return not self.violations and not self.duplicate_effects

    def summary(self) -> str:
        """A table of the run's figures and faults, then every finding, then the seed and the
        replay line."""
        kinds = collections.Counter(f.kind for _, f in self.fired)
        rows = [
            ("seed", str(self.seed)),
            ("profile", self.profile),
            ("tasks", str(self.tasks)),
            ("states", ", ".join(f"{k} {v}" for k, v in sorted(self.states.items()))),
            ("attempts", str(self.attempts)),
            ("handler calls", str(self.invocations)),
            ("effects", str(self.effects)),
            ("workers", str(self.workers)),
            ("connections", str(self.connections)),
            ("reconnects", str(self.reconnects)),
            ("faults fired", f"{len(self.fired)} of {len(self.planned)} planned"),
            *((f"  {kind}", str(n)) for kind, n in sorted(kinds.items())),
            ("seconds", f"{self.seconds:.1f}"),
            ("violations", str(len(self.violations))),
            ("non-idempotent tasks", str(len(self.duplicate_effects))),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        lines += [f"VIOLATION {v}" for v in self.violations]
        lines += [f"YOUR HANDLER {d}" for d in self.duplicate_effects]
        lines.append(f"seed {self.seed}; replay: {self.replay}")
        return "\n".join(lines)

    def check(self, *, effects: bool = True) -> ChaosReport:
        """Raise ``AssertionError`` with :meth:`summary` when a violation (or, with *effects*,
        a duplicate effect) was found; return the report otherwise."""
        if self.violations or (effects and self.duplicate_effects):
            raise AssertionError(f"chaos run failed\n{self.summary()}")
        return self
