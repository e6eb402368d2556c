"""What "a number of seconds" is, for every timeout, bound and delay the library accepts.

One rule set, used by the API and the command line alike:

* an ``int`` or ``float`` (not a ``bool``), else ``TypeError``;
* never NaN (it compares false with everything: a NaN bound makes wait loops spin or never end);
* never negative; zero only where the argument allows it (``positive=False``);
* infinity only means something where there is a meaning for it: "no bound" for a wait that
  accepts ``None`` (:func:`wait_seconds`), "the cap" for an argument that has one (``cap``);
  anywhere else it is refused like NaN.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["parse_seconds", "seconds", "wait_seconds"]


def seconds(value: object, name: str, *, positive: bool = False, cap: float | None = None) -> float:
    """*value* as a float of seconds under the rules above (*cap*: the largest value kept)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds")
    if math.isnan(value):
        raise ValueError(f"{name} must be a number of seconds, not NaN")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}")
    if cap is not None:
        return min(float(value), cap)
    if math.isinf(value):
        raise ValueError(f"{name} must be a finite number of seconds")
    return float(value)


def wait_seconds(value: object, name: str = "timeout") -> float | None:
    """A wait: ``None`` or infinity wait without a bound (``None``), else :func:`seconds`."""
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    try:
        return seconds(value, name)
    except TypeError:
        raise TypeError(f"{name} must be a number of seconds or None") from None


def parse_seconds(text: str, *, positive: bool = False) -> float:
    """A command-line value under the same rules: ``argparse.ArgumentTypeError`` naming the
    rule it broke."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a number of seconds") from None
    try:
        return seconds(value, "the value", positive=positive)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
