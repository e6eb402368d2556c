"""Old forms kept for one release: each still works, with a DeprecationWarning.

* Names that left a package's ``__all__``: the package's module-level ``__getattr__`` (PEP 562)
  calls :func:`moved` (or :func:`deprecated`, for a name whose old object is kept), so
  ``from orbit_sync.worker import WorkerClock`` keeps working.
* A bare function returning seconds where an :class:`orbit_sync.Clock` is now taken
  (``dial_worker``, ``Lease.may_run``, ``TaskContext``, ``HealthProbe``, ...):
  :func:`function_clock` wraps it into a clock. :func:`orbit_sync.clock.as_clock` is the one
  place that calls it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

from .clock import SystemClock

__all__ = ["FunctionClock", "deprecated", "function_clock", "moved"]


def moved(old: str, name: str, new: str, new_name: str | None = None) -> Any:
    """``new.name`` (or ``new.new_name``, for a name that was also renamed), with a
    DeprecationWarning naming where to import it from instead of *old*."""
    where = f"import it from {new}" if new_name is None else f"use {new}.{new_name}"
    value = getattr(importlib.import_module(new), new_name or name)
    return deprecated(old, name, where, value, _frames=1)


def deprecated(old: str, name: str, instead: str, value: Any, *, _frames: int = 0) -> Any:
    """*value*, the old object still behind ``old.name``, with a DeprecationWarning saying what
    to do *instead*, pointing at the code that looked the name up through the module's
    ``__getattr__`` (*_frames*: the calls between that ``__getattr__`` and this function)."""
    warnings.warn(
        f"{old}.{name} is deprecated and goes in the next release: {instead}",
        DeprecationWarning,
        stacklevel=3 + _frames,
    )
    return value


class FunctionClock(SystemClock):
    """The old form of a clock, a function returning monotonic seconds, as an
    :class:`orbit_sync.Clock`: its time is the function's; its timed waits are real time's (such a
    function could only ever follow real time)."""

    __slots__ = ("_now",)

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now

    def now(self) -> float:
        """The function's reading."""
        return self._now()

    def __repr__(self) -> str:
        return f"FunctionClock({getattr(self._now, '__qualname__', 'function')})"


def function_clock(now: Callable[[], float], stacklevel: int) -> FunctionClock:
    """*now* as a clock, with a DeprecationWarning pointing *stacklevel* frames up from the
    caller of this function (at the code that passed the function)."""
    warnings.warn(
        "a function as clock is deprecated and goes in the next release: pass an "
        "orbit_sync.Clock (orbit_sync.testing.ManualClock in tests)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return FunctionClock(now)
