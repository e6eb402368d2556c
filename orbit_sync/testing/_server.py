"""``MockOrbitServer``: a thin WebSocket shell around :class:`~._state.OrbitState`, and its
Python API (the operator's side: enqueue, inspect, move time, wait, cut connections).

Its parts, each in its own module:

* :mod:`._hub`: the one lock around the state machine, the live connections, the delivery of
  the state machine's actions, and the scheduler thread that runs due work (recovery scans,
  backoff, rate-limit windows);
* :mod:`._listener`: the supervised accept loop, which admits connections before any byte is
  read;
* :mod:`._front`: on one thread per accepted connection, the TLS handshake, the request head,
  then an admin request (:mod:`._admin_gate`) or the WebSocket opening handshake;
* :mod:`._session_server`: on that same thread after the upgrade, frames in (:mod:`._wire`),
  answers and pushes out;
* :mod:`._conn`: one writer thread per connection, which drains a bounded outbox of 8 frames
  into the socket when a frame cannot be written at once without blocking. A slow consumer is a
  client whose socket accepts no data for the write deadline (``write_timeout``, 5 s); a writer
  thread that merely lags behind the producers (GIL scheduling) is not one. So an answer that
  finds the outbox full waits for room, outside the lock, up to the write deadline and only
  then disconnects the client; assignments are only dispatched while the outbox has room for
  them and for answers (they pause, never block); other pushes (cancel notices), which cannot
  wait, may go past a full outbox while the writer keeps taking frames, up to a hard bound. A
  stalled client is caught by the next push, or by the read-idle bound.

Every thread is joined by :meth:`MockOrbitServer.stop`. Every mutation (and every recorded
event, fired faults included) is followed by ``notify_all`` on the hub's condition, which is
what :meth:`MockOrbitServer.wait_for` and :meth:`MockOrbitServer.wait_until` wait on.
"""

from __future__ import annotations

