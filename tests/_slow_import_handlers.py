"""A process handler whose module is slow to import, as one loading a large library or a model
is: a new child is still loading it when a short time limit passes."""

from __future__ import annotations

import time
from typing import Any

from orbit_sync.worker import TaskContext

# The slow import itself (not a wait for a condition): each new child pays it again.
time.sleep(0.5)


def spin(ctx: TaskContext, payload: Any) -> Any:
    """Loops in Python, ignoring its context, until interrupted."""
    while True:
        pass
