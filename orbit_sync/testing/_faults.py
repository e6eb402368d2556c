"""Deterministic fault injection for the mock Orbit server.

Each fault is armed for one kind of frame (optionally one session) and a number of firings; it
counts what it did, so a test can assert that the fault really happened (``fault.fired``,
``fault.wait(timeout)``, or ``server.wait_until`` over ``fault.fired``: every firing wakes it).
Faults fire in the order they were armed.
"""

from __future__ import annotations

import http
import threading
from collections.abc import Callable

from .._codec import CLIENT_BODIES
from ..models import CODE_RE

__all__ = ["Fault", "Faults"]

REQUEST_TYPES = frozenset(CLIENT_BODIES)
PUSH_TYPES = frozenset({"task.assign", "task.cancel"})


class Fault:
    """One armed fault. Thread-safe; its counters only grow."""

    def __init__(
        self,
        kind: str,
        frame_type: str | None,
        count: int,
        *,
        session_id: str | None = None,
        seconds: float = 0.0,
        status: int = 0,
        code: str = "",
    ) -> None:
        if type(count) is not int or count < 1:
            raise ValueError("count must be an int >= 1")
        self.kind = kind
        self.frame_type = frame_type
        self.count = count
        self.session_id = session_id
        self.seconds = seconds
        self.status = status
        self.code = code
        self._lock = threading.Lock()
        self._fired = 0
        self._cancelled = False
        self._done = threading.Event()

    @property
    def fired(self) -> int:
        """How many times this fault has fired so far."""
        with self._lock:
            return self._fired

    @property
    def armed(self) -> bool:
        """True while the fault may still fire."""
        with self._lock:
            return not self._cancelled and self._fired < self.count

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the fault has fired ``count`` times; False on timeout."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        """Disarm the fault (what already fired stays counted)."""
        with self._lock:
            self._cancelled = True

    def _matches(self, kind: str, frame_type: str | None, session_id: str | None) -> bool:
        return (
            self.kind == kind
            and (self.frame_type is None or self.frame_type == frame_type)
            and (self.session_id is None or self.session_id == session_id)
        )

    def _take(self) -> bool:
        with self._lock:
            if self._cancelled or self._fired >= self.count:
                return False
            self._fired += 1
            if self._fired >= self.count:
                self._done.set()
            return True

    def __repr__(self) -> str:
        target = self.frame_type or "*"
        return f"Fault({self.kind} {target}, fired={self.fired}/{self.count})"


class Faults:
    """The server's fault switchboard (``server.faults``)."""

    def __init__(
        self,
        send_raw: Callable[[str, str | None], None],
        on_fire: Callable[[Fault, str | None], None] | None = None,
    ) -> None:
        self._send_raw = send_raw
        self._on_fire = on_fire
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    # ------------------------------------------------------------------ arming

    def _arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    @staticmethod
    def _request(frame_type: str) -> str:
        if frame_type not in REQUEST_TYPES:
            raise ValueError(f"not a client request type: {frame_type!r}")
        return frame_type

    def drop_reply(
        self, frame_type: str, count: int = 1, *, session_id: str | None = None
    ) -> Fault:
        """Apply the request, but never send its answer."""
        return self._arm(
            Fault("drop_reply", self._request(frame_type), count, session_id=session_id)
        )

    def close_before(
        self, frame_type: str, count: int = 1, *, session_id: str | None = None
    ) -> Fault:
        """Close the connection abruptly before applying the request."""
        return self._arm(
            Fault("close_before", self._request(frame_type), count, session_id=session_id)
        )

    def close_after(
        self, frame_type: str, count: int = 1, *, session_id: str | None = None
    ) -> Fault:
        """Apply the request, then close the connection abruptly without answering."""
        return self._arm(
            Fault("close_after", self._request(frame_type), count, session_id=session_id)
        )

    def delay_reply(
        self,
        frame_type: str,
        seconds: float = 0.5,
        count: int = 1,
        *,
        session_id: str | None = None,
    ) -> Fault:
        """Apply the request, then hold its answer (and what follows it) for *seconds* of real
        time: a slow link, not a slow server."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
            raise ValueError("seconds must be a number >= 0")
        return self._arm(
            Fault(
                "delay_reply",
                self._request(frame_type),
                count,
                session_id=session_id,
                seconds=float(seconds),
            )
        )

    def reply_error(
        self,
        frame_type: str,
        code: str = "UNAVAILABLE",
        count: int = 1,
        *,
        session_id: str | None = None,
    ) -> Fault:
        """Answer the request with an ``error`` of *code* without applying it (e.g.
        ``RATE_LIMITED``, ``UNAVAILABLE``)."""
        if type(code) is not str or not CODE_RE.fullmatch(code):
            raise ValueError("code must be 1-64 characters of [A-Z][A-Z0-9_]*")
        return self._arm(
            Fault("reply_error", self._request(frame_type), count, session_id=session_id, code=code)
        )

    def duplicate_push(
        self, frame_type: str = "task.assign", count: int = 1, *, session_id: str | None = None
    ) -> Fault:
        """Send the next push of *frame_type* twice (the same frame, byte for byte)."""
        if frame_type not in PUSH_TYPES:
            raise ValueError(f"not a push type: {frame_type!r}")
        return self._arm(Fault("duplicate_push", frame_type, count, session_id=session_id))

    def refuse_connections(self, count: int = 1, status: int = 503) -> Fault:
        """Answer the next *count* upgrade requests with HTTP *status* instead of 101."""
        if type(status) is not int or not 300 <= status <= 599:
            raise ValueError("status must be an HTTP status between 300 and 599")
        http.HTTPStatus(status)  # raises ValueError for a status the HTTP layer cannot send
        return self._arm(Fault("refuse_connections", None, count, status=status))

    def send_raw(self, text: str, session_id: str | None = None) -> None:
        """Push *text* as one text frame, unchecked, to one session (or every connected one)."""
        if type(text) is not str:
            raise TypeError("text must be a str")
        self._send_raw(text, session_id)

    # ------------------------------------------------------------------ inspection

    def active(self) -> tuple[Fault, ...]:
        """Faults that may still fire."""
        with self._lock:
            return tuple(f for f in self._faults if f.armed)

    def clear(self) -> None:
        """Disarm every fault."""
        with self._lock:
            faults, self._faults = self._faults, []
        for fault in faults:
            fault.cancel()

    # ------------------------------------------------------------------ used by the server

    def take(self, kind: str, frame_type: str | None, session_id: str | None) -> Fault | None:
        """Fire the first armed fault matching, if any."""
        if not self._faults:  # asked several times per frame; most servers have no faults
            return None
        with self._lock:
            candidates = [f for f in self._faults if f._matches(kind, frame_type, session_id)]
        for fault in candidates:
            if fault._take():
                if self._on_fire is not None:
                    self._on_fire(fault, session_id)
                return fault
        return None
