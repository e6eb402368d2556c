"""The renewal adapter: how the lease watchdog's renewals reach the current connection.

The watchdog (:mod:`._watchdog`) decides when to renew; this sends its batches pipelined on the
link's current connection (one socket write) and reports a lost connection to the link. Every
callback here runs on the watchdog's thread or the connection's reader thread and never blocks.
What an answer means for the attempt is its machine's (:meth:`~._shell.AttemptShell.lease_ended`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..connection import Submission
from ..errors import OrbitError, WorkerError
from ._errors import NotConnected, is_link_failure
from ._link import Link
from ._shell import Registry
from ._watchdog import RenewDone

__all__ = ["Renewals"]


class Renewals:
    """The watchdog's send functions for one worker."""

    def __init__(self, registry: Registry, link: Link, call_timeout: float) -> None:
        self._reg = registry
        self._link = link
        self._call_timeout = call_timeout

    def send_renew(self, attempt_id: str, message_id: str, on_done: RenewDone) -> None:
        """The watchdog's send function: one pipelined renew (see :meth:`send_renews`)."""
        self.send_renews([(attempt_id, message_id, on_done)])

    def send_renews(self, renewals: Sequence[tuple[str, str, RenewDone]]) -> None:
        """The watchdog's batch send: every renew in one write on the current connection; each
        answer (or failure) comes back through its own *on_done*, on the connection's reader
        thread. Renewals that cannot be sent are told so after the write: nothing on the way to
        it may release the GIL (a log line in a callback could)."""
        with self._reg.cond:
            atts = [self._reg.attempts.get(attempt_id) for attempt_id, _, _ in renewals]
        current = self._link.current()
        refused: list[tuple[RenewDone, OrbitError]] = []
        requests: list[Submission] = []
        for (_, message_id, on_done), att in zip(renewals, atts, strict=True):
            if att is None:
                refused.append((on_done, NotConnected("attempt is no longer tracked")))
            elif current is None:
                refused.append((on_done, NotConnected("no connection")))
            else:
                # A slow answer closes its connection before the lease runs out (and is re-sent).
                timeout = min(self._call_timeout, max(1.0, att.ctx.remaining() / 2))
                done = self._renew_done(on_done, current[1])
                requests.append(Submission("task.renew", att.ref, done, message_id, timeout))
        if requests:
            assert current is not None
            try:
                current[0]._submit_many(requests)
            except OrbitError as exc:  # nothing was sent
                for request in requests:
                    request.on_done(None, exc)
        for on_done, error in refused:
            on_done(None, error)

    def _renew_done(self, on_done: RenewDone, gen: int) -> Callable[[Any, OrbitError | None], None]:
        def done(result: Any, error: OrbitError | None) -> None:
            if error is None:
                on_done(result.lease, None)
                return
            if is_link_failure(error) and not isinstance(error, WorkerError):
                # (A fatal error answer ends the connection by itself, with that error.)
                self._link.broken(gen)
            on_done(None, error)

        return done
