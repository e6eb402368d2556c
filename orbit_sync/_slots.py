"""The call slots of a :class:`~orbit_sync.connection.WorkerConnection`: where each call in flight
waits for its answer.

Every call in flight holds one of at most 32 slots (``MAX_IN_FLIGHT``), each a reused
``threading.Event`` that the reader (or whichever thread ends the call) sets with the answer; a
blocking caller waits on its own slot until its deadline. The connection keeps the idle slots and
hands one to each call it sends.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from ._protocol import Done
from .errors import OrbitError

# The connection's logger: these records are the connection's, as they were before the split.
log = logging.getLogger("orbit_sync.connection")


class Settable(Protocol):
    """What :meth:`WorkerConnection.send_many` may also set as each answer arrives: a
    ``threading.Event``, or anything whose ``set()`` only records and wakes (it runs on the
    reader thread)."""

    def set(self) -> None: ...


class Slot:
    """One call in flight: a reused ``threading.Event`` and the answer it carries.

    Every call holds a slot from its send until its answer or failure (so at most
    :data:`MAX_IN_FLIGHT` are in use); the reader (or whichever thread ends the call) stores the
    answer and sets the event, and the caller waits on it with its deadline.
    """

    __slots__ = ("error", "event", "free", "value", "wake")

    def __init__(self, free: list[Slot]) -> None:
        self.event = threading.Event()
        self.value: Any = None
        self.error: OrbitError | None = None
        #: Also set as the answer arrives (a batch's shared wake-up), or None.
        self.wake: Settable | None = None
        #: The connection's idle slots, where this one goes back once its call is over.
        self.free = free

    def complete(self, value: Any, error: OrbitError | None) -> None:
        """The call's answer (or failure) arrived: record it and set the slot."""
        # Read first: once the event is set, the caller may release the slot for another call.
        wake = self.wake
        self.value = value
        self.error = error
        self.event.set()
        if wake is not None:
            wake.set()

    def release(self) -> None:
        """A caller's slot back to the idle ones, cleared (list.append is atomic: no lock
        needed)."""
        self.value = self.error = None
        self.wake = None
        self.event.clear()
        self.free.append(self)


def unset(value: Any, error: OrbitError | None) -> None:
    raise AssertionError("a call's completion is its slot's, set as the call is opened")


def run_done(on_done: Done, value: Any, error: OrbitError | None, request_type: str) -> None:
    try:
        on_done(value, error)
    except Exception:  # one faulty wake-up must not keep the others from their answers
        log.exception("a wake-up of a %s call raised", request_type)
