"""How long the worker waits before each reconnect: :class:`Backoff` draws a jittered delay for
a dial's attempt number, :class:`Redial` picks that number from how the dials since the last
welcome failed.

Three kinds of failed dial call for different waits:

- **refused**: the server (or whatever is in front of it) answered no: an HTTP status, an
  ``error`` frame answering the hello, no TCP connection at all, a dial timeout, a broken
  protocol. Retrying soon would add load where there is too much already: the wait grows
  exponentially, attempt by attempt.
- **cut**: the upgrade was accepted and the connection broke before the welcome arrived. The
  server is up and took the dial; the link lost it. The next dial comes after the shortest wait
  (attempt 0), as after a session that a cut ended: a chain of such cuts on a bad link must not
  push the wait to its cap.
- **reset**: connected, then reset or closed before the upgrade was answered. A link that cuts
  looks like this, and so does an overloaded proxy that drops what it cannot serve. The two differ
  in how they repeat: a flaky link lets most dials through, so consecutive resets are short runs
  (even if 45 % of dials were reset, four in a row would start at one dial in 25), while an
  overloaded proxy resets every dial. So the first :data:`RESET_GRACE` resets in a row get the
  shortest wait, and the ones after grow exponentially like refusals. A cut in between (the path
  reached the server) ends the run.

A welcome starts everything over.
"""

from __future__ import annotations

import random

import attrs

from .._seconds import seconds
from ..errors import WorkerDisconnected

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
    a uniform pick in ``[cap / 2, cap]`` ("equal jitter": never zero, never above the cap) for
    ``n >= 1``, and in ``[0, initial]`` ("full jitter") for ``n == 0``.

    The worker asks for attempt 0 after a session that was welcomed and after a dial the link cut
    once the server had accepted it, and for 1, 2, ... after dials the server (or a proxy) refused
    in a row. Full jitter on that first reconnect halves the mean wait on a link that keeps
    cutting healthy sessions, and, when a server restart cuts a whole fleet at once, spreads the
    fleet's first dials over twice the window of equal jitter (half the peak rate); dials that
    then fail back off exponentially.
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
        """A session was established: the next wait (after it ends) is the shortest."""
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
