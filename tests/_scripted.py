"""A scripted raw WebSocket server for protocol tests (``websockets.sync.server`` on loopback).

Unlike the mock Orbit server it has no protocol logic: each accepted connection is handed to the
test as a :class:`Peer` that the test drives from its own thread. The test reads the client's
frames, answers with any frame (valid or not), pushes anything, or writes raw bytes that no
conforming WebSocket library would produce. The upgrade itself can be refused with any status,
redirected, or answered without (or with another) subprotocol.

Every blocking call takes a timeout, so a test never hangs on a silent client.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import queue
import socket
import ssl
import struct
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection, serve

SUBPROTOCOL = "pulse.worker.v1"
T0 = _dt.datetime(2026, 9, 17, 8, 0, 0, tzinfo=_dt.timezone.utc)
SESSION_ID = "33333333333333333333333333333333"
QUEUE_ID = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
NAMESPACE_ID = "55555555555555555555555555555555"
TASK_ID = "11111111111111111111111111111111"
ATTEMPT_ID = "22222222222222222222222222222222"
LEASE_SECRET = "L" * 42 + "A"  # a valid 43-character secret the tests can search for
WAIT = 5.0  # bound of every blocking test step (never reached when things work)

_counter = iter(range(1, 1 << 62))


def mid() -> str:
    """A fresh, deterministic-looking server message id."""
    return f"{next(_counter):032x}"


def ts(seconds: float = 0.0) -> str:
    """``T0 + seconds`` as RFC 3339 UTC."""
    value = T0 + _dt.timedelta(seconds=seconds)
    text = value.strftime("%Y-%m-%dT%H:%M:%S")
    if value.microsecond:
        text += "." + f"{value.microsecond:06d}".rstrip("0")
    return text + "Z"


# ----------------------------------------------------------------------------- frame builders


def frame(
    type_: str,
    *,
    reply_to: str | None = None,
    session_id: str | None = SESSION_ID,
    body: Mapping[str, Any] | None = None,
    error: tuple[str, str] | None = None,
    message_id: str | None = None,
) -> dict[str, Any]:
    """A server frame; fields set to ``None`` are left out."""
    out: dict[str, Any] = {
        "protocol_version": "1",
        "type": type_,
        "message_id": message_id or mid(),
    }
    if reply_to is not None:
        out["reply_to"] = reply_to
    if session_id is not None:
        out["session_id"] = session_id
    if body is not None:
        out["body"] = dict(body)
    if error is not None:
        out["error"] = {"code": error[0], "message": error[1]}
    return out


def welcome_body(
    session_id: str = SESSION_ID,
    *,
    epoch: str = "1",
    window: float = 45.0,
    lease_duration_ms: int = 30_000,
    draining: bool = False,
) -> dict[str, Any]:
    """A valid Welcome (also the ``worker.capacity`` ack body)."""
    return {
        "session_id": session_id,
        "epoch": epoch,
        "server_time": ts(),
        "expires_at": ts(window),
        "lease_duration_ms": lease_duration_ms,
        "draining": draining,
    }


def lease_body(
    *, active: bool = True, state: str = "RUNNING", window: float = 30.0, **extra: Any
) -> dict[str, Any]:
    """A LeaseStatus whose server-side window is *window* seconds."""
    return {
        "active": active,
        "state": state,
        "lease_until": ts(window),
        "server_time": ts(),
        **extra,
    }


def command_body(
    operation: str,
    *,
    lease: Mapping[str, Any] | None = None,
    deduplicated: bool = False,
    disposition: str = "APPLIED",
    task_state: str = "RUNNING",
    attempt_state: str = "RUNNING",
) -> dict[str, Any]:
    """A CommandResult for *operation* (``start``/``renew``/``finish``)."""
    return {
        "receipt": {
            "operation": operation,
            "task_state": task_state,
            "attempt_state": attempt_state,
            "task_revision": "3",
            "lease_until": ts(30),
            "disposition": disposition,
        },
        "lease": dict(lease) if lease is not None else lease_body(),
        "deduplicated": deduplicated,
    }


def assignment_body(
    *,
    queue_id: str = QUEUE_ID,
    task_id: str = TASK_ID,
    attempt_id: str = ATTEMPT_ID,
    handler: str = "resize",
    state: str = "LEASED",
    payload: Any = None,
) -> dict[str, Any]:
    """A ``task.assign`` body for the ``resize``/1/1 capability."""
    return {
        "task": {
            "task_id": task_id,
            "queue_id": queue_id,
            "namespace_id": NAMESPACE_ID,
            "handler": handler,
            "handler_version": "1",
            "payload_version": "1",
            "payload": {"w": 640} if payload is None else payload,
            "state": state,
            "revision": "2",
            "attempt": "1",
            "max_attempts": "3",
        },
        "attempt_id": attempt_id,
        "epoch": "1",
        "lease_secret": LEASE_SECRET,
        "lease_until": ts(30),
        "server_time": ts(),
    }


def cancel_body(task_id: str = TASK_ID, attempt_id: str = ATTEMPT_ID) -> dict[str, Any]:
    """A ``task.cancel`` body."""
    return {
        "task_id": task_id,
        "attempt_id": attempt_id,
        "epoch": "1",
        "cancel_requested_at": ts(-1),
    }


def raw_frame(
    opcode: int,
    payload: bytes,
    *,
    fin: bool = True,
    rsv1: bool = False,
    masked: bool = False,
    length: int | None = None,
) -> bytes:
    """Bytes of one WebSocket frame as a server would write them (*length* may lie)."""
    first = (0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode
    size = len(payload) if length is None else length
    mask_bit = 0x80 if masked else 0
    if size < 126:
        header = struct.pack("!BB", first, mask_bit | size)
    elif size < 1 << 16:
        header = struct.pack("!BBH", first, mask_bit | 126, size)
    else:
        header = struct.pack("!BBQ", first, mask_bit | 127, size)
    if masked:
        header += b"\x00\x00\x00\x00"  # a zero mask leaves the payload as is
    return header + payload


# ----------------------------------------------------------------------------- server


class Peer:
    """The server side of one accepted connection, driven by the test."""

    def __init__(self, conn: ServerConnection) -> None:
        self.conn = conn
        self.finished = threading.Event()

    def recv(self, timeout: float = WAIT) -> dict[str, Any]:
        """The client's next frame, parsed."""
        text = self.conn.recv(timeout, decode=True)
        value = json.loads(text)
        assert isinstance(value, dict)
        return value

    def send(self, value: Mapping[str, Any] | str | bytes) -> None:
        """Send a text frame: a dict is serialized, str/bytes go as they are.

        A client that already closed is not an error here: refusing what it is sent is often the
        behaviour under test, and the test asserts it on the client side.
        """
        text = json.dumps(value) if isinstance(value, Mapping) else value
        with contextlib.suppress(ConnectionClosed):
            self.conn.send(text, text=True)

    def send_raw(self, data: bytes) -> None:
        """Write raw bytes on the socket, bypassing the WebSocket layer."""
        with contextlib.suppress(OSError):
            self.conn.socket.sendall(data)

    def welcome(self, hello: Mapping[str, Any], **body: Any) -> None:
        """Answer *hello* with a valid welcome (body fields overridable)."""
        session_id = body.pop("session_id", SESSION_ID)
        self.send(
            frame(
                "worker.welcome",
                reply_to=hello["message_id"],
                session_id=session_id,
                body=welcome_body(session_id, **body),
            )
        )

    def handshake(self, **body: Any) -> dict[str, Any]:
        """Read the hello, answer it with a valid welcome; return the hello."""
        hello = self.recv()
        assert hello["type"] == "worker.hello", hello["type"]
        self.welcome(hello, **body)
        return hello

    def ack(self, request: Mapping[str, Any], body: Mapping[str, Any]) -> None:
        """Answer *request* with an ``ack``."""
        self.send(frame("ack", reply_to=request["message_id"], body=body))

    def error(self, request: Mapping[str, Any], code: str, message: str = "no") -> None:
        """Answer *request* with an ``error``."""
        self.send(frame("error", reply_to=request["message_id"], error=(code, message)))

    def push(self, type_: str, body: Mapping[str, Any]) -> None:
        """Push a ``task.assign``/``task.cancel``."""
        self.send(frame(type_, body=body))

    def wait_closed(self, timeout: float = WAIT) -> bool:
        """True once the client has closed the connection (frames read meanwhile are dropped)."""
        try:
            while True:
                self.conn.recv(timeout)
        except ConnectionClosed:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        """Let the server close this connection."""
        self.finished.set()


