"""The mock server's listening socket: a supervised accept loop and pre-authentication admission.

websockets' ``serve_forever`` leaves its loop for good on any ``OSError`` from ``accept()``
(``EMFILE`` when descriptors run out): the process lives on and never accepts again, silently.
This loop backs off and retries on resource errors and says so in the log (once per episode,
and again when it recovers); anything else that escapes it is logged and the loop restarted.

Admission happens before a byte is read: at most ``max_pending`` accepted connections may be
unauthenticated at once (each holds a thread and a descriptor until its handshake deadline);
one more is closed at once. A connection leaves that count when :meth:`Admission.release` is
called (the server calls it once the peer has authenticated) or when its thread ends.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

from .._realtime import monotonic

__all__ = ["Admission", "Listener"]

_LOG = logging.getLogger("orbit_sync.testing.server")

#: accept() errors that mean "out of a resource": wait and retry, the backlog keeps the peers.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: accept() errors about one peer (gone before we took it) or none at all: just go on.
_TRANSIENT = frozenset(
    {errno.ECONNABORTED, errno.EINTR, errno.EAGAIN, errno.EWOULDBLOCK, errno.EPROTO, errno.EPERM}
)
_BACKOFF_FIRST = 0.01
_BACKOFF_MAX = 0.5


class Admission:
    """One accepted connection's pre-authentication slot and its current socket object (the
    server replaces it with the TLS-wrapped one, which is what a stop must shut down)."""

    def __init__(self, listener: Listener, sock: socket.socket) -> None:
        self._listener = listener
        self.sock = sock
        self.released = False

    def release(self) -> None:
        """Leave the pre-authentication count (idempotent)."""
        self._listener._release(self)


Serve = Callable[[socket.socket, Any, Admission], None]


class Listener:
    """Bind *host*:*port* and hand each admitted connection, on its own thread, to *serve*."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_pending: int,
        serve: Serve,
        on_refused: Callable[[], None],
        on_accept_error: Callable[[str], None],
        on_pending: Callable[[], None],
    ) -> None:
        self.socket = socket.create_server((host, port))
        # select() says a peer is waiting; it may be gone before accept() runs: never block there.
        self.socket.setblocking(False)
        self._max_pending = max_pending
        self._serve = serve
        self._on_refused = on_refused
        self._on_accept_error = on_accept_error
        # Called after the number of pending connections changed (waiters re-check it).
        self._on_pending = on_pending
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._pending: dict[Admission, None] = {}
        self._threads: set[threading.Thread] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._supervise, name="orbit-mock-accept", daemon=True
        )
        self.accepting = False

    @property
    def pending(self) -> int:
        """Connections accepted and not yet authenticated."""
        with self._lock:
            return len(self._pending)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, close the listening socket, and cut every unauthenticated connection
        (their threads then end promptly). :meth:`join` waits for every connection thread."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join()
        for sock in (self.socket, self._wake_r, self._wake_w):
            sock.close()
        with self._lock:
            pending = [adm.sock for adm in self._pending]
        for sock in pending:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _prune_threads(self) -> list[threading.Thread]:
        """Drop ended connection threads (under the lock); return those still alive.

        Threads never remove themselves: one that did could still be alive when join() found
        the set empty."""
        alive = [t for t in self._threads if t.is_alive()]
        self._threads = set(alive)
        return alive

    def join(self) -> None:
        """Wait until every connection thread has ended (after :meth:`stop`)."""
        while True:
            with self._lock:
                threads = self._prune_threads()
            if not threads:
                return
            for thread in threads:
                thread.join()

    # ------------------------------------------------------------------ accept loop

    def _supervise(self) -> None:
        delay = _BACKOFF_FIRST
        while not self._stopping.is_set():
            try:
                self._accept_loop()
            except Exception:
                _LOG.exception("the accept loop failed; restarting it")
            finally:
                self.accepting = False
            if self._stopping.wait(delay):
                return
            delay = min(delay * 2, _BACKOFF_MAX)

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            self.accepting = True
            failing_since: float | None = None
            delay = _BACKOFF_FIRST
            while not self._stopping.is_set():
                selector.select()
                if self._stopping.is_set():
                    return
                try:
                    sock, addr = self.socket.accept()
                except OSError as exc:
                    if isinstance(exc, BlockingIOError) or exc.errno in _TRANSIENT:
                        continue
                    if exc.errno not in _EXHAUSTED:
                        raise
                    if failing_since is None:
                        failing_since = monotonic()
                        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
                        _LOG.warning(
                            "cannot accept connections (%s: %s); retrying with backoff",
                            name,
                            exc.strerror,
                        )
                        self._on_accept_error(name)
                    # The waiting peers stay in the kernel's backlog meanwhile.
                    if self._stopping.wait(delay):
                        return
                    delay = min(delay * 2, _BACKOFF_MAX)
                    continue
                if failing_since is not None:
                    _LOG.warning(
                        "accepting connections again after %.1f s", monotonic() - failing_since
                    )
                    failing_since = None
                    delay = _BACKOFF_FIRST
                self._admit(sock, addr)

    def _admit(self, sock: socket.socket, addr: Any) -> None:
        with self._lock:
            admitted = not self._stopping.is_set() and len(self._pending) < self._max_pending
            if admitted:
                admission = Admission(self, sock)
                self._pending[admission] = None
        if admitted:
            self._on_pending()
        else:
            # Recorded before the close, so a peer that sees its socket closed finds the event.
            if not self._stopping.is_set():
                self._on_refused()
            sock.close()
            return
        thread = threading.Thread(
            target=self._run, args=(sock, addr, admission), name="orbit-mock-conn", daemon=True
        )
        with self._lock:
            self._prune_threads()
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError:  # the process cannot start one more thread now
            _LOG.warning("cannot start a connection thread; closing the connection")
            with self._lock:
                self._threads.discard(thread)
            admission.release()
            sock.close()

    def _run(self, sock: socket.socket, addr: Any, admission: Admission) -> None:
        try:
            self._serve(sock, addr, admission)
        except Exception:
            _LOG.exception("a connection handler failed")
        finally:
            admission.release()
            admission.sock.close()

    def _release(self, admission: Admission) -> None:
        with self._lock:
            if admission.released:
                return
            admission.released = True
            self._pending.pop(admission, None)
        self._on_pending()
