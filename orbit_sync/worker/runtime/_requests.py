"""The one call-with-retry of the attempts' requests, for the live
:class:`~._shell.AttemptShell` and the outbox replay's :class:`~._replay.ReplayShell`
(docs/architecture.md, ``_requests``). A start or finish is a blocking call on the thread that
holds the attempt (:meth:`Caller.call`); a kept failure waits there to be re-sent with the same
``message_id`` (:meth:`Caller.wait_to_resend`); a send decided on a thread that must not wait
goes to a sender thread (:meth:`Caller.elsewhere`). It calls nothing of the shells.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from ...errors import OrbitError
from .._options import WorkerOptions
from ..core._errors import NotConnected
from ..core._machine import Keep, Request
from ._link import GaveUp, Link

__all__ = ["CallOutcome", "Caller", "may_wait", "waiting_thread"]

#: Per thread: may it wait for its requests' answers?
_THREAD = threading.local()

#: The connection's blocking call of each request type the machines send.
_CALLS: dict[str, str] = {
    "task.start": "start",
    "task.finish": "finish",
    "worker.resume": "resume",
}


def may_wait() -> bool:
    """May the calling thread wait for its attempts' requests (handler, sender, replay)?"""
    return getattr(_THREAD, "caller", False)


def waiting_thread() -> None:
    """Mark the calling thread as one that makes its attempts' calls and waits for them."""
    _THREAD.caller = True


class CallOutcome(NamedTuple):
    """What became of one call: its answer *value*, or its *error* on connection *gen* (0: there
    was none); *gave_up*: the link closed before a request slot was free."""

    value: Any = None
    error: OrbitError | None = None
    gen: int = 0
    gave_up: bool = False


class Caller:
    """Makes the attempts' calls on *link*, with the worker's call timeout and logger."""

    def __init__(self, link: Link, options: WorkerOptions) -> None:
        self.link = link
        self._call_timeout = options.request_timeout
        self._log = options.logger

    def call(self, request: Request) -> CallOutcome:
        """*request* on the current connection, within the link's request slots."""
        gate = self.link.gate
        try:
            gate.acquire()
        except GaveUp:
            return CallOutcome(gave_up=True)
        try:
            current = self.link.current(early=request.early)
            if current is None:
                return CallOutcome(error=NotConnected("no connection"))
            conn, gen = current
            try:
                value = getattr(conn, _CALLS[request.request_type])(
                    request.body, message_id=request.message_id, timeout=self._call_timeout
                )
            except OrbitError as exc:
                return CallOutcome(error=exc, gen=gen)
            return CallOutcome(value, gen=gen)
        finally:
            gate.release()

    def wait_to_resend(self, kept: Keep) -> bool:
        """Wait until *kept*'s request may go out again (a newer connection whose resumes went
        out, its retry delay passed); False once the link is closed."""
        error = kept.error
        if error is not None:
            self._log.info(
                "request answered %s; retrying", getattr(error, "code", type(error).__name__)
            )
        return self.link.wait_for(newer_than=kept.newer_than, delay=kept.delay)

    def elsewhere(self, job: Callable[[], None]) -> None:
        """Run *job* on a new sender thread (rare: a finish decided at a time limit's grace or
        at shutdown, a bug's recovery)."""

        def send() -> None:
            waiting_thread()
            try:
                job()
            except Exception:  # a bug of ours: logged, never silent
                self._log.exception("worker error while sending a request")

        threading.Thread(target=send, name="orbit-worker-send", daemon=True).start()
