"""A tiny, deliberately dumb ``pulse.worker.v1`` client for testing the mock server over real
sockets: it sends exactly the frames a test asks for and hands back the server's frames as
dicts, with no validation of its own (so tests can also send broken frames)."""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import socket
import time
import urllib.parse
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from orbit_sync import _codec
from orbit_sync._codec import SUBPROTOCOL, unstructure
from orbit_sync.errors import WorkerError, WorkerProtocolError
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
from orbit_sync.testing import MockOrbitServer

#: websockets 17 warns unless connect() is a context manager or ``legacy=True`` is passed;
#: websockets 16 (the last release for Python 3.10) has no such argument.
LEGACY: dict[str, Any] = (
    {"legacy": True} if "legacy" in inspect.signature(connect).parameters else {}
)

CAP = Capability("resize", "1", "1")


class Closed(Exception):
    """The server closed the connection."""


class RawClient:
    """One raw connection. Pushes that arrive while waiting for an answer are kept in order."""

    def __init__(
        self,
        server: MockOrbitServer,
        *,
        token: str | None = None,
        registration: Registration | None = None,
        capacity: int = 4,
        notifications: bool = False,
        subprotocols: list[str] | None = None,
        strict: bool = True,
    ) -> None:
        self.server = server
        self.token = server.token if token is None else token
        self.registration = registration or Registration(
            queue_id=server.queue_id,
            capabilities=[CAP],
            capacity=capacity,
            instance_id=new_id(),
            instance_secret=new_secret(),
            cancellation_notifications=notifications,
        )
        self._subprotocols = [SUBPROTOCOL] if subprotocols is None else subprotocols
        self.ws: ClientConnection | None = None
        self.session_id: str | None = None
        self.epoch: int | None = None
        self.pushes: collections.deque[dict[str, Any]] = collections.deque()
        #: Check every server frame with the SDK's own client-side decoder (conformance).
        self.strict = strict
        self._pending: dict[str, str] = {}

    # ------------------------------------------------------------------ transport

    def connect(self, path: str = "/v1/worker/connect", **kw: Any) -> RawClient:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        options: dict[str, Any] = {
            "subprotocols": self._subprotocols,
            "additional_headers": headers,
            "compression": None,
            "open_timeout": 5,
            "close_timeout": 1,
            "max_size": None,
            **LEGACY,
        }
        options.update(kw)
        self.ws = connect(self.server.url + path, **options)
        return self

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()

    def send_text(self, text: str | bytes) -> None:
        assert self.ws is not None
        self.ws.send(text)

    def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        """The next frame from the server, as a dict."""
        assert self.ws is not None
        try:
            raw = self.ws.recv(timeout=timeout)
        except ConnectionClosed as exc:
            raise Closed(str(exc)) from None
        value: dict[str, Any] = json.loads(raw)
        if self.strict:
            self._check(raw, value)
        return value

    def _check(self, raw: str | bytes, frame: dict[str, Any]) -> None:
        reply_to = frame.get("reply_to")
        kind = self._pending.get(reply_to) if isinstance(reply_to, str) else None
        try:
            if kind == "worker.hello":
                with contextlib.suppress(WorkerError):
                    _codec.decode_welcome(raw, reply_to)  # type: ignore[arg-type]
            else:
                assert self.session_id is not None and self.epoch is not None
                ctx = _codec.SessionContext(self.session_id, self.epoch, self.registration)
                _codec.decode_server_frame(raw, ctx, self._pending.get)
        except WorkerProtocolError as exc:
            raise AssertionError(f"server frame breaks the protocol: {exc}") from None
        if isinstance(reply_to, str):
            self._pending.pop(reply_to, None)

    def wait_closed(self, timeout: float = 5.0) -> None:
        """Read until the server closes; frames read meanwhile are kept as pushes."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.pushes.append(self.recv(max(0.0, deadline - time.monotonic())))
            except Closed:
                return

    # ------------------------------------------------------------------ requests

    def send(
        self,
        kind: str,
        body: Any,
        *,
        message_id: str | None = None,
        session_id: str | None = "current",
    ) -> str:
        mid = message_id or new_message_id()
        frame: dict[str, Any] = {"protocol_version": "1", "type": kind, "message_id": mid}
        sid = self.session_id if session_id == "current" else session_id
        if sid is not None:
            frame["session_id"] = sid
        frame["body"] = body if isinstance(body, dict) else unstructure(body)
        self.expect(mid, kind)
        self.send_text(json.dumps(frame))
        return mid

    def expect(self, message_id: str, kind: str) -> None:
        """Await an answer to *message_id*, a *kind* request sent by other means (fragments)."""
        self._pending[message_id] = kind

    def answer(self, message_id: str, timeout: float = 5.0) -> dict[str, Any]:
        """Read until the frame answering *message_id*; pushes are kept."""
        deadline = time.monotonic() + timeout
        while True:
            frame = self.recv(max(0.0, deadline - time.monotonic()))
            if frame.get("reply_to") == message_id:
                return frame
            self.pushes.append(frame)

    def request(self, kind: str, body: Any, **kw: Any) -> dict[str, Any]:
        timeout = kw.pop("timeout", 5.0)
        return self.answer(self.send(kind, body, **kw), timeout)

    def hello(self) -> dict[str, Any]:
        frame = self.request("worker.hello", self.registration, session_id=None)
        if frame["type"] == "worker.welcome":
            self.session_id = frame["session_id"]
            self.epoch = int(frame["body"]["epoch"])
        return frame

    def capacity(
        self, sequence: int, capacity: int, drain: bool = False, **kw: Any
    ) -> dict[str, Any]:
        return self.request("worker.capacity", CapacityReport(sequence, capacity, drain), **kw)

    def open(self, capacity: int | None = None, sequence: int = 1, **connect: Any) -> RawClient:
        """connect + hello + first capacity report."""
        self.connect(**connect)
        assert self.hello()["type"] == "worker.welcome"
        cap = self.registration.capacity if capacity is None else capacity
        assert self.capacity(sequence, cap)["type"] == "ack"
        return self

    def next_push(self, kind: str = "task.assign", timeout: float = 5.0) -> dict[str, Any]:
        """The next push of *kind* (earlier pushes of other kinds stay queued)."""
        for frame in list(self.pushes):
            if frame.get("type") == kind:
                self.pushes.remove(frame)
                return frame
        deadline = time.monotonic() + timeout
        while True:
            frame = self.recv(max(0.0, deadline - time.monotonic()))
            if frame.get("type") == kind:
                return frame
            self.pushes.append(frame)

    # ------------------------------------------------------------------ attempts

    @staticmethod
    def ref(assign: dict[str, Any]) -> AttemptRef:
        body = assign["body"]
        return AttemptRef(
            task_id=body["task"]["task_id"],
            attempt_id=body["attempt_id"],
            epoch=int(body["epoch"]),
            lease_secret=body["lease_secret"],
        )

    def start(self, ref: AttemptRef, **kw: Any) -> dict[str, Any]:
        return self.request("task.start", ref, **kw)

    def renew(self, ref: AttemptRef, **kw: Any) -> dict[str, Any]:
        return self.request("task.renew", ref, **kw)

    def resume(self, ref: AttemptRef, **kw: Any) -> dict[str, Any]:
        return self.request("worker.resume", ref, **kw)

    def finish(
        self,
        ref: AttemptRef,
        outcome: str = "SUCCEEDED",
        result: Any = None,
        error_code: str | None = None,
        retryable: bool | None = None,
        **kw: Any,
    ) -> dict[str, Any]:
        fin = Finish(
            ref=ref,
            outcome=outcome,
            result={"ok": True} if result is None else result,
            error_code=error_code,
            retryable=retryable,
        )
        return self.request("task.finish", fin, **kw)

    def reconnect(self) -> RawClient:
        """A new connection of the same process (same registration)."""
        return RawClient(self.server, token=self.token, registration=self.registration)


def small_window_socket(server: MockOrbitServer, rcvbuf: int = 16 * 1024) -> socket.socket:
    """A TCP connection to *server* with a small, fixed receive window (no autotuning), to pass
    as ``connect(sock=...)``: once such a client stops reading, what the server writes soon
    stops being accepted by its socket."""
    url = urllib.parse.urlsplit(server.url)
    assert url.hostname is not None and url.port is not None
    sock = socket.socket(socket.AF_INET6 if ":" in url.hostname else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: sets the window
    sock.connect((url.hostname, url.port))
    return sock


def error_code(frame: dict[str, Any]) -> str | None:
    """The error code of an ``error`` frame, else None."""
    return frame["error"]["code"] if frame.get("type") == "error" else None
