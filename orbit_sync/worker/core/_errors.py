"""How the worker classifies connection errors: retry later, or the lease is gone."""

from __future__ import annotations

import math
from collections.abc import Callable

from ...errors import (
    AUTH_CODES,
    TRANSIENT_CODES,
    CallTimeout,
    HTTPError,
    OrbitError,
    ServerUnreachable,
    WorkerBackpressure,
    WorkerBusy,
    WorkerClosed,
    WorkerDisconnected,
    WorkerError,
    WorkerProtocolError,
)

__all__ = [
    "FirstContact",
    "NotConnected",
    "is_fatal_dial_error",
    "is_link_failure",
    "is_transient",
]


class NotConnected(OrbitError):
    """The worker has no usable connection right now; nothing was sent. A link failure: the
    request waits for the next connection published, not for a retry delay (an assignment can
    arrive while its connection is still being reconciled, and a worker's clock may stand
    still until then)."""


#: Errors after which the connection they happened on is unusable (or there was none).
_LINK_ERRORS = (
    NotConnected,
    WorkerDisconnected,
    CallTimeout,
    WorkerClosed,
    WorkerProtocolError,
    WorkerBackpressure,
)


def is_link_failure(exc: BaseException) -> bool:
    """True when *exc* means the connection is gone (re-send on the next one). ``STALE_SESSION``
    only means the connection it was sent on is dead: the operation is re-sent after the
    reconnect."""
    if isinstance(exc, _LINK_ERRORS):
        return True
    return isinstance(exc, WorkerError) and exc.code == "STALE_SESSION"


def is_transient(exc: BaseException) -> bool:
    """True when the same operation may succeed if tried again later (a link failure: on the
    next connection)."""
    if isinstance(exc, WorkerError) and exc.code in TRANSIENT_CODES:
        return True
    return isinstance(exc, WorkerBusy) or is_link_failure(exc)


def is_fatal_dial_error(exc: BaseException, *, stored_identity: bool = False) -> bool:
    """True when reconnecting cannot help: bad credentials or missing permissions; with
    *stored_identity* (an outbox replay speaking as an earlier process) also an identity the
    server refuses (``STATE_CONFLICT``): no later try can make it acceptable."""
    if isinstance(exc, HTTPError):
        return exc.status_code in (401, 403)
    if isinstance(exc, WorkerError):
        return exc.code in AUTH_CODES or (stored_identity and exc.code == "STATE_CONFLICT")
    return False


class FirstContact:
    """Whether the worker has reached its server since it started, and when to give up on one
    never reached: most likely a misconfiguration (a mistyped host, a missing route), unlike a
    server that went away, which is retried for ever. With *timeout*: once it has passed
    (:meth:`failed`). And a URL that has never been a ``pulse.worker.v1`` endpoint
    (:meth:`wrong_endpoint`): a 404 on the upgrade can be transient (an ingress during a
    deploy), but when every dial is answered so for *window* seconds (and *dials* times), the
    URL is wrong."""

    def __init__(
        self,
        clock: Callable[[], float],
        timeout: float | None,
        *,
        window: float = 60.0,
        dials: int = 3,
    ) -> None:
        self._clock = clock
        self._timeout = timeout
        self._window = window
        self._dials = dials
        self._started = clock()
        #: A welcome arrived since the start.
        self.reached = False
        #: Dials that failed before the first welcome.
        self.failures = 0
        #: Since when, and how many dials in a row, were answered "no endpoint here".
        self._wrong_since: float | None = None
        self._wrong_count = 0

    def connected(self) -> None:
        """A welcome arrived: the server is reachable."""
        self.reached = True

    def waited(self) -> float:
        """Seconds since the start."""
        return self._clock() - self._started

    def remaining(self) -> float:
        """Seconds left before giving up (infinite without a timeout, or once reached)."""
        if self._timeout is None or self.reached:
            return math.inf
        return max(0.0, self._timeout - self.waited())

    def failed(self, exc: BaseException, server: str) -> ServerUnreachable | None:
        """Count a dial that failed before the first welcome; the error to stop on, or None."""
        self.failures += 1
        if self._timeout is None or self.waited() < self._timeout:
            return None
        return ServerUnreachable(
            f"{server} was not reached within {self._timeout:g} s of the start ({self.failures}"
            f" dials failed, the last: {type(exc).__name__}: {exc}); check the URL, DNS, the"
            " network and that the server is up"
        )

    def wrong_endpoint(self, exc: BaseException, server: str) -> HTTPError | None:
        """Record a failed dial; the error to stop on if the URL is wrong, or None to retry."""
        # Upgrade answers that say "no pulse.worker.v1 endpoint here" (wrong path, a plain web
        # server, a redirect, a refused subprotocol), unlike 401/403 (credentials) and
        # 408/429/5xx (busy). Once the worker has connected, such answers are retried for ever.
        code = exc.status_code if isinstance(exc, HTTPError) else None
        if code is None or code in (401, 403, 408, 429) or code >= 500 or self.reached:
            self._wrong_since, self._wrong_count = None, 0
            return None
        now = self._clock()
        if self._wrong_since is None:
            self._wrong_since = now
        self._wrong_count += 1
        if self._wrong_count < self._dials or now - self._wrong_since < self._window:
            return None
        return HTTPError(
            code,
            f"{server} is not a pulse.worker.v1 endpoint: every dial for"
            f" {now - self._wrong_since:.0f} s ({self._wrong_count} dials) was answered HTTP"
            f" {code}; check the URL and its path",
        )
