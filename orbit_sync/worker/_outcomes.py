"""What a handler's ending becomes on the wire: the worker's outcome rules (the README's
"Outcome rules"), pure functions, no I/O: :func:`outcome_of` maps a finished call to a
:class:`Verdict`, which holds a plain-JSON snapshot of the result (encoded by a
:class:`~._encoding.ResultEncoder` as the verdict is made), never the handler's live object.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..errors import OrbitError
from ..models import CODE_RE, AttemptRef, Finish, Outcome
from ._encoding import DEFAULT_ENCODER, ResultEncoder, ResultProblem, type_name

__all__ = [
    "CANCEL_REASONS",
    "HANDLER_TIMEOUT",
    "WORKER_LOST",
    "Fail",
    "TaskCancelled",
    "TimeLimitExceeded",
    "UnknownEffect",
    "Verdict",
    "not_run",
    "outbox_unavailable",
    "outcome_of",
    "stored",
    "timed_out",
    "worker_error",
    "worker_lost",
]

#: Error codes for a handler that stopped cooperatively for a reason other than a cancel request.
#: The handler chose the checkpoint, so stopping there is clean: FAILED and retryable.
STOP_CODES = {
    "shutdown": "WORKER_SHUTDOWN",
    "lease_expired": "LEASE_EXPIRED",
    "lease_lost": "LEASE_LOST",
    "session_replaced": "SESSION_REPLACED",
}
#: Why a TaskContext was cancelled (the first reason wins).
CANCEL_REASONS = frozenset({*STOP_CODES, "cancel_requested", "time_limit"})

HANDLER_ERROR = "HANDLER_ERROR"
CANCELLED = "CANCELLED"
#: A handler still running after shutdown's grace: its effect is uncertain.
SHUTDOWN_TIMEOUT = "SHUTDOWN_TIMEOUT"
#: A handler ran past its time limit: FAILED once it stopped (or its process was killed);
#: UNKNOWN when its thread still runs after the cancel grace.
HANDLER_TIMEOUT = "HANDLER_TIMEOUT"
#: The durable outbox could not record the launch, so the handler was not run.
OUTBOX_UNAVAILABLE = "OUTBOX_UNAVAILABLE"
#: A step of the worker itself failed (a bug) while the attempt was in its hands.
WORKER_ERROR = "WORKER_ERROR"
#: The outcome code of an attempt whose process stopped while its handler ran.
WORKER_LOST = "WORKER_LOST"

_MAX_MESSAGE = 1024


def _check_code(code: object) -> str:
    if type(code) is not str or not CODE_RE.fullmatch(code):
        raise ValueError("code must be 1-64 characters of [A-Z][A-Z0-9_]*, e.g. 'QUOTA_EXCEEDED'")
    return code


def _short(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."


class Fail(OrbitError):
    """Raise from a handler to finish the attempt ``FAILED`` with a stable *code*.

    ``retryable=True`` asks the server to retry the task while attempts and time remain.
    *message* and *details* (any JSON) travel in the result, so keep secrets out of them.
    """

    __module__ = "orbit_sync.worker"  # where users import it from: tracebacks say so

    def __init__(
        self, code: str, message: str = "", *, retryable: bool = False, details: Any = None
    ) -> None:
        _check_code(code)
        super().__init__(f"{code}: {message}" if message else code)
        if type(retryable) is not bool:
            raise TypeError("retryable must be a bool")
        self.code = code
        self.message = message
        self.retryable = retryable
        self.details = details


class UnknownEffect(OrbitError):
    """Raise from a handler when its effect is uncertain: the attempt finishes ``UNKNOWN``.

    The server retries the task only if its retry policy is ``IDEMPOTENT`` (and it was not
    cancelled and budget remains); otherwise the task goes to ``NEEDS_REVIEW``.
    """

    __module__ = "orbit_sync.worker"  # where users import it from: tracebacks say so

    def __init__(self, code: str, message: str = "", *, details: Any = None) -> None:
        _check_code(code)
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.details = details


class TaskCancelled(BaseException):
    """Raised by ``ctx.raise_if_cancelled()`` once the context is cancelled.

    A ``BaseException`` (like ``asyncio.CancelledError``) so that a handler's broad
    ``except Exception:`` does not swallow the stop by accident.
    """

    __module__ = "orbit_sync.worker"  # where users import it from: tracebacks say so

    def __init__(self, reason: str) -> None:
        super().__init__(f"task cancelled: {reason}")
        self.reason = reason


class TimeLimitExceeded(TaskCancelled):
    """Raised in a handler's thread when it runs past its ``time_limit`` (the worker raises it
    asynchronously, see ``docs/process-executor.md`` and the README for what that can and cannot
    interrupt). Its ``reason`` is ``time_limit``. Catch it only to clean up, then re-raise:
    the attempt finishes ``FAILED`` with ``HANDLER_TIMEOUT``.
    """

    __module__ = "orbit_sync.worker"  # where users import it from: tracebacks say so

    def __init__(self) -> None:
        super().__init__("time_limit")


@attrs.frozen
class Verdict:
    """The finish content decided for one attempt (everything but the AttemptRef)."""

    outcome: Outcome
    result: Any
    error_code: str | None = None
    retryable: bool | None = None
    #: True when the handler ran (False: started on the server, but the handler never ran).
    ran: bool = True
    #: Seconds the handler ran (``None`` when it did not run, or nobody timed it).
    duration: float | None = attrs.field(default=None, eq=False)
    #: Why the handler's result or details could not be sent (logged at ERROR), if so.
    problem: str | None = attrs.field(default=None, eq=False)

    def finish(self, ref: AttemptRef) -> Finish:
        """The ``task.finish`` body for *ref*."""
        return Finish(
            ref=ref,
            outcome=self.outcome,
            result=self.result,
            error_code=self.error_code,
            retryable=self.retryable,
        )


def _failed(result: dict[str, Any], retryable: bool | None, **more: Any) -> Verdict:
    """A ``FAILED`` verdict whose error code is *result*'s ``error``."""
    return Verdict(Outcome.FAILED, result, result["error"], retryable, **more)