import datetime as _dt
import math
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._protocol import READ_IDLE_TIMEOUT
from ..clock import Clock, SystemClock
from ..models import TaskState
from ._admin_gate import AdminGate, AdminHandler
from ._clock import ManualClock, moves_by_itself
from ._front import FrontDoor
from ._hub import Hub
from ._listener import Listener
from ._options import EnqueueOptions
from ._session_server import SessionServer
from ._snapshots import EventLog, SessionSnapshot, TaskSnapshot
from ._state import (
    DEFAULT_EVENT_LOG_SIZE,
    DEFAULT_IDEMPOTENCY_WINDOW,
    DEFAULT_MAX_RECEIPTS,
    DEFAULT_RETENTION,
    SCOPE_CONNECT,
    SCOPE_CONSUME,
    OrbitState,
    queue_scope,
    to_datetime,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["AdminHandler", "MockOrbitServer"]


class MockOrbitServer:
    """A real ``pulse.worker.v1`` server on loopback, for tests (see the package docstring)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_duration: float = 30.0,
        session_window: float = 45.0,
        clock: Clock | None = None,
        assignment_rate: float | None = 4.0,
        ssl_context: ssl.SSLContext | None = None,
        request_rate: float | None = None,
        max_concurrency: int | None = None,
        max_connections: int = 128,
        hello_timeout: float = 5.0,
        read_idle_timeout: float = READ_IDLE_TIMEOUT,
        write_timeout: float = 5.0,
        admin_handler: AdminHandler | None = None,
        idempotency_window: float = DEFAULT_IDEMPOTENCY_WINDOW,
        retention: float | None = DEFAULT_RETENTION,
        event_log_size: int = DEFAULT_EVENT_LOG_SIZE,
        max_receipts: int = DEFAULT_MAX_RECEIPTS,
        exact_recovery: bool = False,
        max_pending_connections: int = 64,
        handshake_timeout: float = 3.0,
        max_admin_requests: int = 16,
        queue_id: str | None = None,
    ) -> None:
        """*queue_id* is the default queue's id (default: a fresh random one). A server
        restarted on the same port with the same *queue_id* and worker token
        (:meth:`add_token`) is one a connected worker simply reconnects to.

        *write_timeout* is the write deadline (PROTOCOL §10): how long an answer may wait
        for room in a connection's full outbox before the client is dropped as a slow consumer.

        Bounded state: a request's ``message_id`` is remembered for *idempotency_window*
        seconds (at most *max_receipts* of them, the oldest forgotten first); an ended task,
        session or worker process is kept for *retention* seconds (``None``: forever); the event
        log keeps the last *event_log_size* events. :meth:`bounds` shows them.

        Recovery: expired leases and overdue WAITING tasks are recovered by PROTOCOL §8's scan
        (every 2 s, at most 100 a batch), as a real server does; *exact_recovery* recovers
        each at its own moment instead.

        Hostile-client bounds: at most *max_pending_connections* accepted connections may be
        unauthenticated at once (more are closed as soon as they are accepted); each must finish
        its TLS handshake and send its request head within *handshake_timeout* seconds; at most
        *max_admin_requests* admin requests run at once (half of them may be waits), more are
        answered 503. *max_connections* bounds the open WebSocket sessions."""
        for name, count in (
            ("max_connections", max_connections),
            ("max_pending_connections", max_pending_connections),
            ("max_admin_requests", max_admin_requests),
        ):
            if type(count) is not int or count < 1:
                raise ValueError(f"{name} must be an int >= 1")
        for name, value in (
            ("hello_timeout", hello_timeout),
            ("read_idle", read_idle_timeout),
            ("write_timeout", write_timeout),
            ("handshake_timeout", handshake_timeout),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be > 0 and finite")
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._clock: Clock = SystemClock() if clock is None else clock
        self._state = OrbitState(
            clock=self._clock,
            lease_duration=lease_duration,
            session_window=session_window,
            assignment_rate=assignment_rate,
            request_rate=request_rate,
            max_concurrency=max_concurrency,
            idempotency_window=idempotency_window,
            retention=retention,
            event_log_size=event_log_size,
            max_receipts=max_receipts,
            exact_recovery=exact_recovery,
            queue_id=queue_id,
        )
        self._max_pending = max_pending_connections
        # A clock that moves by itself makes the scheduler wake on its own for due work.
        real_time = moves_by_itself(self._clock)
        hub = self._hub = Hub(self._state, real_time=real_time)
        self._cond = hub.cond
        #: Arm faults here (see :class:`~orbit_sync.testing.Faults`).
        self.faults = hub.faults
        self._admin = AdminGate(self, hub, admin_handler, max_requests=max_admin_requests)
        self._front = FrontDoor(
            hub,
            SessionServer(
                hub,
                hello_timeout=hello_timeout,
                read_idle_timeout=read_idle_timeout,
                write_timeout=float(write_timeout),
            ),
            self._admin,
            ssl_context=ssl_context,
            handshake_timeout=float(handshake_timeout),
            write_timeout=float(write_timeout),
            max_connections=max_connections,
        )
        self.token = self._state.add_token(
            {SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(self._state.default_queue)}
        )
        self._listener: Listener | None = None
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._unsubscribe: Callable[[], None] | None = None
        self._url: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> MockOrbitServer:
        """Bind and start serving; returns self."""
        with self._cond:
            if self._listener is not None:
                raise RuntimeError("the server was already started")
            if self._stopped:
                raise RuntimeError("a stopped server cannot be restarted")
            self._listener = Listener(
                self._host,
                self._port,
                max_pending=self._max_pending,
                serve=self._front.serve_socket,
                on_refused=self._front.pending_refused,
                on_accept_error=self._front.accept_failed,
                on_pending=self._hub.wake,
            )
            host, port = self._listener.socket.getsockname()[:2]
            scheme = "wss" if self._ssl is not None else "ws"
            shown = f"[{host}]" if ":" in host else host
            self._url = f"{scheme}://{shown}:{port}"
            if isinstance(self._clock, ManualClock):
                self._unsubscribe = self._clock.subscribe(self._hub.wake)
            self._listener.start()
            thread = threading.Thread(
                target=self._hub.schedule_loop, name="orbit-mock-scheduler", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Close every connection and join every thread. Safe to call twice."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._hub.stopping = True
            listener = self._listener
            self._hub.wake()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if listener is not None:
            # No new connections; unauthenticated ones are cut (their threads end at once).
            listener.stop()
        with self._cond:
            conns = list(self._hub.conns)
        for conn in conns:
            conn.close_after_flush(1001, "server stopping")
        with self._cond:
            # Event-driven: each handler removes its connection and notifies when it ends.
            self._cond.wait_for(lambda: not self._hub.conns, timeout=2.0)
            stuck = list(self._hub.conns)
        for conn in stuck:
            # A writer stuck on a socket that takes no data holds the websockets lock a
            # close would need: cut it instead.
            conn.abort()
        if listener is not None:
            listener.join()
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> MockOrbitServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"MockOrbitServer(url={self._url!r})"

    # ------------------------------------------------------------------ properties

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` has begun; waits on this server should give up."""
        return self._hub.stopping

    @property
    def pending_connections(self) -> int:
        """Accepted connections not authenticated yet (bounded by ``max_pending_connections``)."""
        return 0 if self._listener is None else self._listener.pending

    @property
    def admin_requests(self) -> int:
        """Admin requests being served now (bounded by ``max_admin_requests``)."""
        return self._admin.active

    @property
    def admin_body_bytes(self) -> int:
        """Admin request body bytes announced by the requests being served now (at most twice
        the largest body, all requests together: more are refused with 503 before reading)."""
        return self._admin.body_bytes

    @property
    def accepting(self) -> bool:
        """Whether the accept loop is running (False before start, after stop, and while its
        supervisor restarts it after an unexpected failure)."""
        return self._listener is not None and self._listener.accepting

    @property
    def url(self) -> str:
        """``ws://host:port`` (or ``wss://``); workers connect to ``url + /v1/worker/connect``."""
        if self._url is None:
            raise RuntimeError("the server is not started")
        return self._url

    @property
    def queue_id(self) -> str:
        """The default queue's id."""
        return self._state.default_queue

    @property
    def namespace_id(self) -> str:
        """The namespace every task of this server belongs to."""
        return self._state.namespace_id

    @property
    def clock(self) -> Clock:
        """The server's clock."""
        return self._clock

    @property
    def lease_duration(self) -> float:
        """The lease window in seconds."""
        return self._state.lease_us / 1_000_000

    @property
    def session_window(self) -> float:
        """The session window in seconds."""
        return self._state.session_us / 1_000_000

    def now(self) -> _dt.datetime:
        """Current server time."""
        return to_datetime(self._state.now_us())

    # ------------------------------------------------------------------ operator API

    def add_token(self, scopes: Iterable[str], *, token: str | None = None) -> str:
        """Register a bearer token with exactly *scopes* and return it: a fresh random one, or
        *token* itself (e.g. a value fixed in a test's environment)."""
        with self._cond:
            return self._state.add_token(scopes, token=token)

    def revoke_token(self, token: str) -> None:
        """Invalidate *token*: new upgrades get 401, live sessions ``UNAUTHENTICATED``."""
        with self._cond:
            self._state.revoke_token(token)

    @staticmethod
    def queue_scope(queue_id: str) -> str:
        """The scope a token needs to consume *queue_id*."""
        return queue_scope(queue_id)

    def add_queue(self, *, max_concurrency: int | None = None, paused: bool = False) -> str:
        """Create another queue (the default token has no scope for it); returns its id."""
        with self._cond:
            return self._state.add_queue(max_concurrency=max_concurrency, paused=paused)

    def set_max_concurrency(self, max_concurrency: int | None, queue_id: str | None = None) -> None:
        """Change a queue's concurrency limit."""
        with self._cond:
            self._hub.commit(self._state.set_max_concurrency(queue_id, max_concurrency))

    def pause_queue(self, queue_id: str | None = None) -> None:
        """Pause a queue: no new assignments; ``task.start`` answers ``UNAVAILABLE``."""
        with self._cond:
            self._hub.commit(self._state.pause_queue(queue_id))

    def resume_queue(self, queue_id: str | None = None) -> None:
        """Resume a paused queue."""
        with self._cond:
            self._hub.commit(self._state.resume_queue(queue_id))

    def enqueue(self, handler: str, payload: Any, **options: Unpack[EnqueueOptions]) -> str:
        """Create a WAITING task and return its id.

        *options* (all optional): ``handler_version``/``payload_version`` ("1"), ``queue_id``
        (the default queue), ``max_attempts`` (3), ``backoff_initial`` (1.0 s),
        ``backoff_max`` (60.0 s), ``retry_safety`` (``RECONCILE_ONLY``), ``deadline`` and
        ``latest_start`` (seconds from now or aware datetimes), ``attempt_time_limit``
        (seconds from an attempt's start).
        """
        with self._cond:
            task_id, actions = self._state.enqueue(handler, payload, **options)
            self._hub.commit(actions)
            return task_id

    def enqueue_many(self, tasks: Iterable[Mapping[str, Any]]) -> list[str]:
        """Create many WAITING tasks at once, all or none, and return their ids in order. Each
        task is a mapping of :meth:`enqueue`'s arguments: ``handler``, ``payload`` and any
        options. A bad one raises (naming its index) before any task is stored."""
        with self._cond:
            task_ids, actions = self._state.enqueue_many(tasks)
            self._hub.commit(actions)
            return task_ids

    def request_cancel(self, task_id: str) -> None:
        """Store a cancel request for *task_id* (PROTOCOL §9)."""
        with self._cond:
            self._hub.commit(self._state.request_cancel(task_id))

    def task(self, task_id: str) -> TaskSnapshot:
        """A frozen snapshot of one task (KeyError when unknown)."""
        with self._cond:
            return self._state.task_snapshot(task_id)

    def tasks(self) -> tuple[TaskSnapshot, ...]:
        """Snapshots of every task, in enqueue order."""
        with self._cond:
            return self._state.task_snapshots()

    def task_page(
        self,
        *,
        states: Iterable[TaskState | str] | None = None,
        queue_id: str | None = None,
        handler: str | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> tuple[tuple[TaskSnapshot, ...], int | None]:
        """One page of task snapshots, in enqueue order: up to *limit* tasks in one of *states*
        (and *queue_id*, *handler* when given) enqueued after cursor *after*; returns them and
        the cursor of the next page (``None``: this was the last). A cursor stays valid when
        tasks are forgotten in between."""
        if type(limit) is not int or limit < 1:
            raise ValueError("limit must be an int >= 1")
        if type(after) is not int or after < 0:
            raise ValueError("after must be an int >= 0")
        wanted = None if states is None else _task_states(states)
        with self._cond:
            return self._state.task_page(
                states=wanted, queue_id=queue_id, handler=handler, after=after, limit=limit
            )

    def sessions(self) -> tuple[SessionSnapshot, ...]:
        """Snapshots of every session ever opened, oldest first."""
        with self._cond:
            return self._state.session_snapshots()

    def events(self) -> EventLog:
        """The event log: the latest transitions (a ring of ``event_log_size``), stamped with
        server time; ``.dropped`` counts older ones no longer kept."""
        with self._cond:
            return self._state.events()

    def bounds(self) -> dict[str, float | int | bool | None]:
        """The state bounds in force (``idempotency_window``, ``retention``, ``max_receipts``,
        ``event_log_size``) and how full they are (``receipts``, ``receipts_evicted``,
        ``tasks``, ``sessions``): see ``docs/mock-server.md``."""
        with self._cond:
            return self._state.bounds()

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` (an AssertionError) when a global invariant is broken."""
        with self._cond:
            self._state.check_invariants()

    def wait_for(
        self, task_id: str, states: Iterable[TaskState | str], timeout: float = 10.0
    ) -> TaskSnapshot:
        """Block until the task is in one of *states*; raise TimeoutError after *timeout*."""
        wanted = _task_states([states] if isinstance(states, str) else states)
        if not wanted:
            raise ValueError("states must name at least one TaskState")
        snap: TaskSnapshot | None = None

        def reached() -> bool:
            nonlocal snap
            snap = self._state.task_snapshot(task_id)
            return snap.state in wanted

        with self._cond:
            if not self._cond.wait_for(reached, timeout):
                assert snap is not None
                names = ", ".join(sorted(s.value for s in wanted))
                raise TimeoutError(
                    f"task {task_id} is {snap.state.value} after {timeout} s, not one of {names}"
                )
        assert snap is not None
        return snap

    def wait_until(
        self, predicate: Callable[[MockOrbitServer], bool], timeout: float = 10.0
    ) -> None:
        """Block until ``predicate(server)`` is true (re-checked after every server change)."""
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self), timeout):
                raise TimeoutError(f"condition not reached within {timeout} s")

    def advance(self, seconds: float) -> None:
        """Move server time forward by *seconds*, running every due step at its own moment
        (lease expiry, recovery scans every 2 s, backoff) before returning."""
        with self._cond:
            self._state.advance(seconds, self._hub.commit)

    def disconnect(self, session_id: str | None = None) -> int:
        """Cut one session's connection (or every connection) abruptly; returns how many."""
        hub = self._hub
        with hub.cond:
            if session_id is None:
                # Every connection, a session's or not yet one (before its hello).
                targets = [c for c in hub.conns if not c.closing]
            else:
                targets = hub.live(session_id)
            for conn in targets:
                hub.record("connection.cut", session=conn.session_id)
                conn.abort()
            hub.changed()
        return len(targets)


def _task_states(states: Iterable[TaskState | str]) -> frozenset[TaskState]:
    """*states* as TaskStates; ``ValueError`` naming a wrong one and listing the valid ones."""
    wanted = set()
    for state in states:
        try:
            wanted.add(TaskState(state))
        except ValueError:
            raise ValueError(
                f"{state!r} is not a task state; expected one of "
                + ", ".join(s.value for s in TaskState)
            ) from None
    return frozenset(wanted)
