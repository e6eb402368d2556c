"""One worker WebSocket after its upgrade, on its handler thread: frames in, answers out.

:class:`SessionServer` reads each frame (:mod:`._wire`), decodes it, lets the state machine handle
it under the hub's lock, and queues the answer, then the actions that follow it (pushes to
other sessions, a close), applying the armed faults on the way. An answer that finds the
connection's outbox full waits for room outside the lock, up to the write deadline, and only
then drops the client as a slow consumer (PROTOCOL §10). A connection that sends nothing for
the hello or read-idle bound is closed.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterable
from typing import Any

from websockets.server import ServerProtocol

from .._codec import ClientFrame, InvalidClientFrame, decode_client_frame, encode_frame
from ..models import new_message_id
from ._conn import Conn
from ._hub import Hub
from ._state import Action, Handled
from ._wire import InvalidText, WireClosed

__all__ = ["SessionServer"]


@dataclasses.dataclass(frozen=True)
class _Late:
    """An answer that found its connection's outbox full, and what must follow it."""

    text: str
    delay: float
    actions: tuple[Action, ...]
    close: str | None


class SessionServer:
    """Serves each upgraded connection on the thread that accepted it (:meth:`run`)."""

    def __init__(
        self, hub: Hub, *, hello_timeout: float, read_idle_timeout: float, write_timeout: float
    ) -> None:
        self._hub = hub
        self._hello_timeout = hello_timeout
        self._read_idle = read_idle_timeout
        self._write_timeout = write_timeout

    def run(self, sock: socket.socket, protocol: ServerProtocol, token: str) -> None:
        """Serve one connection whose upgrade reserved a slot (``hub.opening``) until it ends."""
        hub = self._hub
        with hub.cond:
            hub.opening -= 1
            conn = Conn(sock, protocol, token, self._write_timeout, hub.dispatch)
            if hub.stopping:
                hub.changed()
                conn.abort()
                conn.wire.close(graceful=False)
                return
            hub.conns.add(conn)
        conn.start()
        try:
            self._serve(conn)
        finally:
            conn.finish()
            with hub.cond:
                hub.conns.discard(conn)
                sid = conn.session_id
                if sid is not None and hub.by_session.get(sid) is conn:
                    del hub.by_session[sid]
                    hub.commit(hub.state.connection_lost(sid))
                hub.changed()

    def _serve(self, conn: Conn) -> None:
        timeout = self._hello_timeout
        while not conn.closing:
            try:
                raw = conn.wire.recv(timeout)
            except InvalidText as exc:
                self._invalid(conn, None, str(exc))
                return
            except TimeoutError:
                with self._hub.cond:
                    kind = "hello_timeout" if conn.session_id is None else "read_idle"
                    self._hub.record(f"connection.{kind}", session=conn.session_id)
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
                with self._hub.cond:
                    outcome = self._apply(conn, frame)
        if isinstance(outcome, _Late):
            return self._deliver_late(conn, outcome)
        return outcome

    def _apply(self, conn: Conn, frame: ClientFrame) -> bool | _Late:
        """Apply one decoded frame and queue its answer. Caller holds the lock."""
        if conn.closing:
            return False
        hub = self._hub
        sid = conn.session_id
        if sid is None and frame.type != "worker.hello":
            return self._invalid(conn, frame.message_id, "the first frame must be worker.hello")
        if hub.faults.take("close_before", frame.type, sid):
            conn.abort()
            return False
        fault = hub.faults.take("reply_error", frame.type, sid)
        if fault is not None:
            text = _answer(frame, "error", None, (fault.code, "injected fault"), sid)
            return self._reply(conn, text, 0.0, (), None)
        if sid is None:
            handled = hub.state.hello(conn.token, frame)
            if handled.session_id is not None:
                conn.session_id = handled.session_id
                hub.by_session[handled.session_id] = conn
        else:
            handled = hub.state.handle(sid, frame)
        return self._respond(conn, frame, handled)

    def _respond(self, conn: Conn, frame: ClientFrame, handled: Handled) -> bool | _Late:
        faults = self._hub.faults
        sid = handled.session_id
        answer = handled.answer
        if faults.take("close_after", frame.type, sid):
            conn.abort()
            self._hub.commit(handled.actions)
            return False
        dropped = faults.take("drop_reply", frame.type, sid) is not None
        delay = faults.take("delay_reply", frame.type, sid)
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
        self._hub.commit(a for a in actions if a.session_id != sid)
        return _Late(text, delay, tuple(a for a in actions if a.session_id == sid), close)

    def _follow(self, conn: Conn, actions: Iterable[Action], close: str | None) -> bool:
        """What follows an answer: *actions*, then the close. Caller holds the lock."""
        self._hub.commit(actions)
        if close is not None:
            conn.close_after_flush(1008, close)
        return close is None and not conn.closing

    def _deliver_late(self, conn: Conn, late: _Late) -> bool:
        """Wait for room for an answer up to the write deadline, without the lock (so the
        scheduler and every other connection go on meanwhile); none came: a slow consumer.
        The handler reads nothing more meanwhile, so inbound frames stay bounded too."""
        if not conn.put(late.text, late.delay):
            self._hub.slow_consumer(conn)
            return False
        with self._hub.cond:
            return self._follow(conn, late.actions, late.close)

    def _invalid(self, conn: Conn, message_id: str | None, reason: str) -> bool | _Late:
        # Answer INVALID_FRAME (with reply_to when the id was readable), then close (§11).
        with self._hub.cond:
            self._hub.record("frame.invalid", session=conn.session_id, detail=reason[:200])
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
