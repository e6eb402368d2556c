"""Lease renewals on the wire for the watchdog's thread: the renewals due go out in one write, each
in its own slot, and each answer wakes the thread, which tells it to the watchdog
(:meth:`Renewals.answered`): it never blocks on an answer while a deadline falls due."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ...connection import BatchCall, PendingCall
from ...errors import OrbitError
from ..core._errors import NotConnected
from ._link import Link, Wakeup
from ._registry import Registry
from ._watchdog import RenewDone

__all__ = ["Renewals"]


class Renewals:
    """Sends the watchdog's renewals of *registry*'s attempts on *link*'s current connection, each
    bounded by *request_timeout*; *waker* wakes the watchdog's thread."""

    def __init__(
        self,
        registry: Registry,
        link: Link,
        request_timeout: float,
        waker: Wakeup | threading.Event,
    ) -> None:
        self._registry = registry
        self._link = link
        self._request_timeout = request_timeout
        self._waker = waker
        #: Renewals sent and not told yet (the watchdog thread's alone).
        self._renewing: list[tuple[RenewDone, PendingCall]] = []

    def send(self, renewals: Sequence[tuple[str, str, RenewDone]]) -> None:
        """The watchdog's batch in one write; those that cannot be sent are told so after it
        (nothing before the write may release the GIL)."""
        with self._registry.lock:
            atts = [self._registry.attempts.get(attempt_id) for attempt_id, _, _ in renewals]
        current = self._link.current()
        refused: list[tuple[RenewDone, OrbitError]] = []
        calls: list[BatchCall] = []
        dones: list[RenewDone] = []
        for (_, message_id, on_done), att in zip(renewals, atts, strict=True):
            if att is None:
                refused.append((on_done, NotConnected("attempt is no longer tracked")))
            elif current is None:
                refused.append((on_done, NotConnected("no connection")))
            else:
                # A slow answer closes its connection before the lease runs out (and is re-sent).
                timeout = min(self._request_timeout, max(1.0, att.ctx.remaining() / 2))
                calls.append(BatchCall("task.renew", att.ref, message_id, timeout))
                dones.append(on_done)
        if calls:
            assert current is not None
            try:
                pending = current[0].send_many(calls, wake=self._waker)
            except OrbitError as exc:  # nothing was sent
                refused.extend((on_done, exc) for on_done in dones)
            else:
                self._renewing.extend(zip(dones, pending, strict=True))
        for on_done, reason in refused:
            on_done(None, reason)
        self.answered()  # those refused before the wire

    def answered(self) -> None:
        """Tell each renewal answered (or failed) since its *on_done* (the watchdog's thread)."""
        done = [item for item in self._renewing if item[1].done()]
        if not done:
            return
        self._renewing = [item for item in self._renewing if item not in done]
        for on_done, call in done:
            try:
                result = call.result()
            except OrbitError as exc:
                on_done(None, exc)
            else:
                on_done(result.lease, None)
