"""Errors raised by orbit-sync.

::

    OrbitError                      root of everything below
    ├── HTTPError                   the upgrade was answered with another HTTP status (.status_code)
    ├── WorkerError                 the server answered ``error`` (.code, .message)
    ├── WorkerProtocolError         the server broke the protocol; the connection is closed
    ├── WorkerClosed                the connection was closed by ``close()``
    ├── WorkerDisconnected          the transport broke; reconcile (resume) before re-sending
    ├── WorkerBusy                  32 requests already in flight; nothing was sent
    ├── WorkerBackpressure          more than 8 assignments were left unread; connection closed
    ├── CallTimeout (TimeoutError)  no answer within the call's bound; connection closed
    ├── ServerUnreachable           the server was never reached within first_connect_timeout
    └── FrameError (ValueError)     a frame could not be decoded or encoded (wire layer)

Every error that may be raised after a request frame was (possibly) sent carries
``.message_id``: the caller can re-send the *same* operation on a new connection and the server
answers the original outcome. Messages never contain a token, ``instance_secret`` or
``lease_secret``; errors survive pickling.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CallTimeout",
    "FrameError",
    "HTTPError",
    "OrbitError",
    "ServerUnreachable",
    "WorkerBackpressure",
    "WorkerBusy",
    "WorkerClosed",
    "WorkerDisconnected",
    "WorkerError",
    "WorkerProtocolError",
]

#: Codes that refuse the credentials themselves: reconnecting with them cannot help (§3, §11).
AUTH_CODES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})
#: Codes after which the server's session is dead: delivered to the caller, then the connection
#: closes (PROTOCOL §11).
FATAL_CODES = AUTH_CODES | {"STALE_SESSION"}
#: Codes after which the same operation may succeed if sent again later, on this connection.
TRANSIENT_CODES = frozenset({"RATE_LIMITED", "UNAVAILABLE"})


class OrbitError(Exception):
    """Root of every orbit-sync error."""

    #: The ``message_id`` of the operation this error interrupted, when one was (maybe) sent.
    message_id: str | None = None

    def __init__(self, message: str = "", *, message_id: str | None = None) -> None:
        super().__init__(message)
        self.message_id = message_id

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only attributes are lost by Exception's default pickling; keep them.
        return (_rebuild, (type(self), self.args, self.__dict__.copy()))

    def with_message_id(self, message_id: str | None) -> OrbitError:
        """Return a copy of this error bound to *message_id* (the connection's error is shared)."""
        clone = _rebuild(type(self), self.args, self.__dict__.copy())
        clone.message_id = message_id
        clone.__cause__ = self.__cause__  # what went wrong underneath stays visible
        return clone

    def __str__(self) -> str:
        base = super().__str__()
        if self.message_id:
            return f"{base} (message_id={self.message_id})"
        return base


def _rebuild(cls: type[OrbitError], args: tuple[Any, ...], state: dict[str, Any]) -> OrbitError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class HTTPError(OrbitError):
    """The WebSocket upgrade was answered with an HTTP status other than 101."""

    def __init__(self, status_code: int, message: str = "") -> None:
        super().__init__(message or f"worker connect refused with HTTP {status_code}")
        self.status_code = status_code


class WorkerError(OrbitError):
    """The server answered a request with an ``error`` frame.

    An error answer never means that the business effect did not happen (PROTOCOL §11).
    """

    def __init__(self, code: str, message: str = "", *, message_id: str | None = None) -> None:
        super().__init__(f"orbit worker error {code}: {message}", message_id=message_id)
        self.code = code
        self.message = message

    @property
    def fatal(self) -> bool:
        """True when the server's session is dead after this error."""
        return self.code in FATAL_CODES


class WorkerProtocolError(OrbitError):
    """The server broke ``pulse.worker.v1``; the connection is closed."""


class WorkerClosed(OrbitError):
    """The connection was closed by ``close()``."""


class WorkerDisconnected(OrbitError):
    """The transport broke. Reconcile (``resume``) before re-sending the same operation.

    When a dial's connection was lost (reset or closed), :attr:`dial_stage` says in which stage:
    ``"tls"`` (mid TLS handshake), ``"upgrade"`` (the WebSocket upgrade not answered yet) or
    ``"hello"`` (the upgrade accepted, no welcome yet). ``None`` for a dial that failed otherwise
    (no TCP connection, a certificate or TLS alert refused) and outside a dial.
    """

    dial_stage: str | None = None


class WorkerBusy(OrbitError):
    """32 control requests are already in flight; nothing was sent."""


class WorkerBackpressure(OrbitError):
    """More than 8 assignments were left unread; the connection is closed."""


class CallTimeout(OrbitError, TimeoutError):
    """No answer within the call's bound; the connection is closed so the operation can be
    reconciled by its ``message_id``."""


class ServerUnreachable(OrbitError):
    """A worker given ``first_connect_timeout`` established no session within that many seconds
    of its start (``Worker.run()`` raises it; ``orbit-sync worker`` exits 6). The message names
    the server, the dials that failed and the last failure."""


class FrameError(OrbitError, ValueError):
    """A frame or body could not be decoded or encoded under the protocol's rules."""
