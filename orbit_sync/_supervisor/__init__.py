"""``--processes N``: a supervisor of worker processes, their recycling, and the host's single
health endpoint and Prometheus target (see docs/deploy.md)."""

from __future__ import annotations

from ._child import ChildLink, RecycleLimits
from ._supervisor import STOP_MARGIN, Supervisor, SupervisorOptions

__all__ = ["STOP_MARGIN", "ChildLink", "RecycleLimits", "Supervisor", "SupervisorOptions"]
