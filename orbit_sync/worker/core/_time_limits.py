"""Handler time limits: what a limit is (:class:`TimeLimit`), and how a handler on a thread is
interrupted at it (:class:`Interruptible`); what happens at the limit is the attempt machine's
(``AttemptMachine.time_limit_passed``).

Interrupting is what Dramatiq's time limit does: ``PyThreadState_SetAsyncExc`` (CPython's C
API, reached through ``ctypes``) marks the handler's thread, and the interpreter raises the
exception there at the next bytecode it runs (what that cannot interrupt: the README's "Time
limits"; on an interpreter without that C API the interrupt is skipped, the context is still
cancelled). The exception is marked only while the handler runs on the thread
(:meth:`Interruptible.run`), and a mark not yet raised when the handler returns is cleared then:
it can never land in the worker's own code that runs on the thread next.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import attrs

from ..._seconds import seconds

__all__ = ["WORKER_DEFAULT", "Interruptible", "TimeLimit", "check_time_limit"]

T = TypeVar("T")


class _Default(enum.Enum):
    WORKER_DEFAULT = "the worker's time_limit"


#: A handler's ``time_limit`` when it is not given: the worker's ``time_limit`` applies.
WORKER_DEFAULT: Literal[_Default.WORKER_DEFAULT] = _Default.WORKER_DEFAULT
#: What a handler may pass as its ``time_limit``.
HandlerLimit = float | None | Literal[_Default.WORKER_DEFAULT]


def check_time_limit(value: object, name: str = "time_limit") -> float | None:
    """*value* as a time limit in seconds (> 0), or ``None`` for none."""
    return None if value is None else seconds(value, name, positive=True)


@attrs.frozen
class TimeLimit:
    """*seconds* from the handler's start; *grace* (``cancel_grace``) to stop once interrupted;
    *retryable*: the ``HANDLER_TIMEOUT``'s; *in_process*: in a child process (killed past the
    grace), not on a thread (which cannot be)."""

    seconds: float
    grace: float
    retryable: bool = False
    in_process: bool = False


try:
    # No argtypes: a py_object passes the exception type, None a NULL pointer (clear).
    _SET_ASYNC_EXC: Any = ctypes.pythonapi.PyThreadState_SetAsyncExc
except (AttributeError, OSError):  # not CPython
    _SET_ASYNC_EXC = None


def _mark(ident: int, exc_type: type[BaseException] | None) -> bool:
    """Mark thread *ident* to raise *exc_type* (``None``: clear); True when one was marked."""
    if _SET_ASYNC_EXC is None:
        return False
    exc = None if exc_type is None else ctypes.py_object(exc_type)
    return bool(_SET_ASYNC_EXC(ctypes.c_ulong(ident), exc) == 1)


class Interruptible:
    """One handler call another thread may interrupt (under the attempt's *lock*): before it
    starts, raised as it starts; after it ended, nothing."""

    __slots__ = ("_ident", "_lock", "_over", "_pending")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._ident: int | None = None
        self._pending: type[BaseException] | None = None
        self._over = False

    def run(self, call: Callable[[], T]) -> T:
        """Run *call* on this thread, interruptible meanwhile. A mark that arrives as *call*
        returns raises here, before the mark is cleared: the caller treats it as raised by the
        handler."""
        with self._lock:
            self._ident = threading.get_ident()
            pending = self._pending
        try:
            if pending is not None:
                raise pending()
            return call()
        finally:
            with self._lock:
                self._ident = None
                self._over = True
                _mark(threading.get_ident(), None)

    def interrupt(self, exc_type: type[BaseException]) -> bool:
        """Raise *exc_type* in the call's thread (or as it starts); True when marked."""
        with self._lock:
            if self._over:
                return False
            if self._ident is None:
                self._pending = exc_type
                return True
            return _mark(self._ident, exc_type)
