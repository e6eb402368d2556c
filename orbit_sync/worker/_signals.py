"""SIGTERM and SIGINT for :meth:`Worker.run` on the main thread: the first drains, the second
stops at once.

The kernel may hand a signal to any thread, and Python runs its handler only on the main thread,
which sleeps in ``read()`` on a pipe: the interpreter's C-level handler writes the signal number to
the pipe (``set_wakeup_fd``) from whichever thread received it, waking the read; signals are then
counted in ordinary code that may take locks. The end of shutdown writes a byte too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable

__all__ = ["STOP_SIGNALS", "StopSignals", "announce"]

#: The signals :meth:`Worker.run` handles: the first drains, the second stops at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Installs the stop-signal handlers and wakeup pipe when built; calls *on_signal(number,
    count)* for each stop signal on the thread in :meth:`wait` (``run()``'s, which owns it)."""

    def __init__(self, on_signal: Callable[[int, int], None]) -> None:
        self._on_signal = on_signal
        self._lock = threading.Lock()
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._write_fd: int | None = write_fd
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        # Our handler replaces the default action (exit, or KeyboardInterrupt) and does nothing
        # more: the interpreter has already written the signal's number to the wakeup pipe.
        self._previous = {
            sig: signal.signal(sig, lambda signum, frame: None) for sig in STOP_SIGNALS
        }

    def wait(self, done: threading.Event) -> None:
        """Sleep in ``read()`` until *done* is set (and :meth:`wake` called), counting signals."""
        count = 0
        while not done.is_set():
            for number in os.read(self._read_fd, 64):
                if number in STOP_SIGNALS:
                    count += 1
                    self._on_signal(number, count)

    def wake(self) -> None:
        """End a :meth:`wait` whose event was set (from any thread)."""
        with self._lock:
            if self._write_fd is not None:
                with contextlib.suppress(OSError):
                    os.write(self._write_fd, b"d")  # 100: no stop signal has that number

    def restore(self) -> None:
        """Put the previous handlers back, then close the pipe."""
        # Handlers first: once restored, ours can no longer run and write to a closed pipe.
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_wakeup)
        with self._lock:
            write_fd, self._write_fd = self._write_fd, None
        if write_fd is not None:
            os.close(write_fd)
        os.close(self._read_fd)


def announce(log: logging.Logger, number: int, *, count: int, running: int, drain: float) -> None:
    """Log the *count*-th stop signal *number* received while *running* tasks run."""
    # WARNING, so that an operator sees at the default level what a signal started and how to
    # cut it short (a supervisor's stop timeout may be shorter than the drain).
    name = signal.Signals(number).name
    tasks = f"{running} task{'' if running == 1 else 's'}"
    if count == 1:
        log.warning(
            "%s received: draining %s (up to %gs), %s again to stop now", name, tasks, drain, name
        )
    else:
        log.warning("%s received again: stopping now, cancelling %s", name, tasks)
