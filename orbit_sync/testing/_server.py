"""``MockOrbitServer``: a thin WebSocket shell around :class:`~._state.OrbitState`.

Threads (all joined by :meth:`MockOrbitServer.stop`):

* the accept loop (:mod:`._listener`), supervised, which admits connections before any byte is
  read,
* one handler thread per connection, which reads the request head, completes the opening
  handshake through websockets' sans-I/O protocol, then reads frames (:mod:`._wire`) and
  applies them,
* one writer thread per connection (:mod:`._conn`), which drains a bounded outbox of 8 frames
  into the socket when a frame cannot be written at once without blocking. A slow consumer is a
  client whose socket accepts no data for the write deadline (``write_timeout``, 5 s); a writer
  thread that merely lags behind the producers (GIL scheduling) is not one. So an answer that
  finds the outbox full waits for room, outside the lock, up to the write deadline and only
  then disconnects the client; assignments are only dispatched while the outbox has room for
  them and for answers (they pause, never block); other pushes (cancel notices), which cannot
  wait, may go past a full outbox while the writer keeps taking frames, up to a hard bound. A
  stalled client is caught by the next push, or by the read-idle bound.
* one scheduler thread, which runs due work (recovery scans, backoff, rate-limit windows).

One re-entrant lock guards the state machine; every mutation (and every recorded event, fired
faults included) is followed by ``notify_all`` on its condition, which is what
:meth:`MockOrbitServer.wait_for` and :meth:`MockOrbitServer.wait_until` wait on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import http
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol

from .._codec import SUBPROTOCOL, ClientFrame, InvalidClientFrame, decode_client_frame, encode_frame
from .._json import MAX_FRAME_BYTES
from .._protocol import READ_IDLE_TIMEOUT
from ..models import TaskState, new_message_id
from . import _http
from ._clock import ManualClock, ServerClock, SystemClock
from ._conn import Conn
from ._faults import PUSH_TYPES, Fault, Faults
from ._listener import Admission, Listener
from ._options import EnqueueOptions
from ._snapshots import EventLog, SessionSnapshot, TaskSnapshot
from ._state import (
    DEFAULT_EVENT_LOG_SIZE,
    DEFAULT_IDEMPOTENCY_WINDOW,
    DEFAULT_MAX_RECEIPTS,
    DEFAULT_RETENTION,
    SCOPE_CONNECT,
    SCOPE_CONSUME,
    Action,
    CloseSession,
    Handled,
    OrbitState,
    queue_scope,
    to_datetime,
)
from ._wire import InvalidText, WireClosed

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["AdminHandler", "MockOrbitServer"]

#: ``admin_handler(server, connection, request)``: answers requests under ``/admin/``; ``None``
#: means 404. *request* has ``method``, ``path`` (with the query), ``headers`` and ``body``.
#: A handler may also have ``check_head(request)``, called with the head alone (empty body)
#: before any byte of body is read: a response it returns is the answer, and the body is never
#: read (so an unauthenticated caller costs no memory and no waiting for its body).
AdminHandler = Callable[
    ["MockOrbitServer", _http.AdminExchange, _http.HttpRequest], "Response | None"
]

CONNECT_PATH = "/v1/worker/connect"
#: The largest admin request body (a bulk enqueue of 100,000 small tasks is ~5 MiB).
MAX_ADMIN_BODY = 16 * 1024 * 1024
#: How long an admin request may take to send its body, and to take its answer.
ADMIN_IO_TIMEOUT = 10.0
#: The admin bodies held in memory at once, all requests together (declared sizes).
ADMIN_BODY_BUDGET = 2 * MAX_ADMIN_BODY

_LOG = logging.getLogger("orbit_sync.testing.server")


class _QuietLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """websockets logs headers and frame previews at DEBUG: tokens and secrets. Never emit them."""

    def isEnabledFor(self, level: int) -> bool:
        return level > logging.DEBUG and self.logger.isEnabledFor(level)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class _Late:
    """An answer that found its connection's outbox full, and what must follow it."""

    text: str
    delay: float
    actions: tuple[Action, ...]
    close: str | None


