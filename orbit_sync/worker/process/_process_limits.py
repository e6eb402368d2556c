"""Limits of the process executor (docs/process-executor.md): recycling a child between attempts,
a handler's memory budget (``RLIMIT_AS``) and the one reader of a process's memory.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from collections.abc import Callable
from typing import Any

from .._context import TaskContext
from ..core._outcomes import Fail

__all__ = ["HANDLER_MEMORY_LIMIT", "ChildLimits", "MemoryLimited", "rss_bytes"]

#: The attempt's handler went over its ``memory_limit``.
HANDLER_MEMORY_LIMIT = "HANDLER_MEMORY_LIMIT"
_MB = 1024 * 1024
_LOG = logging.getLogger("orbit_sync.worker")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | None = None) -> int | None:
    """The RSS of *pid* (default: this process) in bytes, None if unknown. Linux reads
    ``/proc/PID/statm`` (microseconds: cheap after every attempt); elsewhere only this process's
    peak is known, which a limit passes once, as the RSS of a process that leaks would."""
    try:
        return _statm(pid)[1]
    except (OSError, ValueError, IndexError):
        pass
    if pid is not None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS says bytes, others KiB


def _statm(pid: int | None) -> tuple[int, int]:
    """The total size and resident set of *pid* (None: this process) in bytes, from pages."""
    with open(f"/proc/{'self' if pid is None else pid}/statm", "rb") as statm:
        size, resident = statm.read().split()[:2]
    return int(size) * _PAGE, int(resident) * _PAGE


class ChildLimits:
    """When a child has done enough: *max_tasks* jobs, or more than *max_memory_mb* of RSS after
    one (the Worker's ``process_max_tasks_per_child``, ``process_max_memory_per_child``)."""

    def __init__(
        self,
        *,
        max_tasks: int | None = None,
        max_memory_mb: int | None = None,
        rss: Callable[[int], int | None] = rss_bytes,
    ) -> None:
        self._max_tasks = max_tasks
        self._max_memory_mb = max_memory_mb
        self._rss = rss

    def after_job(self, pid: int, jobs: int) -> str | None:
        """Why child *pid*, done with its *jobs*-th job, should now be replaced (None: keep it)."""
        reason = None
        if self._max_tasks is not None and jobs >= self._max_tasks:
            reason = f"{jobs} tasks (process_max_tasks_per_child={self._max_tasks})"
        elif self._max_memory_mb is not None:
            rss = self._rss(pid)
            if rss is not None and rss > self._max_memory_mb * _MB:
                reason = (
                    f"RSS {rss / _MB:.0f} MB (process_max_memory_per_child={self._max_memory_mb})"
                )
        if reason is not None:
            _LOG.info("replacing handler process %d after %s", pid, reason)
        return reason


class MemoryLimited:
    """*fn* under a memory budget of *limit_mb*; pickles by reference to *fn*, as *fn* does."""

    def __init__(
        self, fn: Callable[[TaskContext, Any], Any], limit_mb: int, *, retryable: bool
    ) -> None:
        if type(limit_mb) is not int or limit_mb < 1:
            raise ValueError("memory_limit must be a positive int (MB)")
        if not sys.platform.startswith("linux"):
            raise ValueError("memory_limit needs Linux (RLIMIT_AS)")
        self.fn = fn
        self.limit_mb = limit_mb
        self.retryable = bool(retryable)
        self.__name__ = getattr(fn, "__name__", "handler")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, ctx: TaskContext, payload: Any) -> Any:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        budget = _statm(None)[0] + self.limit_mb * _MB  # the address space now (VmSize)
        if hard != resource.RLIM_INFINITY:
            budget = min(budget, hard)
        resource.setrlimit(resource.RLIMIT_AS, (budget, hard))
        try:
            return self.fn(ctx, payload)
        except MemoryError:
            pass  # the Fail is built below, once the budget is lifted and the frames are gone
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        raise Fail(
            HANDLER_MEMORY_LIMIT,
            f"the handler went over its memory_limit of {self.limit_mb} MB",
            retryable=self.retryable,
        )

    def __repr__(self) -> str:
        return f"<MemoryLimited {self.__qualname__} {self.limit_mb} MB>"
