"""Reconnect delays: exponential, bounded, with jitter so a fleet does not reconnect in step."""

from __future__ import annotations

import random

import attrs

from .._seconds import seconds

__all__ = ["Backoff"]

_RNG = random.Random()


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    seconds(value, attribute.name, positive=True)


@attrs.frozen
class Backoff:
    """Delay before reconnect attempt *n* (0-based): ``cap = min(maximum, initial * 2**n)``, then
    a uniform pick in ``[cap / 2, cap]`` ("equal jitter": never zero, never above the cap) for
    ``n >= 1``, and in ``[0, initial]`` ("full jitter") for ``n == 0``.

    The worker asks for attempt 0 after a session that was welcomed (the server was up and
    took it) and after a dial the link cut once the server had accepted it, and for 1, 2, ...
    after dials the server (or a proxy) refused in a row (``_redial`` tells them apart). Full
    jitter on that first reconnect halves the mean wait on a link that keeps cutting healthy
    sessions, and, when a server restart cuts a whole fleet at once, spreads the fleet's first
    dials over twice the window of equal jitter (half the peak rate); dials that then fail back
    off exponentially.
    """

    initial: float = attrs.field(default=0.2, validator=_positive)
    maximum: float = attrs.field(default=10.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.initial > self.maximum:
            raise ValueError("initial must not exceed maximum")

    def cap(self, attempt: int) -> float:
        """The upper bound of the delay before attempt *attempt*."""
        # min() first on the exponent keeps 2**n from growing without bound.
        return min(self.maximum, self.initial * 2.0 ** min(max(attempt, 0), 64))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """A jittered delay for attempt *attempt*."""
        cap = self.cap(attempt)
        low = 0.0 if attempt <= 0 else cap / 2
        return (rng or _RNG).uniform(low, cap)
