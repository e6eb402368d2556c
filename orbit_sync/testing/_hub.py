"""What every part of the mock server shares: the lock, the state machine, the live connections,
and the delivery of what the state machine decides.

:class:`Hub` owns the one re-entrant lock that guards :class:`~._state.OrbitState`; every
mutation (and every recorded event, fired faults included) is followed by ``notify_all`` on its
condition, which is what ``MockOrbitServer.wait_for`` and ``wait_until`` wait on. It turns the
state machine's actions into frames on the right connections (:meth:`Hub.commit`), and runs the
scheduler thread, which sleeps until the next due moment (recovery scans, backoff, rate-limit
windows) and is woken only when a change makes something due sooner.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from .._codec import encode_frame
from ..models import new_message_id
from ._conn import Conn
from ._faults import PUSH_TYPES, Fault, Faults
from ._state import Action, CloseSession, OrbitState

__all__ = ["Hub"]


class Hub:
    """The lock, the state machine and the connection tables, and what moves between them."""

    def __init__(self, state: OrbitState, *, real_time: bool) -> None:
        self.state = state
        self._real_time = real_time
        lock = threading.RLock()
        #: Notified after every change: what every wait of the server's API waits on.
        self.cond = threading.Condition(lock)
        # The scheduler sleeps on its own condition (same lock) until the next due moment, and
        # is woken only when a change makes something due sooner: waking it on every change
        # (several per task) cost a thread switch each.
        self._sched = threading.Condition(lock)
        self._sched_sleeping = False
        self._sched_until: int | None = None
        #: Open WebSocket sessions, and the one bound to each session id.
        self.conns: set[Conn] = set()
        self.by_session: dict[str, Conn] = {}
        #: Upgrades accepted (101 on its way) whose connection is not in ``conns`` yet.
        self.opening = 0
        #: Set once the server starts stopping: no new work, every wait gives up.
        self.stopping = False
        self.faults = Faults(self._send_raw, self._fault_fired)
        state.push_gate = self._push_gate

    def commit(self, actions: Iterable[Action]) -> None:
        """Deliver actions in order and wake every waiter. Caller holds the lock."""
        for action in actions:
            conn = self.by_session.get(action.session_id)
            if conn is None or conn.closing:
                continue
            if isinstance(action, CloseSession):
                conn.close_after_flush(1008, action.reason)
                continue
            text = encode_frame(
                action.type,
                new_message_id(),
                session_id=action.session_id,
                body=action.body,
                error=action.error,
            )
            self.queue(conn, text)
            if action.type in PUSH_TYPES and self.faults.take(
                "duplicate_push", action.type, action.session_id
            ):
                self.queue(conn, text)
        self.changed()

    def queue(self, conn: Conn, text: str) -> None:
        """Queue a push; it never waits (the caller holds the lock)."""
        if not conn.spill(text):
            self.slow_consumer(conn)

    def slow_consumer(self, conn: Conn) -> None:
        """Drop *conn*, whose socket took nothing for the write deadline."""
        with self.cond:
            self.record("connection.slow_consumer", session=conn.session_id)
            conn.abort()

    def record(self, kind: str, *, session: str | None = None, detail: str = "") -> None:
        """Record a shell-level event and wake every waiter. Caller holds the lock."""
        self.state.record(kind, session=session, detail=detail)
        self.changed()

    def live(self, session_id: str | None) -> list[Conn]:
        """The open connection of *session_id*, or every open one when ``None``. Caller holds
        the lock."""
        if session_id is None:
            return [c for c in self.by_session.values() if not c.closing]
        conn = self.by_session.get(session_id)
        return [conn] if conn is not None and not conn.closing else []

    def dispatch(self) -> None:
        """Run what is due now (a connection's outbox made room for more assignments)."""
        with self.cond:
            if not self.stopping:
                self.commit(self.state.run_due())

    def wake(self) -> None:
        """Everything re-checks: the clock moved (``ManualClock``), a slot freed, a stop began."""
        with self.cond:
            self.cond.notify_all()
            self._sched.notify()

    def changed(self) -> None:
        """Wake every waiter after a change, and the scheduler when the change made work due
        before the moment it sleeps until. Caller holds the lock."""
        self.cond.notify_all()
        if not self._sched_sleeping:
            return
        due = self.state.next_due()
        if due is None:
            return
        if self._real_time:
            wake = self._sched_until is None or due < self._sched_until
        else:
            wake = due <= self.state.now_us()  # ManualClock: only advance() moves time
        if wake:
            self._sched_sleeping = False
            self._sched.notify()

    def schedule_loop(self) -> None:
        """The scheduler thread: runs due work at its moment until the server stops."""
        with self.cond:
            while not self.stopping:
                due = self.state.next_due()
                now = self.state.now_us()
                if due is not None and due <= now:
                    self.commit(self.state.run_due())
                    continue
                timeout = None
                if self._real_time and due is not None:
                    timeout = (due - now) / 1_000_000
                self._sched_until = due
                self._sched_sleeping = True
                self._sched.wait(timeout)
                self._sched_sleeping = False

    def _push_gate(self, session_id: str, emitted: int) -> bool:
        conn = self.by_session.get(session_id)
        return conn is not None and conn.push_room(emitted)

    def _fault_fired(self, fault: Fault, session_id: str | None) -> None:
        # Wakes wait_until(), whose predicate may look at fault.fired (already counted).
        with self.cond:
            self.record(
                "fault.fired", session=session_id, detail=f"{fault.kind} {fault.frame_type or ''}"
            )

    def _send_raw(self, text: str, session_id: str | None) -> None:
        with self.cond:
            targets = self.live(session_id)
            if not targets:
                raise LookupError("no connected session to send to")
            for conn in targets:
                self.queue(conn, text)
