"""Old import paths kept for one release: each resolves to the same object, with a warning.

A package's module-level ``__getattr__`` (PEP 562) calls :func:`moved` for a name that left its
``__all__``, so ``from orbit_sync.worker import FakeClock`` keeps working until the next release.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["moved"]


def moved(old: str, name: str, new: str) -> Any:
    """``new.name``, with a DeprecationWarning naming where to import it from instead of *old*."""
    warnings.warn(
        f"{old}.{name} is deprecated and goes in the next release: import it from {new}",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(new), name)
