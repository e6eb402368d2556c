"""Drive the mock server's pure state machine (``OrbitState``) without sockets: a ManualClock,
frames built and validated by the real codec, and actions routed to per-session inboxes."""

from __future__ import annotations

import collections
from typing import Any

from orbit_sync._codec import ClientFrame, decode_client_frame, encode_frame, unstructure
from orbit_sync.models import (
    AttemptRef,
    Capability,
    CapacityReport,
    Finish,
    Registration,
    new_id,
    new_message_id,
    new_secret,
)
from orbit_sync.testing import ManualClock, MockOrbitServer
from orbit_sync.testing._state import Action, CloseSession, Handled, OrbitState, Push

CAP = Capability("resize", "1", "1")
#: The token scopes a worker needs, as docs/protocol.md names them.
SCOPE_CONNECT = "workers:connect"
SCOPE_CONSUME = "workers:consume"
queue_scope = MockOrbitServer.queue_scope


def client_frame(
    kind: str, body: Any, *, session_id: str | None, message_id: str | None = None
) -> ClientFrame:
    """A client frame exactly as the server would receive it (through the strict decoder)."""
    wire = body if isinstance(body, dict) else unstructure(body)
    text = encode_frame(kind, message_id or new_message_id(), session_id=session_id, body=wire)
    return decode_client_frame(text)


class Kit:
    """One OrbitState on a ManualClock, with a default token and queue."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("assignment_rate", None)
        self.clock = ManualClock()
        self.state = OrbitState(clock=self.clock, **kw)
        self.queue_id = self.state.default_queue
        self.token = self.state.add_token(
            {SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(self.queue_id)}
        )
        self.inbox: dict[str, collections.deque[Push]] = collections.defaultdict(collections.deque)
        self.closed: list[str] = []

    def route(self, actions: Any) -> None:
        for action in actions:
            if isinstance(action, CloseSession):
                self.closed.append(action.session_id)
            else:
                self.inbox[action.session_id].append(action)

    def enqueue(self, handler: str = "resize", payload: Any = None, **kw: Any) -> str:
        task_id, actions = self.state.enqueue(
            handler, {"n": 1} if payload is None else payload, **kw
        )
        self.route(actions)
        return task_id

    def advance(self, seconds: float) -> None:
        self.route(self.state.advance(seconds))

    def cancel(self, task_id: str) -> None:
        self.route(self.state.request_cancel(task_id))

    def worker(self, **kw: Any) -> Proc:
        return Proc(self, **kw)


class Proc:
    """A simulated worker process: one registration, any number of sessions over time."""

    def __init__(
        self,
        kit: Kit,
        *,
        capacity: int = 4,
        capabilities: list[Capability] | None = None,
        notifications: bool = False,
        token: str | None = None,
        queue_id: str | None = None,
    ) -> None:
        self.kit = kit
        self.token = kit.token if token is None else token
        self.registration = Registration(
            queue_id=kit.queue_id if queue_id is None else queue_id,
            capabilities=capabilities or [CAP],
            capacity=capacity,
            instance_id=new_id(),
            instance_secret=new_secret(),
            cancellation_notifications=notifications,
        )
        self.session_id: str | None = None
        self.sequence = 0

    def hello(self, registration: Registration | None = None) -> Handled:
        frame = client_frame("worker.hello", registration or self.registration, session_id=None)
        handled = self.kit.state.hello(self.token, frame)
        self.kit.route(handled.actions)
        if handled.session_id is not None:
            self.session_id = handled.session_id
        return handled

    def send(
        self, kind: str, body: Any, *, message_id: str | None = None, session_id: str | None = None
    ) -> Handled:
        sid = session_id or self.session_id
        assert sid is not None
        frame = client_frame(kind, body, session_id=sid, message_id=message_id)
        handled = self.kit.state.handle(self.session_id or sid, frame)
        self.kit.route(handled.actions)
        return handled

    def capacity(
        self,
        capacity: int | None = None,
        *,
        drain: bool = False,
        sequence: int | None = None,
        message_id: str | None = None,
    ) -> Handled:
        if sequence is None:
            self.sequence += 1
            sequence = self.sequence
        cap = self.registration.capacity if capacity is None else capacity
        return self.send(
            "worker.capacity", CapacityReport(sequence, cap, drain), message_id=message_id
        )

    def open(self, capacity: int | None = None) -> Proc:
        assert self.hello().answer.type == "worker.welcome"
        assert self.capacity(capacity).answer.type == "ack"
        return self

    @property
    def pushes(self) -> collections.deque[Push]:
        assert self.session_id is not None
        return self.kit.inbox[self.session_id]

    def assignments(self) -> list[dict[str, Any]]:
        """Drain and return the task.assign bodies received by the current session."""
        out = [p.body for p in self.pushes if p.type == "task.assign" and p.body is not None]
        self.pushes.clear()
        return out

    def take(self) -> AttemptRef:
        """The single pending assignment's AttemptRef."""
        bodies = self.assignments()
        assert len(bodies) == 1, f"expected one assignment, got {len(bodies)}"
        return ref_of(bodies[0])

    def start(self, ref: AttemptRef, **kw: Any) -> Handled:
        return self.send("task.start", ref, **kw)

    def renew(self, ref: AttemptRef, **kw: Any) -> Handled:
        return self.send("task.renew", ref, **kw)

    def resume(self, ref: AttemptRef, **kw: Any) -> Handled:
        return self.send("worker.resume", ref, **kw)

    def finish(
        self,
        ref: AttemptRef,
        outcome: str = "SUCCEEDED",
        result: Any = None,
        error_code: str | None = None,
        retryable: bool | None = None,
        **kw: Any,
    ) -> Handled:
        fin = Finish(
            ref=ref,
            outcome=outcome,
            result={"ok": True} if result is None else result,
            error_code=error_code,
            retryable=retryable,
        )
        return self.send("task.finish", fin, **kw)


def ref_of(assign_body: dict[str, Any]) -> AttemptRef:
    return AttemptRef(
        task_id=assign_body["task"]["task_id"],
        attempt_id=assign_body["attempt_id"],
        epoch=int(assign_body["epoch"]),
        lease_secret=assign_body["lease_secret"],
    )


def code(handled: Handled) -> str | None:
    """The error code of an answer, or None for a success."""
    err = handled.answer.error
    return err[0] if err else None


def body(handled: Handled) -> dict[str, Any]:
    assert handled.answer.error is None, handled.answer.error
    assert handled.answer.body is not None
    return handled.answer.body


def pushes_of(actions: list[Action], kind: str) -> list[Push]:
    return [a for a in actions if isinstance(a, Push) and a.type == kind]
