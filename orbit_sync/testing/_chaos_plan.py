"""The fault schedule of a chaos run: its knobs (:class:`FaultRates`), the named profiles, and
the schedule one seed draws from them (:func:`plan`), a pure function of its arguments.

Faults are placed by progress, not by time: "after the 40th finished attempt, cut every
connection". Progress is what a run of fast handlers and a run of slow ones share, so the same
seed puts its faults at the same points of either, and a schedule never runs out before the
tasks do.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

__all__ = ["KINDS", "PROFILES", "FaultRates", "PlannedFault", "plan", "profile"]

#: The fault kinds, in the order their streams are drawn (the order is part of the schedule).
KINDS = ("cut", "delay", "lost_ack", "duplicate", "lease_expiry", "restart")

#: Requests whose answer a lost acknowledgement drops (each applied by the server first).
ACK_TYPES = ("task.start", "task.finish", "task.renew", "worker.capacity")


def _every(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError("a fault's spacing must be a number of finished attempts > 0, or None")
    return float(value)


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{attribute.name} must be a number >= 0")


@attrs.frozen(kw_only=True)
class FaultRates:
    """Every knob of a chaos run's faults. ``*_every`` is the mean number of finished attempts
    between two faults of that kind (``None``: never); each gap is drawn from the seed between
    half and one and a half times it.

    - *cut_every*: reset every open connection at once (both ends, in-flight bytes lost).
    - *delay_every*: hold every byte on the link for *delay_seconds* (a stall, no loss).
    - *lost_ack_every*: the server applies the next request of a drawn type
      (``task.start``, ``task.finish``, ``task.renew``, ``worker.capacity``) and its answer is
      lost: dropped, or the connection closed instead of answering.
    - *duplicate_every*: the server sends the next assignment twice, byte for byte.
    - *lease_expiry_every*: hold the link longer than the lease, so the server expires the
      leases of the attempts in flight while their handlers run or their finishes wait.
    - *restart_every*: deploy: a new worker is built from the same options and started, and
      the running one is stopped as ``SIGTERM`` stops it (``stop(drain=True)``).
    - *rtt*: seconds added to every round trip on the link.
    - *lease*: the server's lease window (s); *session_window* is four of them.
    """

    cut_every: float | None = attrs.field(default=None, converter=_every)
    delay_every: float | None = attrs.field(default=None, converter=_every)
    delay_seconds: float = attrs.field(default=0.3, validator=_non_negative)
    lost_ack_every: float | None = attrs.field(default=None, converter=_every)
    duplicate_every: float | None = attrs.field(default=None, converter=_every)
    lease_expiry_every: float | None = attrs.field(default=None, converter=_every)
    restart_every: float | None = attrs.field(default=None, converter=_every)
    rtt: float = attrs.field(default=0.0, validator=_non_negative)
    lease: float = attrs.field(default=2.0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if not 1.0 <= self.lease <= 120.0:
            raise ValueError("lease must be between 1 and 120 seconds (the protocol's bounds)")
        if not self.rtt < 10:
            raise ValueError("rtt must be under 10 seconds")

    def spacing(self, kind: str) -> float | None:
        """The mean spacing of *kind* (one of :data:`KINDS`)."""
        value: float | None = getattr(self, f"{kind}_every")
        return value


#: The named profiles; ``default`` brings a little of everything.
PROFILES: dict[str, FaultRates] = {
    "default": FaultRates(
        cut_every=30,
        delay_every=60,
        lost_ack_every=50,
        duplicate_every=40,
        lease_expiry_every=60,
        restart_every=150,
        rtt=0.01,
    ),
    # A laptop on a bad network: slow, often cut, often stalled.
    "flaky-wifi": FaultRates(
        cut_every=15,
        delay_every=20,
        delay_seconds=0.8,
        lost_ack_every=80,
        lease_expiry_every=120,
        rtt=0.08,
    ),
    # A rolling deploy: the worker is replaced again and again while work flows.
    "deploy": FaultRates(restart_every=40, cut_every=150, rtt=0.01),
    # Answers lost and assignments repeated, the connection mostly up.
    "lossy": FaultRates(
        lost_ack_every=15, duplicate_every=15, cut_every=80, delay_every=80, rtt=0.01
    ),
}


def profile(name: str) -> FaultRates:
    """The :class:`FaultRates` of profile *name*; ``ValueError`` naming the profiles."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown chaos profile {name!r}; expected one of {', '.join(PROFILES)}"
        ) from None


@attrs.frozen
class PlannedFault:
    """One fault of the schedule: *kind* after *after* finished attempts; *seconds* for a hold,
    *frame_type* and *variant* for a lost acknowledgement (``drop`` or ``close``)."""

    after: int
    kind: str
    seconds: float = 0.0
    frame_type: str | None = None
    variant: str | None = None

    def describe(self) -> str:
        """One line: what the fault does."""
        if self.kind in ("delay", "lease_expiry"):
            return f"{self.kind} (link held {self.seconds:g} s)"
        if self.kind == "lost_ack":
            return f"lost_ack ({self.frame_type} answer {self.variant})"
        return self.kind


def plan(seed: int, tasks: int, rates: FaultRates) -> tuple[PlannedFault, ...]:
    """The faults *seed* draws for a run of *tasks* tasks under *rates*, in firing order.

    Every kind has its own stream (seeded from *seed* and the kind's name), so turning one
    knob leaves the other kinds' faults where they were.
    """
    if type(seed) is not int:
        raise TypeError("seed must be an int")
    if type(tasks) is not int or tasks < 1:
        raise ValueError("tasks must be an int >= 1")
    faults: list[PlannedFault] = []
    for kind in KINDS:
        mean = rates.spacing(kind)
        if mean is None:
            continue
        rng = random.Random(f"{seed}:{kind}")
        at = 0.0
        while True:
            at += rng.uniform(0.5, 1.5) * mean
            if at >= tasks:
                break
            faults.append(_draw(kind, round(at), rng, rates))
    faults.sort(key=lambda f: (f.after, KINDS.index(f.kind)))
    return tuple(faults)


def _draw(kind: str, after: int, rng: random.Random, rates: FaultRates) -> PlannedFault:
    if kind == "delay":
        return PlannedFault(
            after, kind, seconds=round(rng.uniform(0.5, 1.5) * rates.delay_seconds, 3)
        )
    if kind == "lease_expiry":
        # Past the lease and the server's own margin, so every lease in flight runs out.
        return PlannedFault(after, kind, seconds=round(rates.lease * 1.25 + 0.3, 3))
    if kind == "lost_ack":
        return PlannedFault(
            after, kind, frame_type=rng.choice(ACK_TYPES), variant=rng.choice(("drop", "close"))
        )
    return PlannedFault(after, kind)