def _cancelled(**more: Any) -> Verdict:
    """The verdict of a cancel request honoured (``ran``: whether the handler ran)."""
    result = {"cancelled": True, "reason": "cancel_requested"}
    if more.get("ran") is False:
        result["ran"] = False
    return Verdict(Outcome.CANCELLED, result, CANCELLED, **more)


def outcome_of(
    *,
    value: Any = None,
    error: BaseException | None = None,
    cancel_requested: bool = False,
    cancel_reason: str | None = None,
    encoder: ResultEncoder = DEFAULT_ENCODER,
    duration: float | None = None,
    timeout_retryable: bool = False,
) -> Verdict:
    """Map how a handler ended (its return *value* or raised *error*) to a :class:`Verdict`.

    *cancel_requested* is True when the server asked to cancel this attempt (push or lease);
    *cancel_reason* is the context's cancel reason, if it was cancelled. The result is encoded
    with *encoder* now: the verdict keeps a plain-JSON snapshot of it. *duration* is how long
    the handler ran, in seconds. *timeout_retryable*: whether a handler stopped at its time
    limit is retried.
    """
    if error is None:
        try:
            result = encoder.encode({} if value is None else value)
        except ResultProblem as problem:
            return _failed(problem.as_result(), False, duration=duration, problem=problem.message)
        return Verdict(Outcome.SUCCEEDED, result, duration=duration)
    if isinstance(error, Fail | UnknownEffect):
        code = error.code
        outcome, retryable = Outcome.UNKNOWN, None
        if isinstance(error, Fail):
            outcome, retryable = Outcome.FAILED, error.retryable
        raw: dict[str, Any] = {"error": code}
        if error.message:
            raw["message"] = _short(error.message)
        if error.details is not None:
            raw["details"] = error.details
        try:
            return Verdict(outcome, encoder.encode(raw), code, retryable, duration=duration)
        except ResultProblem as problem:
            # The handler chose the outcome; only its details cannot travel: they are dropped.
            result = {"error": code, "result_dropped": problem.code, "message": problem.message}
            return Verdict(
                outcome, result, code, retryable, duration=duration, problem=problem.message
            )
    if isinstance(error, TaskCancelled) and cancel_reason is not None:
        if cancel_requested:
            return _cancelled(duration=duration)
        if isinstance(error, TimeLimitExceeded) or cancel_reason == "time_limit":
            timeout = {"error": HANDLER_TIMEOUT, "stopped": "time_limit"}
            return _failed(timeout, timeout_retryable, duration=duration)
        code = STOP_CODES.get(cancel_reason, HANDLER_ERROR)
        return _failed({"error": code, "stopped": cancel_reason}, True, duration=duration)
    # Only the exception's type travels: its message may quote data or credentials.
    raised = {"error": HANDLER_ERROR, "exception": type_name(error)}
    return _failed(raised, False, duration=duration)


def outbox_unavailable() -> Verdict:
    """The finish for an attempt not run because its launch could not be recorded: nothing
    happened, so it is a retryable ``FAILED``."""
    return _failed({"error": OUTBOX_UNAVAILABLE, "ran": False}, True, ran=False)


def not_run(*, cancel_requested: bool, reason: str | None) -> Verdict:
    """The finish for an attempt the server started but whose handler never ran.

    Truthful and clean: nothing happened, so a cancel is ``CANCELLED`` and anything else is a
    retryable ``FAILED``.
    """
    if cancel_requested:
        return _cancelled(ran=False)
    code = STOP_CODES.get(reason or "lease_expired", "LEASE_EXPIRED")
    return _failed({"error": code, "ran": False}, True, ran=False)


def _unknown(code: str, message: str) -> Verdict:
    """An ``UNKNOWN`` finish with its error *code*: whether the handler's effect happened is not
    known (the server keeps the attempt for review or retries it per its policy)."""
    return Verdict(Outcome.UNKNOWN, {"error": code, "message": message}, code)


def abandoned() -> Verdict:
    """The finish for a handler that did not return by the end of shutdown's grace."""
    return _unknown(SHUTDOWN_TIMEOUT, "handler still running at shutdown")


def timed_out() -> Verdict:
    """The finish for a handler on a thread still running past its time limit and the cancel
    grace: it could not be stopped, so whether (and when) its effect happens is not known."""
    return _unknown(HANDLER_TIMEOUT, "handler still running past its time limit")


def worker_error() -> Verdict:
    """The finish for an attempt whose processing hit an unexpected error in the worker: whether
    the handler's effect happened is not known, so it is ``UNKNOWN``, never dropped."""
    return _unknown(WORKER_ERROR, "the worker failed while processing the attempt")


def worker_lost() -> Verdict:
    """The finish the outbox replay sends for an attempt a dead process launched and never
    finished: whether its effect happened is not known."""
    return _unknown(WORKER_LOST, "the worker process stopped while the handler ran")


def stored(finish: Finish) -> Verdict:
    """The verdict a finish stored in the outbox carries (its result as it was sent)."""
    return Verdict(finish.outcome, finish.result, finish.error_code, finish.retryable)
