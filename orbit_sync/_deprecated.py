"""Old import paths kept for one release: each resolves to the same object, with a warning.

A package's module-level ``__getattr__`` (PEP 562) calls :func:`moved` for a name that left its
``__all__``, so ``from orbit_sync.worker import FakeClock`` keeps working until the next release.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["moved"]


def moved(old: str, name: str, new: str, new_name: str | None = None) -> Any:
    """``new.name`` (or ``new.new_name``, for a name that was also renamed), with a
    DeprecationWarning naming where to import it from instead of *old*."""
    where = f"import it from {new}" if new_name is None else f"use {new}.{new_name}"
    warnings.warn(
        f"{old}.{name} is deprecated and goes in the next release: {where}",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(new), new_name or name)