class ScriptedServer:
    """A WebSocket server on 127.0.0.1, port 0, whose connections the test drives.

    *status*: answer the upgrade with this HTTP status instead of 101 (with *location* as the
    ``Location`` header, for redirects). *subprotocol*: the ``Sec-WebSocket-Protocol`` to answer
    (``None``: none). *ssl_context*: serve ``wss://`` (the URL then names ``localhost``).
    """

    def __init__(
        self,
        *,
        status: int | None = None,
        location: str | None = None,
        subprotocol: str | None = SUBPROTOCOL,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._status = status
        self._location = location
        self._subprotocol = subprotocol
        self._peers: queue.Queue[Peer] = queue.Queue()
        self._all: list[Peer] = []
        #: Set by close(): a connection whose handler starts after it ends at once.
        self._closing = False
        self.requests: list[tuple[str, Headers]] = []
        self._server: Server = serve(
            self._handle,
            "127.0.0.1",
            0,
            ssl=ssl_context,
            subprotocols=[SUBPROTOCOL],  # type: ignore[list-item]
            select_subprotocol=lambda conn, offered: SUBPROTOCOL if offered else None,  # type: ignore[arg-type,return-value]
            process_request=self._process_request,
            process_response=self._process_response,
            compression=None,
            max_size=None,
            ping_interval=None,
            close_timeout=0.5,
        )
        port = self._server.socket.getsockname()[1]
        scheme, host = ("wss", "localhost") if ssl_context is not None else ("ws", "127.0.0.1")
        self.url = f"{scheme}://{host}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="scripted-server", daemon=True
        )
        self._thread.start()

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        self.requests.append((request.path, request.headers))
        if self._status is None:
            return None
        response = conn.respond(self._status, "refused\n")
        if self._location is not None:
            response.headers["Location"] = self._location
        return response

    def _process_response(
        self, conn: ServerConnection, request: Request, response: Response
    ) -> Response | None:
        if response.status_code == 101:
            del response.headers["Sec-WebSocket-Protocol"]
            if self._subprotocol is not None:
                response.headers["Sec-WebSocket-Protocol"] = self._subprotocol
        return None

    def _handle(self, conn: ServerConnection) -> None:
        peer = Peer(conn)
        self._all.append(peer)
        if self._closing:  # close() may have gone through its peers before this one: end it
            peer.finished.set()
            return
        self._peers.put(peer)
        peer.finished.wait()

    def accept(self, timeout: float = WAIT) -> Peer:
        """The next connection that completed the upgrade."""
        return self._peers.get(timeout=timeout)

    def close(self) -> None:
        """Stop serving and close every connection."""
        # Set before the peers are gone through: a handler that starts later sees it (it
        # appends itself first), so the server's shutdown never waits for one left unreleased.
        self._closing = True
        for peer in self._all:
            peer.finished.set()
        self._server.shutdown()
        self._thread.join(WAIT)

    def __enter__(self) -> ScriptedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SilentServer:
    """A TCP listener on 127.0.0.1 that accepts connections and never says a word."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"ws://127.0.0.1:{self.port}"
        self.accepted = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="silent-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        try:
            while True:
                conn, _ = self._sock.accept()
                self._conns.append(conn)
                self.accepted.set()
        except OSError:
            return

    def close(self) -> None:
        """Close the listener and every accepted connection."""
        # shutdown wakes the thread blocked in accept(); close alone does not on Linux.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(WAIT)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leaked(text: str, secrets: Mapping[str, str]) -> list[str]:
    """Names of the *secrets* that occur in *text* (values are never printed)."""
    return [name for name, value in secrets.items() if value and value in text]


def iter_vectors(section: str) -> Iterator[dict[str, Any]]:
    """The frame vectors of *section* from ``tests/vectors/frames.json``."""
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "vectors" / "frames.json").read_text("utf-8"))
    yield from data[section]


# ----------------------------------------------------------------------------- client side

TOKEN = "test-token-0123456789abcdef"  # a value the secret-scanning tests search for
INSTANCE_SECRET = "S" * 42 + "A"


def registration(**overrides: Any) -> Any:
    """A Registration for the scripted server's queue and the ``resize``/1/1 capability."""
    from orbit_sync.models import Capability, Registration

    values: dict[str, Any] = {
        "queue_id": QUEUE_ID,
        "capabilities": [Capability("resize", "1", "1")],
        "capacity": 4,
        "instance_secret": INSTANCE_SECRET,
    }
    values.update(overrides)
    return Registration(**values)