class MockOrbitServer:
    """A real ``pulse.worker.v1`` server on loopback, for tests (see the package docstring)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_duration: float = 30.0,
        session_window: float = 45.0,
        clock: ServerClock | None = None,
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
        self._clock: ServerClock = SystemClock() if clock is None else clock
        self._real_time = bool(getattr(self._clock, "real_time", False))
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
        self._state.push_gate = self._push_gate
        self._max_connections = max_connections
        self._max_pending = max_pending_connections
        self._max_admin = max_admin_requests
        self._handshake_timeout = float(handshake_timeout)
        self._hello_timeout = hello_timeout
        self._read_idle = read_idle_timeout
        self._write_timeout = float(write_timeout)
        self._admin_handler = admin_handler
        self._admin_body_bytes = 0
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # The scheduler sleeps on its own condition (same lock) until the next due moment, and
        # is woken only when a change makes something due sooner: waking it on every change
        # (several per task) cost a thread switch each.
        self._sched = threading.Condition(lock)
        self._sched_sleeping = False
        self._sched_until: int | None = None
        self._conns: set[Conn] = set()
        self._by_session: dict[str, Conn] = {}
        # Upgrades accepted (101 on its way) whose connection is not in _conns yet.
        self._opening = 0
        self._admin_active = 0
        self._admin_waits = 0
        self._ws_logger = _QuietLogger(logging.getLogger("orbit_sync.testing.transport"), {})
        self.faults = Faults(self._send_raw, self._fault_fired)
        self.token = self._state.add_token(
            {SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(self._state.default_queue)}
        )
        self._listener: Listener | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = False
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
                serve=self._serve_socket,
                on_refused=self._pending_refused,
                on_accept_error=self._accept_failed,
                on_released=self._wake,
            )
            host, port = self._listener.socket.getsockname()[:2]
            scheme = "wss" if self._ssl is not None else "ws"
            shown = f"[{host}]" if ":" in host else host
            self._url = f"{scheme}://{shown}:{port}"
            if isinstance(self._clock, ManualClock):
                self._unsubscribe = self._clock.subscribe(self._wake)
            self._listener.start()
            thread = threading.Thread(
                target=self._schedule_loop, name="orbit-mock-scheduler", daemon=True
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
            self._stopping = True
            listener = self._listener
            self._cond.notify_all()
            self._sched.notify()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if listener is not None:
            # No new connections; unauthenticated ones are cut (their threads end at once).
            listener.stop()
        with self._cond:
            conns = list(self._conns)
        for conn in conns:
            conn.close_after_flush(1001, "server stopping")
        with self._cond:
            # Event-driven: each handler removes its connection and notifies when it ends.
            self._cond.wait_for(lambda: not self._conns, timeout=2.0)
            stuck = list(self._conns)
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
        return self._stopping

    @property
    def pending_connections(self) -> int:
        """Accepted connections not authenticated yet (bounded by ``max_pending_connections``)."""
        return 0 if self._listener is None else self._listener.pending

    @property
    def admin_requests(self) -> int:
        """Admin requests being served now (bounded by ``max_admin_requests``)."""
        with self._cond:
            return self._admin_active

    @property
    def admin_body_bytes(self) -> int:
        """Admin request body bytes announced by the requests being served now (at most twice
        the largest body, all requests together: more are refused with 503 before reading)."""
        with self._cond:
            return self._admin_body_bytes

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
    def clock(self) -> ServerClock:
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
            self._commit(self._state.set_max_concurrency(queue_id, max_concurrency))

    def pause_queue(self, queue_id: str | None = None) -> None:
        """Pause a queue: no new assignments; ``task.start`` answers ``UNAVAILABLE``."""
        with self._cond:
            self._commit(self._state.pause_queue(queue_id))

    def resume_queue(self, queue_id: str | None = None) -> None:
        """Resume a paused queue."""
        with self._cond:
            self._commit(self._state.resume_queue(queue_id))

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
            self._commit(actions)
            return task_id

    def enqueue_many(self, tasks: Iterable[Mapping[str, Any]]) -> list[str]:
        """Create many WAITING tasks at once, all or none, and return their ids in order. Each
        task is a mapping of :meth:`enqueue`'s arguments: ``handler``, ``payload`` and any
        options. A bad one raises (naming its index) before any task is stored."""
        with self._cond:
            task_ids, actions = self._state.enqueue_many(tasks)
            self._commit(actions)
            return task_ids

    def request_cancel(self, task_id: str) -> None:
        """Store a cancel request for *task_id* (PROTOCOL §9)."""
        with self._cond:
            self._commit(self._state.request_cancel(task_id))

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
            self._state.advance(seconds, self._commit)

    def disconnect(self, session_id: str | None = None) -> int:
        """Cut one session's connection (or every connection) abruptly; returns how many."""
        with self._cond:
            if session_id is None:
                targets = [c for c in self._conns if not c.closing]
            else:
                conn = self._by_session.get(session_id)
                targets = [conn] if conn is not None and not conn.closing else []
            for conn in targets:
                self._record("connection.cut", session=conn.session_id)
                conn.abort()
            self._changed()
        return len(targets)

    # ------------------------------------------------------------------ internals

    def _commit(self, actions: Iterable[Action]) -> None:
        """Deliver actions in order and wake every waiter. Caller holds the lock."""
        for action in actions:
            conn = self._by_session.get(action.session_id)
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
            self._queue(conn, text)
            if action.type in PUSH_TYPES and self.faults.take(
                "duplicate_push", action.type, action.session_id
            ):
                self._queue(conn, text)
        self._changed()

    def _queue(self, conn: Conn, text: str) -> None:
        """Queue a push; it never waits (the caller holds the lock)."""
        if not conn.spill(text):
            self._slow_consumer(conn)

    def _slow_consumer(self, conn: Conn) -> None:
        with self._cond:
            self._record("connection.slow_consumer", session=conn.session_id)
            conn.abort()

    def _record(self, kind: str, *, session: str | None = None, detail: str = "") -> None:
        """Record a shell-level event and wake every waiter. Caller holds the lock."""
        self._state.record(kind, session=session, detail=detail)
        self._changed()

    def _push_gate(self, session_id: str, emitted: int) -> bool:
        conn = self._by_session.get(session_id)
        return conn is not None and conn.push_room(emitted)

    def _dispatch(self) -> None:
        with self._cond:
            if not self._stopping:
                self._commit(self._state.run_due())

    def _wake(self) -> None:
        # The clock moved (ManualClock) or a connection slot freed: everything re-checks.
        with self._cond:
            self._cond.notify_all()
            self._sched.notify()

    def _changed(self) -> None:
        """Wake every waiter after a change, and the scheduler when the change made work due
        before the moment it sleeps until. Caller holds the lock."""
        self._cond.notify_all()
        if not self._sched_sleeping:
            return
        due = self._state.next_due()
        if due is None:
            return
        if self._real_time:
            wake = self._sched_until is None or due < self._sched_until
        else:
            wake = due <= self._state.now_us()  # ManualClock: only advance() moves time
        if wake:
            self._sched_sleeping = False
            self._sched.notify()

    def _fault_fired(self, fault: Fault, session_id: str | None) -> None:
        # Wakes wait_until(), whose predicate may look at fault.fired (already counted).
        with self._cond:
            self._record(
                "fault.fired", session=session_id, detail=f"{fault.kind} {fault.frame_type or ''}"
            )

    def _send_raw(self, text: str, session_id: str | None) -> None:
        with self._cond:
            if session_id is None:
                targets = [c for c in self._by_session.values() if not c.closing]
            else:
                conn = self._by_session.get(session_id)
                targets = [conn] if conn is not None and not conn.closing else []
            if not targets:
                raise LookupError("no connected session to send to")
            for conn in targets:
                self._queue(conn, text)

    def _schedule_loop(self) -> None:
        with self._cond:
            while not self._stopping:
                due = self._state.next_due()
                now = self._state.now_us()
                if due is not None and due <= now:
                    self._commit(self._state.run_due())
                    continue
                timeout = None
                if self._real_time and due is not None:
                    timeout = (due - now) / 1_000_000
                self._sched_until = due
                self._sched_sleeping = True
                self._sched.wait(timeout)
                self._sched_sleeping = False

    # ------------------------------------------------------------------ front door

    def _pending_refused(self) -> None:
        with self._cond:
            self._record("connection.refused", detail="pre-authentication limit")

    def _accept_failed(self, reason: str) -> None:
        with self._cond:
            self._record("server.accept_failed", detail=reason)

    def _serve_socket(self, sock: socket.socket, addr: Any, admission: Admission) -> None:
        """One accepted connection, on its own thread: TLS handshake and request head within
        the handshake deadline, then an admin answer or a WebSocket session."""
        deadline = time.monotonic() + self._handshake_timeout
        target = None
        try:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                admission.sock = sock
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock.do_handshake()
            head, surplus = _http.read_head(sock, deadline)
            target = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            method, path, protocol, headers = _http.parse_head(head)
        except TimeoutError:
            with self._cond:
                self._record("connection.handshake_timeout")
            if target is not None and target.startswith(b"/admin/"):
                self._answer(sock, _admin_error(408, "the request head came too slowly"))
            return
        except _http.HttpError as exc:
            # Before the path is known to be an admin one, answer as websockets would.
            if target is not None and target.startswith(b"/admin/"):
                self._answer(sock, _admin_error(exc.status, exc.message))
            else:
                self._answer(sock, _http.text_response(exc.status, exc.message + "\n"))
            return
        except (OSError, EOFError, ValueError):
            return  # the peer went away, or TLS failed: nothing to answer
        if path.startswith("/admin/"):
            admission.release()  # counted against the admin limit from here
            request = _http.HttpRequest(method, path, headers, protocol=protocol)
            self._serve_admin(sock, addr, request, surplus)
            return
        self._upgrade(sock, admission, head, surplus)

    def _answer(self, sock: socket.socket, response: Response) -> None:
        """Send a final answer and close (bounded; a peer that takes nothing is cut)."""
        with contextlib.suppress(OSError, TimeoutError):
            _http.send_all(sock, _http.serialize(response), time.monotonic() + ADMIN_IO_TIMEOUT)
        _http.linger_close(sock)

    # ------------------------------------------------------------------ admin requests

    def _serve_admin(
        self, sock: socket.socket, addr: Any, request: _http.HttpRequest, surplus: bytes
    ) -> None:
        waiting = request.path.partition("?")[0].endswith("/wait")
        with self._cond:
            busy = self._admin_active >= self._max_admin or (
                waiting and self._admin_waits >= max(1, self._max_admin // 2)
            )
            if busy:
                self._record("admin.refused", detail="admin request limit")
            else:
                self._admin_active += 1
                self._admin_waits += waiting
                self._changed()
        if busy:
            self._answer(
                sock,
                _admin_error(
                    503, "too many admin requests at once; retry shortly", [("Retry-After", "1")]
                ),
            )
            return
        try:
            response = self._admin_response(sock, addr, request, surplus)
        finally:
            with self._cond:
                self._admin_active -= 1
                self._admin_waits -= waiting
                self._changed()
        self._answer(sock, response)

    def _admin_response(
        self, sock: socket.socket, addr: Any, request: _http.HttpRequest, surplus: bytes
    ) -> Response:
        if self._admin_handler is None:
            return _admin_error(404, "this server has no admin API")
        # The credentials and the declared size first: no byte of body is read before them.
        check_head = getattr(self._admin_handler, "check_head", None)
        early = None if check_head is None else check_head(request)
        if early is not None:
            return cast(Response, early)
        try:
            length = _http.body_length(request.headers, MAX_ADMIN_BODY)
        except _http.HttpError as exc:
            return _admin_error(exc.status, exc.message)
        with self._cond:
            fits = self._admin_body_bytes + length <= ADMIN_BODY_BUDGET
            if fits:
                self._admin_body_bytes += length
                self._changed()
        if not fits:
            return _admin_error(
                503, "too many admin request bodies at once; retry shortly", [("Retry-After", "1")]
            )
        try:
            return self._admin_call(sock, addr, request, length, surplus)
        finally:
            with self._cond:
                self._admin_body_bytes -= length
                self._changed()

    def _admin_call(
        self,
        sock: socket.socket,
        addr: Any,
        request: _http.HttpRequest,
        length: int,
        surplus: bytes,
    ) -> Response:
        assert self._admin_handler is not None
        try:
            body = _http.read_body(
                sock, request.headers, length, surplus, time.monotonic() + ADMIN_IO_TIMEOUT
            )
        except _http.HttpError as exc:
            return _admin_error(exc.status, exc.message)
        except TimeoutError:
            return _admin_error(408, "the request body came too slowly")
        except OSError:
            return _admin_error(400, "the connection failed while reading the body")
        request = dataclasses.replace(request, body=body)
        try:
            response = self._admin_handler(self, _http.AdminExchange(addr), request)
        except Exception:
            _LOG.exception("the admin handler failed on %s", request.method)
            return _admin_error(500, "internal error; see the server log", code="INTERNAL")
        if response is None:
            return _admin_error(404, "no such admin endpoint")
        return response

    # ------------------------------------------------------------------ WebSocket upgrade

    def _upgrade(
        self, sock: socket.socket, admission: Admission, head: bytes, surplus: bytes
    ) -> None:
        """The opening handshake through websockets' sans-I/O protocol, then the session."""
        protocol = ServerProtocol(
            subprotocols=[SUBPROTOCOL],  # type: ignore[list-item]
            extensions=None,  # no compression
            max_size=MAX_FRAME_BYTES,
            logger=self._ws_logger,
        )
        protocol.receive_data(head)
        events = protocol.events_received()
        if not events or not isinstance(events[0], Request):
            self._flush(sock, protocol)  # websockets' own rejection of a bad request, if any
            return
        request = events[0]
        token: str | None = None
        if surplus:
            # The client must wait for the 101 before it sends frames (RFC 6455, section 4.1).
            response = protocol.reject(
                http.HTTPStatus.BAD_REQUEST, "data sent before the handshake completed\n"
            )
        else:
            checked = self._check_upgrade(protocol, request)
            if isinstance(checked, str):
                token = checked
                admission.release()  # authenticated: max_connections counts it from here
                response = protocol.accept(request)
            else:
                response = checked
        protocol.send_response(response)
        if token is None or protocol.state is not State.OPEN:
            if token is not None:
                self._release_opening()
            self._flush(sock, protocol)
            return
        if not self._flush(sock, protocol):
            self._release_opening()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            return
        sock.settimeout(None)  # the wire's reads and our writer enforce their own deadlines
        self._handle(sock, protocol, token)

    def _release_opening(self) -> None:
        with self._cond:
            self._opening -= 1
            self._changed()

    def _flush(self, sock: socket.socket, protocol: ServerProtocol) -> bool:
        """Write what the protocol has to send; False when the socket failed."""
        try:
            for data in protocol.data_to_send():
                if data:
                    _http.send_all(sock, data, time.monotonic() + self._write_timeout)
                else:
                    sock.shutdown(socket.SHUT_WR)  # websockets' SEND_EOF
        except (OSError, TimeoutError):
            return False
        return True

    def _check_upgrade(self, protocol: ServerProtocol, request: Request) -> Response | str:
        """The token of an upgrade request we accept (a connection slot is then reserved in
        ``_opening``), or the answer refusing it."""
        path = request.path
        fault = self.faults.take("refuse_connections", None, None)
        if fault is not None:
            return protocol.reject(fault.status, "refused by an injected fault\n")
        if path != CONNECT_PATH:
            if path.split("?", 1)[0] == CONNECT_PATH:
                # Credentials never travel in the URL, so no query is accepted at all.
                return protocol.reject(
                    http.HTTPStatus.BAD_REQUEST, "query parameters are not allowed\n"
                )
            return protocol.reject(http.HTTPStatus.NOT_FOUND, "Not Found\n")
        token = _bearer(request)
        with self._cond:
            scopes = None if token is None else self._state.token_scopes(token)
            if scopes is None:
                self._record("connection.refused", detail="401")
                response = protocol.reject(http.HTTPStatus.UNAUTHORIZED, "Unauthorized\n")
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
            if SCOPE_CONNECT not in scopes:
                self._record("connection.refused", detail="403")
                return protocol.reject(http.HTTPStatus.FORBIDDEN, "Forbidden\n")
            offered = [
                p.strip()
                for value in request.headers.get_all("Sec-WebSocket-Protocol")
                for p in value.split(",")
            ]
            if SUBPROTOCOL not in offered:
                return protocol.reject(
                    http.HTTPStatus.BAD_REQUEST, f"subprotocol {SUBPROTOCOL} is required\n"
                )
            if len(self._conns) + self._opening >= self._max_connections:
                self._record("connection.refused", detail="503 connection limit")
                return protocol.reject(
                    http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n"
                )
            assert token is not None
            self._opening += 1
        return token

    # ------------------------------------------------------------------ one connection

    def _handle(self, sock: socket.socket, protocol: ServerProtocol, token: str) -> None:
        with self._cond:
            self._opening -= 1
            conn = Conn(sock, protocol, token, self._write_timeout, self._dispatch)
            if self._stopping:
                self._changed()
                conn.abort()
                conn.wire.close(graceful=False)
                return
            self._conns.add(conn)
        conn.start()
        try:
            self._serve(conn)
        finally:
            conn.finish()
            with self._cond:
                self._conns.discard(conn)
                sid = conn.session_id
                if sid is not None and self._by_session.get(sid) is conn:
                    del self._by_session[sid]
                    self._commit(self._state.connection_lost(sid))
                self._changed()

    def _serve(self, conn: Conn) -> None:
        timeout = self._hello_timeout
        while not conn.closing:
            try:
                raw = conn.wire.recv(timeout)
            except InvalidText as exc:
                self._invalid(conn, None, str(exc))
                return
            except TimeoutError:
                with self._cond:
                    kind = "hello_timeout" if conn.session_id is None else "read_idle"
                    self._record(f"connection.{kind}", session=conn.session_id)
                conn.close_after_flush(1008, kind.replace("_", " "))
                return
            except WireClosed:
                return
            if not self._on_frame(conn, raw):
                return
            timeout = self._read_idle

    def _on_frame(self, conn: Conn, raw: str | bytes) -> bool:
        """Apply one frame; False when the connection must stop reading."""
        outcome: bool | _Late
        if isinstance(raw, bytes):
            outcome = self._invalid(conn, None, "binary frames are not allowed")
        else:
            try:
                frame = decode_client_frame(raw)
            except InvalidClientFrame as exc:
                outcome = self._invalid(conn, exc.message_id, str(exc))
            else:
                with self._cond:
                    outcome = self._apply(conn, frame)
        if isinstance(outcome, _Late):
            return self._deliver_late(conn, outcome)
        return outcome

    def _apply(self, conn: Conn, frame: ClientFrame) -> bool | _Late:
        """Apply one decoded frame and queue its answer. Caller holds the lock."""
        if conn.closing:
            return False
        sid = conn.session_id
        if sid is None and frame.type != "worker.hello":
            return self._invalid(conn, frame.message_id, "the first frame must be worker.hello")
        if self.faults.take("close_before", frame.type, sid):
            conn.abort()
            return False
        fault = self.faults.take("reply_error", frame.type, sid)
        if fault is not None:
            text = _answer(frame, "error", None, (fault.code, "injected fault"), sid)
            return self._reply(conn, text, 0.0, (), None)
        if sid is None:
            handled = self._state.hello(conn.token, frame)
            if handled.session_id is not None:
                conn.session_id = handled.session_id
                self._by_session[handled.session_id] = conn
        else:
            handled = self._state.handle(sid, frame)
        return self._respond(conn, frame, handled)

    def _respond(self, conn: Conn, frame: ClientFrame, handled: Handled) -> bool | _Late:
        sid = handled.session_id
        answer = handled.answer
        if self.faults.take("close_after", frame.type, sid):
            conn.abort()
            self._commit(handled.actions)
            return False
        dropped = self.faults.take("drop_reply", frame.type, sid) is not None
        delay = self.faults.take("delay_reply", frame.type, sid)
        close = (answer.error[0] if answer.error else "") if answer.close else None
        if dropped:
            return self._follow(conn, handled.actions, close)
        text = _answer(frame, answer.type, answer.body, answer.error, sid)
        return self._reply(
            conn, text, delay.seconds if delay is not None else 0.0, handled.actions, close
        )

    def _reply(
        self,
        conn: Conn,
        text: str,
        delay: float,
        actions: Iterable[Action],
        close: str | None,
    ) -> bool | _Late:
        """Queue an answer, then *actions*, then close with *close* (a reason) when not None.
        Caller holds the lock. Returns whether the connection keeps reading, or, when the
        outbox is full, the part that must wait for room (outside the lock: ``_deliver_late``).
        """
        if conn.offer(text, delay):
            return self._follow(conn, actions, close)
        # Pushes to other sessions go now; this connection's own wait behind their answer.
        sid = conn.session_id
        actions = tuple(actions)
        self._commit(a for a in actions if a.session_id != sid)
        return _Late(text, delay, tuple(a for a in actions if a.session_id == sid), close)

    def _follow(self, conn: Conn, actions: Iterable[Action], close: str | None) -> bool:
        """What follows an answer: *actions*, then the close. Caller holds the lock."""
        self._commit(actions)
        if close is not None:
            conn.close_after_flush(1008, close)
        return close is None and not conn.closing

    def _deliver_late(self, conn: Conn, late: _Late) -> bool:
        """Wait for room for an answer up to the write deadline, without the lock (so the
        scheduler and every other connection go on meanwhile); none came: a slow consumer.
        The handler reads nothing more meanwhile, so inbound frames stay bounded too."""
        if not conn.put(late.text, late.delay):
            self._slow_consumer(conn)
            return False
        with self._cond:
            return self._follow(conn, late.actions, late.close)

    def _invalid(self, conn: Conn, message_id: str | None, reason: str) -> bool | _Late:
        # Answer INVALID_FRAME (with reply_to when the id was readable), then close (§11).
        with self._cond:
            self._record("frame.invalid", session=conn.session_id, detail=reason[:200])
            text = encode_frame(
                "error",
                new_message_id(),
                session_id=conn.session_id,
                reply_to=message_id,
                error=("INVALID_FRAME", "the frame is not a valid pulse.worker.v1 request"),
            )
            return self._reply(conn, text, 0.0, (), "invalid frame")


def _answer(
    frame: ClientFrame,
    kind: str,
    body: dict[str, Any] | None,
    error: tuple[str, str] | None,
    session_id: str | None,
) -> str:
    """The encoded answer to *frame*."""
    return encode_frame(
        kind,
        new_message_id(),
        session_id=session_id,
        body=body,
        reply_to=frame.message_id,
        error=error,
    )


def _admin_error(
    status: int, message: str, headers: Iterable[tuple[str, str]] = (), *, code: str = ""
) -> Response:
    """An admin API error answer: ``{"error": {"code", "message"}}``."""
    return _http.json_response(
        status,
        {
            "error": {
                "code": code or _ERROR_CODES.get(status, "INVALID_ARGUMENT"),
                "message": message,
            }
        },
        headers,
    )


_ERROR_CODES = {
    404: "NOT_FOUND",
    408: "TIMEOUT",
    411: "LENGTH_REQUIRED",
    413: "TOO_LARGE",
    431: "TOO_LARGE",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


def _bearer(request: Request) -> str | None:
    values = request.headers.get_all("Authorization")
    if len(values) != 1:
        return None
    scheme, _, token = values[0].partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


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
