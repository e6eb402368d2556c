"""A process's memory as the process executor's limits measure it: its resident memory (RSS),
for recycling a child, and this process's address space, for a handler's memory budget.

One reader of Linux's ``/proc/PID/statm`` serves both.
"""

from __future__ import annotations

import os
import resource
import sys

__all__ = ["address_space_bytes", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | None = None) -> int | None:
    """The current RSS of *pid* (default: this process) in bytes; None if it is gone or the
    platform cannot tell.

    Linux reads ``/proc/PID/statm`` (a few microseconds: cheap enough after every attempt).
    Elsewhere only this process's peak RSS is known (``getrusage``), which can only grow: a limit
    on it recycles once the peak passed it, which is what a limit on the current RSS would do for a
    process that leaks.
    """
    try:
        return _statm(pid)[1]
    except (OSError, ValueError, IndexError):
        pass
    if pid is not None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS says bytes, others KiB


def address_space_bytes() -> int:
    """This process's address space now (VmSize), in bytes; Linux only (``OSError``
    elsewhere)."""
    return _statm(None)[0]


def _statm(pid: int | None) -> tuple[int, int]:
    """The total size and the resident set of *pid* (None: this process), in bytes: the first
    two fields of ``/proc/PID/statm``, which counts in pages."""
    with open(f"/proc/{'self' if pid is None else pid}/statm", "rb") as statm:
        size, resident = statm.read().split()[:2]
    return int(size) * _PAGE, int(resident) * _PAGE