def open_pair(
    server: ScriptedServer,
    reg: Any = None,
    *,
    welcome: Mapping[str, Any] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    **dial: Any,
) -> tuple[Any, Peer]:
    """Dial *server* with the orbit-sync client while a thread answers the hello; return both."""
    from orbit_sync.client import Client

    peers: queue.Queue[Peer] = queue.Queue()

    def serve() -> None:
        peer = server.accept()
        peer.handshake(**(welcome or {}))
        peers.put(peer)

    thread = threading.Thread(target=serve, name="scripted-handshake", daemon=True)
    thread.start()
    client = Client(server.url, TOKEN, ssl_context=ssl_context)
    conn = client.dial_worker(reg if reg is not None else registration(), **dial)
    thread.join(WAIT)
    return conn, peers.get(timeout=WAIT)


def orbit_threads() -> list[str]:
    """Names of the orbit-sync threads alive now."""
    return [t.name for t in threading.enumerate() if t.name.startswith("orbit-sync-")]


@contextlib.contextmanager
def small_send_buffers() -> Iterator[None]:
    """Inside, each new socket (the client's, dialled there) gets a 4 KiB send buffer: with the
    tiny receive window of a :class:`StallingServer`, one large write then blocks in ``send``."""
    plain = socket.socket

    class SmallSendBuffer(plain):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    setattr(socket, "socket", SmallSendBuffer)  # noqa: B010 (mypy refuses assigning a class)
    try:
        yield
    finally:
        setattr(socket, "socket", plain)  # noqa: B010


