"""The one request path of the attempts' machines, the live :class:`~._shell.AttemptShell`'s
and the outbox replay's :class:`~._replay.ReplayShell`'s (docs/architecture.md, ``_requests``);
a failed request is re-sent with its ``message_id``, and nothing is sent from a connection's
reader.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from .._protocol import Done
from ..connection import on_reader_thread, pipeline_of
from ..errors import OrbitError
from ._errors import NotConnected
from ._link import Connection, GaveUp, Link
from ._machine import (
    Action,
    AttemptMachine,
    BreakConnection,
    Event,
    Keep,
    Request,
    Send,
    answered,
    failed,
)
from ._options import WorkerOptions

__all__ = ["Event", "RequestPath"]


class _Subject(Protocol):
    @property
    def machine(self) -> AttemptMachine: ...


S = TypeVar("S", bound=_Subject)


class RequestPath(Generic[S]):
    """Sends the requests of the machines of *S* (one attempt each) on *link*, with the worker's
    *options* (its call timeout and logger)."""

    def __init__(
        self,
        link: Link,
        options: WorkerOptions,
        wake: Callable[[], None],
        early_sent: Callable[[Request], None] = lambda request: None,
    ) -> None:
        self._link = link
        #: Told that a live resume went out, or was refused before the wire (the connection
        #: thread publishes a new connection once every one did).
        self._early_sent = early_sent
        self.options = options
        self._call_timeout = options.request_timeout
        self._log = options.logger
        #: Wakes the thread that drives the link (a request was kept for it to re-send).
        self._wake = wake

    def step(self, subject: S, event: Event) -> None:
        """Feed *event* to *subject*'s machine and perform the actions it returns."""
        raise NotImplementedError

    def outcome(self, subject: S, request: Request, event: Event) -> None:
        """Feed *event*, an outcome of *request* (answer, failure, given up), to *subject*'s
        machine; a driver may hand some to another thread."""
        self.step(subject, event)

    def failure(self, subject: S, request: Request, error: OrbitError, gen: int) -> Event:
        """The event *request*'s failure on connection *gen* (0: none) is to its machine."""
        return failed(request, error, gen)

    def answer(self, subject: S, request: Request, value: Any) -> Event:
        """The event *request*'s answer *value* is to its machine (a start's needs the
        attempt's context: the live shell says how)."""
        return answered(request, value)

    def perform_request(self, subject: S, action: Action) -> bool:
        """Perform *action* if it is about a request (send, keep, break); False if not."""
        if isinstance(action, Send):
            self._send(subject, action.request)
        elif isinstance(action, Keep):
            self._keep(subject, action)
        elif isinstance(action, BreakConnection):
            if action.gen:  # 0: nothing was sent, there is no connection to break
                self._link.broken(action.gen)
        else:
            return False
        return True

    def _send(self, subject: S, request: Request) -> None:
        """Send *request* within the link's request slots, or queue it for the next free slot:
        no thread waits for one (the intake, which sends the starts, must keep taking
        assignments while the reader waits for room on their queue). A send decided on a
        reader goes to another thread."""
        if on_reader_thread():
            self.handoff(partial(self._send, subject, request))
            return
        try:
            if not self._link.gate.acquire_or_queue(partial(self._transmit, subject, request)):
                return  # a freed slot sends it
        except GaveUp:
            self.outcome(subject, request, partial(AttemptMachine.gave_up, request=request))
            return
        self._transmit(subject, request)

    def _free_slot(self) -> None:
        """Give a request slot back; a request queued for one goes now (from another thread
        when this is a reader)."""
        job = self._link.gate.release()
        if job is not None:
            if on_reader_thread():
                self.handoff(job)
            else:
                job()

    def _transmit(self, subject: S, request: Request) -> None:
        """Send *request*, whose request slot is taken, on the current connection."""
        current = self._link.current(early=request.early)
        conn, gen = (None, 0) if current is None else current
        try:
            if conn is None:
                raise NotConnected("no connection")
            self.write(subject, request, conn, partial(self._answered, subject, request, gen))
        except OrbitError as exc:  # nothing was sent: no connection, it ended, or it is busy
            self._free_slot()  # a request queued for the slot goes now
            if request.early:
                self._early_sent(request)
            self.outcome(subject, request, self.failure(subject, request, exc, gen))
            return
        except BaseException:
            self._free_slot()
            raise
        if request.early:
            self._early_sent(request)

    def write(self, subject: S, request: Request, conn: Connection, on_done: Done) -> None:
        """Write *request* on *conn*, pipelined (raise if nothing was sent); a driver may send
        something ahead of it."""
        pipeline_of(conn).submit(
            request.request_type,
            request.body,
            on_done,
            message_id=request.message_id,
            timeout=self._call_timeout,
        )

    def _answered(
        self, subject: S, request: Request, gen: int, value: Any, error: OrbitError | None
    ) -> None:
        # On the reader thread (or the thread that ended the connection): never blocks.
        self._free_slot()  # a request queued for the slot goes now
        if error is not None:
            self.outcome(subject, request, self.failure(subject, request, error, gen))
        else:
            self.outcome(subject, request, self.answer(subject, request, value))

    def _keep(self, subject: S, kept: Keep) -> None:
        """Keep the request for the link's driver to re-send (same message_id)."""
        request, error = kept.request, kept.error
        if error is not None:
            self._log.info(
                "request answered %s; retrying", getattr(error, "code", type(error).__name__)
            )
        job = partial(self.step, subject, partial(AttemptMachine.resend, request=request))
        if self._link.keep(job, newer_than=kept.newer_than, delay=kept.delay, early=request.early):
            self._wake()
        else:
            self.outcome(subject, request, partial(AttemptMachine.gave_up, request=request))

    def handoff(self, job: Callable[[], None]) -> None:
        """Run *job*, a send decided on a connection's reader, on the thread that drives the
        link (a pool thread may never come free: each may hold a handler that waits); at once if
        the link is closed (the job then finds no connection and writes nothing)."""
        if self._link.keep(job, early=True):
            self._wake()
        else:
            job()

    def resend_due(self) -> float:
        """Re-send the kept requests whose connection and time have come (the link's driver);
        return when the next one is due."""
        jobs, next_at = self._link.take_due()
        for job in jobs:
            job()
        return next_at
