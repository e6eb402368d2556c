"""A bounded HTTP/1.1 server for health probes: one thread, a few sockets, short deadlines.

A probe endpoint is reachable by whoever can reach the port, and it shares the process's file
descriptors with the worker's own connection. So it must not let clients decide what it holds:

- one thread with a selector serves every connection (no thread per socket);
- at most *max_connections* are open at once. When all are taken, a new one evicts the oldest
  that has not sent its request yet (a kubelet sends its request at once; idle sockets held
  open to block the probe go first), or is closed at once if every one is being answered; the
  kernel's listen queue is kept as short;
- each connection has *timeout* seconds in all to send its request and take the answer (a client
  that trickles bytes or never reads is dropped), and a request over 8 KiB is refused;
- when the process is out of descriptors, accepting pauses instead of spinning.

So the probe holds at most *max_connections* + 2 descriptors, and none of them for long.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable

from .._realtime import monotonic
from .._seconds import seconds

__all__ = ["ProbeServer"]

_LOG = logging.getLogger("orbit_sync.contrib.health")

#: The largest request head read; a probe's is a few hundred bytes.
_MAX_REQUEST = 8192
#: How long accepting pauses when the process has no descriptor left.
_FD_PAUSE = 0.5

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}

#: ``answer(path) -> (status, body)`` for a GET of *path* (query string removed).
Answer = Callable[[str], tuple[int, bytes]]


def _response(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _plain(status: int) -> bytes:
    return _response(status, _REASONS[status].encode() + b"\n", "text/plain")


class _Conn:
    __slots__ = ("deadline", "inbox", "outbox", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.inbox = b""
        self.outbox = b""


class ProbeServer:
    """Serves *answer* on ``(host, port)`` from one daemon thread until :meth:`close`."""

    def __init__(
        self,
        answer: Answer,
        host: str,
        port: int,
        *,
        max_connections: int = 8,
        timeout: float = 5.0,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        if type(max_connections) is not int or max_connections < 1:
            raise ValueError("max_connections must be a positive int")
        self._timeout = seconds(timeout, "timeout", positive=True)
        self._answer = answer
        self._max = max_connections
        self._clock = clock
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(address)
            self._listener.listen(self._max)
        except BaseException:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        #: The address it listens on, and its port (useful with ``port=0``).
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self.port: int = self.address[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}
        self._paused_until: float | None = None
        self._stop = False
        self._thread = threading.Thread(
            target=self._main, name="orbit-sync-health-http", daemon=True
        )
        self._thread.start()

    @property
    def open_connections(self) -> int:
        """How many client connections are open now (for tests and diagnostics)."""
        return len(self._conns)

    # ------------------------------------------------------------------ loop

    def _main(self) -> None:
        try:
            while not self._stop:
                now = self._clock()
                self._expire(now)
                self._resume_accepting(now)
                for key, events in self._selector.select(self._wait(now)):
                    sock = key.fileobj
                    if sock is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    elif sock is self._listener:
                        self._accept()
                    else:
                        assert isinstance(sock, socket.socket)
                        self._serve(self._conns[sock], events)
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn)
            self._selector.close()
            self._listener.close()
            self._wake_r.close()

    def _wait(self, now: float) -> float:
        ends = [c.deadline for c in self._conns.values()]
        if self._paused_until is not None:
            ends.append(self._paused_until)
        return max(0.0, min(ends) - now) if ends else 3600.0

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self._drop(conn)

    def _resume_accepting(self, now: float) -> None:
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            self._selector.register(self._listener, selectors.EVENT_READ)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # No descriptor to take the connection with: stop polling the listener for a
                # moment rather than spin on it.
                self._selector.unregister(self._listener)
                self._paused_until = self._clock() + _FD_PAUSE
            return
        if len(self._conns) >= self._max:
            waiting = [c for c in self._conns.values() if not c.outbox]
            if not waiting:
                sock.close()  # every slot is being answered: refused at once, never held
                return
            self._drop(min(waiting, key=lambda c: c.deadline))
        sock.setblocking(False)
        conn = _Conn(sock, self._clock() + self._timeout)
        self._conns[sock] = conn
        self._selector.register(sock, selectors.EVENT_READ)

    def _serve(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_READ and not conn.outbox:
                data = conn.sock.recv(4096)
                if not data:
                    self._drop(conn)
                    return
                conn.inbox += data
                if b"\r\n\r\n" in conn.inbox or b"\n\n" in conn.inbox:
                    self._reply(conn, self._respond(conn.inbox))
                elif len(conn.inbox) > _MAX_REQUEST:
                    self._reply(conn, _plain(400))
            if events & selectors.EVENT_WRITE and conn.outbox:
                sent = conn.sock.send(conn.outbox)
                conn.outbox = conn.outbox[sent:]
                if not conn.outbox:
                    self._drop(conn)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)
        except Exception:  # a bug in the answer must not end the server: this one is dropped
            _LOG.exception("health probe answer failed")
            self._drop(conn)

    def _respond(self, request: bytes) -> bytes:
        line = request.split(b"\n", 1)[0].strip().split()
        if len(line) != 3 or not line[2].startswith(b"HTTP/"):
            return _plain(400)
        if line[0] != b"GET":
            return _plain(405)
        path = line[1].decode("latin-1").split("?", 1)[0]
        status, body = self._answer(path)
        return _response(status, body) if status != 404 else _plain(404)

    def _reply(self, conn: _Conn, data: bytes) -> None:
        conn.outbox = data
        conn.inbox = b""
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    # ------------------------------------------------------------------ control

    def close(self) -> None:
        """Stop serving, close every connection and release the port."""
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(5.0)
        self._wake_w.close()