class StallingServer:
    """Completes the upgrade and the hello/welcome by hand, then never reads again.

    Its receive buffer is tiny, so a client writing to it soon blocks inside ``send``: the case
    where only an outside deadline can release the writer.
    """

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self.url = f"ws://127.0.0.1:{self._sock.getsockname()[1]}"
        self.stalled = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, name="stalling-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import base64
        import hashlib

        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        self._conns.append(conn)
        conn.settimeout(WAIT)
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(4096)
        head, _, rest = data.partition(b"\r\n\r\n")
        key = next(
            line.split(b":", 1)[1].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        accept = base64.b64encode(
            hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()
        )
        conn.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n"
            b"Sec-WebSocket-Protocol: " + SUBPROTOCOL.encode() + b"\r\n\r\n"
        )
        hello = self._read_client_frame(conn, rest)
        reply = frame("worker.welcome", reply_to=hello["message_id"], body=welcome_body())
        conn.sendall(raw_frame(0x1, json.dumps(reply).encode()))
        self.stalled.set()

    @staticmethod
    def _read_client_frame(conn: socket.socket, data: bytes) -> dict[str, Any]:
        def need(n: int) -> bytes:
            nonlocal data
            while len(data) < n:
                data += conn.recv(65536)
            chunk, data = data[:n], data[n:]
            return chunk

        _, second = need(2)
        size = second & 0x7F
        if size == 126:
            size = struct.unpack("!H", need(2))[0]
        elif size == 127:
            size = struct.unpack("!Q", need(8))[0]
        mask = need(4)
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(need(size)))
        value = json.loads(payload)
        assert isinstance(value, dict)
        return value

    def close(self) -> None:
        """Close the listener and the stalled connection."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(WAIT)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> StallingServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
