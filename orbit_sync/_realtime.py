"""Real time for orbit-sync's own bounds, out of reach of time-freezing test libraries.

freezegun replaces ``time.monotonic``/``time.time`` and every module global bound to them, and
whether a call then sees frozen or real time depends on how far it is from a ``threading`` frame.
Network bounds (dial, call, read-idle, write and handshake timeouts), shutdown bounds and the
real-time clocks read these instead: ``partial`` objects holding the functions as they were at
import, which its module scan does not recognise (about 3 ns more per call). A test's frozen
time reaches the worker's and the mock server's schedules only through a clock it is given
(``ManualClock(follow=frozen)``), never half-way through a timeout.
"""

from __future__ import annotations

import functools
import time

__all__ = ["monotonic", "wall"]

#: ``time.monotonic`` as it was when orbit-sync was imported.
monotonic = functools.partial(time.monotonic)
#: ``time.time`` as it was when orbit-sync was imported.
wall = functools.partial(time.time)
