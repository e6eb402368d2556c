"""What an attempt's machine works with (:mod:`._machine`): the requests it sends, what the shell
knows of a lease when it asks, the watchdog's report of a renewal, and the actions it returns
for the shell to perform, each named by its class in the table (:mod:`._table`)."""

from __future__ import annotations

import attrs

from ...errors import OrbitError
from ...models import AttemptRef, CommandResult, Finish, Lease
from ._outcomes import Verdict

__all__ = [
    "Action",
    "BreakConnection",
    "CancelContext",
    "Ended",
    "HandlerOutcome",
    "InterruptHandler",
    "Keep",
    "LeaseLost",
    "LeaseRenewed",
    "LeaseView",
    "NotStarted",
    "RecordFinish",
    "RefreshLease",
    "Release",
    "RenewAfter",
    "RenewAnswer",
    "Reported",
    "Request",
    "ResumeEnded",
    "RunHandler",
    "Send",
    "Skipped",
    "SlotFreed",
    "SlotStuck",
    "TrackLease",
    "UntrackLease",
]


@attrs.frozen(eq=False)
class Request:
    """A start, resume or finish, with the ``message_id`` every send of it carries."""

    request_type: str
    body: AttemptRef | Finish
    message_id: str

    @property
    def early(self) -> bool:
        """A resume: it may go out on a connection not yet published (publishing waits for it)."""
        return self.request_type == "worker.resume"


@attrs.frozen
class LeaseView:
    """The lease as the shell knows it when a live resume's outcome arrives: the clock's time,
    the seconds left before the local deadline, whether the handler's context is cancelled."""

    now: float
    remaining: float
    cancelled: bool


@attrs.frozen
class RenewAnswer:
    """What became of a renewal, as the lease watchdog reports it: the server's *lease*, or the
    *error* it failed with, or neither (the local deadline passed first). *behind_resume*: it
    went out right behind a new connection's resumes, so a loss answering it is the resume's.
    *lag*: how late the watchdog sent it."""

    lease: Lease | None = None
    error: BaseException | None = None
    behind_resume: bool = False
    lag: float = 0.0


# ---------------------------------------------------------------------------------- actions


@attrs.frozen
class Action:
    """Something the shell is to do for the attempt; the table names each by its class."""


@attrs.frozen
class Send(Action):
    """Send *request* on the current connection (pipelined; its answer comes back as an event)."""

    request: Request


@attrs.frozen
class BreakConnection(Action):
    """Close connection *gen*, so the session reconnects at once (0: there was none)."""

    gen: int


@attrs.frozen
class Keep(Action):
    """Keep *request*; send it again on the first connection newer than *newer_than*, after
    *delay* seconds (*error*: the transient answer that delays it)."""

    request: Request
    newer_than: int = 0
    delay: float = 0.0
    error: OrbitError | None = None


@attrs.frozen
class TrackLease(Action):
    """Renew the lease (just granted, until *deadline*) from now on."""

    deadline: float


@attrs.frozen
class RefreshLease(Action):
    """The lease survived a reconnect: watch *deadline*."""

    deadline: float


@attrs.frozen
class UntrackLease(Action):
    """Stop renewing the lease."""


@attrs.frozen
class CancelContext(Action):
    """Cancel the handler's context with *reason*."""

    reason: str


@attrs.frozen
class LeaseLost(Action):
    """The lease is gone (*detail*: the server's error code): count it, say so, tell the
    listeners. *resume*: a reconnect's resume found it lost (else a renewal or the deadline)."""

    reason: str
    resume: bool = True
    detail: str = ""


@attrs.frozen
class LeaseRenewed(Action):
    """Tell the listeners that a renewal was granted (*lag*: how late it went out)."""

    lag: float


@attrs.frozen
class RenewAfter(Action):
    """Renew again, same ``message_id``, after *delay* seconds (or at the deadline if sooner)."""

    delay: float
    error: BaseException


@attrs.frozen
class InterruptHandler(Action):
    """Raise ``TimeLimitExceeded`` in the handler's thread; step
    :meth:`AttemptMachine.time_limit_grace_passed` *grace* seconds from now."""

    grace: float


@attrs.frozen
class SlotStuck(Action):
    """Finished while its handler still runs past the cancel grace of *reason*: its thread
    holds a slot until it returns, if it ever does."""

    reason: str


@attrs.frozen
class SlotFreed(Action):
    """A stuck handler returned at last: its slot is free (its result is dropped)."""


@attrs.frozen
class RunHandler(Action):
    """Record the launch (outbox) and run the handler on a pool thread."""


@attrs.frozen
class HandlerOutcome(Action):
    """Say how the handler ended: the *verdict* the outcome rules gave it, and the exception it
    raised (*error*), whose traceback stays in the worker's log."""

    verdict: Verdict
    error: BaseException | None = None


@attrs.frozen
class RecordFinish(Action):
    """Commit the finish to the outbox before it is sent."""

    request: Request


@attrs.frozen
class NotStarted(Action):
    """The handler will not run and there is nothing to finish: say why."""

    why: str
    error: OrbitError | None = None


@attrs.frozen
class Reported(Action):
    """The finish's fate: *result* (accepted), *error* (refused), or neither (unreported)."""

    verdict: Verdict
    result: CommandResult | None = None
    error: OrbitError | None = None

    @property
    def delivered(self) -> bool:
        return self.result is not None


@attrs.frozen
class Ended(Action):
    """Replay: the server already ended the attempt and nothing was stored to send: drop its
    record (reporting it lost would only contradict what the server knows)."""

    why: str


@attrs.frozen
class ResumeEnded(Action):
    """The live resume *request* is over, for the connection waiting for its resumes;
    *refused*: the server's refusal; *cut*: its connection failed first."""

    request: Request
    refused: OrbitError | None = None
    cut: bool = False


@attrs.frozen
class Release(Action):
    """The worker is done with the attempt."""


@attrs.frozen
class Skipped(Action):
    """The assignment is not taken (*why*); *count*: the counter it adds to, if any."""

    why: str
    count: str | None = None
