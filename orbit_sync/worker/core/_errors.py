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
    """No usable connection right now; nothing was sent. A link failure: the request waits for
    the next connection published, not a retry delay (the clock may stand still until then)."""


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
    """True when *exc* means the connection is gone (``STALE_SESSION`` too): re-send on the next."""
    if isinstance(exc, _LINK_ERRORS):
        return True
    return isinstance(exc, WorkerError) and exc.code == "STALE_SESSION"


def is_transient(exc: BaseException) -> bool:
    """True when the same operation may succeed later (a link failure: on the next connection)."""
    if isinstance(exc, WorkerError) and exc.code in TRANSIENT_CODES:
        return True
    return isinstance(exc, WorkerBusy) or is_link_failure(exc)


def is_fatal_dial_error(exc: BaseException, *, stored_identity: bool = False) -> bool:
    """True when reconnecting cannot help: bad credentials or permissions; with
    *stored_identity* (a replay as an earlier process) also a refused identity (STATE_CONFLICT)."""
    if isinstance(exc, HTTPError):
        return exc.status_code in (401, 403)
    if isinstance(exc, WorkerError):
        return exc.code in AUTH_CODES or (stored_identity and exc.code == "STATE_CONFLICT")
    return False


class FirstContact:
    """Whether the server was reached since the start, and when to give up on one never
    reached (likely a misconfiguration; a server that went away is retried for ever): past
    *timeout* (:meth:`failed`), or when every dial for *window* s (and *dials* times) says the
    URL is no ``pulse.worker.v1`` endpoint (:meth:`wrong_endpoint`; one 404 may be a deploy)."""

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
        self.reached = False  # a welcome arrived
        self.failures = 0  # dials failed before the first welcome
        #: Since when, and how many dials in a row, were answered "no endpoint here".
        self._wrong_since: float | None = None
        self._wrong_count = 0

    def connected(self) -> None:
        self.reached = True

    def waited(self) -> float:
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
