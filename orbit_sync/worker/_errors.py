"""How the worker classifies connection errors: retry later, or the lease is gone."""

from __future__ import annotations

from ..errors import (
    AUTH_CODES,
    TRANSIENT_CODES,
    CallTimeout,
    HTTPError,
    OrbitError,
    WorkerBackpressure,
    WorkerBusy,
    WorkerClosed,
    WorkerDisconnected,
    WorkerError,
    WorkerProtocolError,
)

__all__ = ["NotConnected", "is_fatal_dial_error", "is_link_failure", "is_transient"]


class NotConnected(OrbitError):
    """The worker has no usable connection right now; nothing was sent."""


#: Server error codes after which the same operation may succeed later. ``STALE_SESSION`` only
#: means the connection it was sent on is dead: the operation is re-sent after the reconnect.
RETRY_CODES = TRANSIENT_CODES | {"STALE_SESSION"}

#: Errors after which the connection they happened on is unusable.
_LINK_ERRORS = (
    WorkerDisconnected,
    CallTimeout,
    WorkerClosed,
    WorkerProtocolError,
    WorkerBackpressure,
)


def is_link_failure(exc: BaseException) -> bool:
    """True when *exc* means the connection is gone (re-send on the next one)."""
    if isinstance(exc, _LINK_ERRORS):
        return True
    return isinstance(exc, WorkerError) and exc.code == "STALE_SESSION"


def is_transient(exc: BaseException) -> bool:
    """True when the same operation may succeed if tried again later."""
    if isinstance(exc, WorkerError):
        return exc.code in RETRY_CODES
    return isinstance(exc, WorkerBusy | NotConnected) or is_link_failure(exc)


def is_fatal_dial_error(exc: BaseException) -> bool:
    """True when reconnecting cannot help: bad credentials or missing permissions."""
    if isinstance(exc, HTTPError):
        return exc.status_code in (401, 403)
    if isinstance(exc, WorkerError):
        return exc.code in AUTH_CODES
    return False
