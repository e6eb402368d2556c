"""How long the worker waits before each reconnect: :class:`Backoff` draws a jittered delay for
an attempt number, :class:`Redial` picks that number from how the dials since the last welcome
failed (docs/reliability.md, "The reconnect delay", says why): a *refused* dial backs off
exponentially; a *cut* (upgrade accepted, lost before the welcome) waits the shortest delay; a
*reset* (lost before the upgrade was answered) waits the shortest for the first
:data:`RESET_GRACE` in a row, a flaky link's short runs, then backs off like a refusing proxy.
A welcome starts everything over.
"""

from __future__ import annotations

import random

import attrs

from ..._seconds import seconds
from ...errors import WorkerDisconnected

__all__ = ["CUT", "REFUSED", "RESET", "RESET_GRACE", "Backoff", "Redial", "dial_failure"]

CUT = "cut"
RESET = "reset"
REFUSED = "refused"

#: Resets in a row that are taken for a bad link before they count as a refusing proxy.
RESET_GRACE = 3

_RNG = random.Random()


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    seconds(value, attribute.name, positive=True)


@attrs.frozen
class Backoff:
    """Delay before reconnect attempt *n* (0-based): ``cap = min(maximum, initial * 2**n)``, then
    a uniform pick in ``[cap / 2, cap]`` ("equal jitter") for ``n >= 1``, and in ``[0, initial]``
    ("full jitter") for ``n == 0`` (after a welcome or a cut): that halves the mean wait on a
    flaky link and spreads a fleet's first dials after a server restart.
    """

    initial: float = attrs.field(default=0.2, validator=_positive)
    maximum: float = attrs.field(default=10.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.initial > self.maximum:
            raise ValueError("initial must not exceed maximum")

    def cap(self, attempt: int) -> float:
        """The upper bound of the delay before *attempt* (the exponent capped: 2**n stays small)."""
        return min(self.maximum, self.initial * 2.0 ** min(max(attempt, 0), 64))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        cap = self.cap(attempt)
        low = 0.0 if attempt <= 0 else cap / 2
        return (rng or _RNG).uniform(low, cap)


def dial_failure(exc: BaseException) -> str:
    """The kind of a failed dial: :data:`CUT`, :data:`RESET` or :data:`REFUSED`."""
    if isinstance(exc, WorkerDisconnected):
        if exc.dial_stage == "hello":
            return CUT
        if exc.dial_stage in ("tls", "upgrade"):
            return RESET
    return REFUSED


class Redial:
    """The reconnect waits of one worker (used by its connection thread only)."""

    def __init__(self, backoff: Backoff, rng: random.Random | None = None) -> None:
        self._backoff = backoff
        self._rng = rng
        self._refusals = 0  # since the last welcome
        self._resets = 0  # in a row, since the last welcome or cut
        self._last: str | None = None

    def welcomed(self) -> None:
        """A session was established: the next wait is the shortest."""
        self._refusals = self._resets = 0
        self._last = None

    def failed(self, exc: BaseException) -> str:
        """Count a failed dial; returns its kind."""
        kind = dial_failure(exc)
        if kind == CUT:
            self._resets = 0
        elif kind == RESET:
            self._resets += 1
        else:
            self._refusals += 1
        self._last = kind
        return kind

    def attempt(self) -> int:
        """The ``Backoff`` attempt number the next wait is drawn for."""
        if self._last is None or self._last == CUT:
            return 0
        if self._last == RESET and self._resets <= RESET_GRACE:
            return 0
        return self._refusals + max(0, self._resets - RESET_GRACE)

    def delay(self) -> float:
        """The wait before the next dial."""
        return self._backoff.delay(self.attempt(), self._rng)
