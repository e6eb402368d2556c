"""Pure parts of the worker: outcome rules, TaskContext, reconnect backoff, the daemon pool."""

from __future__ import annotations

import logging
import pickle
import random

import pytest
from _worker_helpers import leased_task

from orbit_sync.models import Outcome, Task, new_id
from orbit_sync.testing import HandlerEnvironment, ManualClock
from orbit_sync.worker import (
    Backoff,
    Fail,
    TaskCancelled,
    TaskContext,
    UnknownEffect,
    Worker,
)
from orbit_sync.worker._context import cancel_context, worker_log
from orbit_sync.worker.core._outcomes import abandoned, not_run, outcome_of


def _task() -> Task:
    return leased_task(attempt=2)


# ----------------------------------------------------------------------------- outcomes


def test_return_value_succeeds() -> None:
    """A returned value is SUCCEEDED with that result; None is sent as {}."""
    v = outcome_of(value={"ok": True})
    assert (v.outcome, v.result, v.error_code, v.retryable) == (
        Outcome.SUCCEEDED,
        {"ok": True},
        None,
        None,
    )
    assert outcome_of(value=None).result == {}


def test_fail_is_failed_with_its_code() -> None:
    """Fail(code, retryable=...) is FAILED with that code, retryable flag and message."""
    v = outcome_of(error=Fail("QUOTA", "try later", retryable=True, details={"n": 1}))
    assert v.outcome is Outcome.FAILED
    assert v.error_code == "QUOTA" and v.retryable is True
    assert v.result == {"error": "QUOTA", "message": "try later", "details": {"n": 1}}


def test_unknown_effect_is_unknown() -> None:
    """UnknownEffect(code) is UNKNOWN with that code and no retryable flag."""
    v = outcome_of(error=UnknownEffect("GATEWAY_TIMEOUT"))
    assert (v.outcome, v.error_code, v.retryable) == (Outcome.UNKNOWN, "GATEWAY_TIMEOUT", None)


def test_cancelled_only_after_a_cancel_request() -> None:
    """Stopping via raise_if_cancelled is CANCELLED only when the server asked for it."""
    stop = TaskCancelled("cancel_requested")
    v = outcome_of(error=stop, cancel_requested=True, cancel_reason="cancel_requested")
    assert (v.outcome, v.error_code) == (Outcome.CANCELLED, "CANCELLED")
    # Shutdown first, cancel request later: the handler did stop after a cancel request.
    v = outcome_of(error=stop, cancel_requested=True, cancel_reason="shutdown")
    assert v.outcome is Outcome.CANCELLED


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        ("shutdown", "WORKER_SHUTDOWN"),
        ("lease_expired", "LEASE_EXPIRED"),
        ("lease_lost", "LEASE_LOST"),
        ("session_replaced", "SESSION_REPLACED"),
    ],
)
def test_cooperative_stop_without_cancel_request(reason: str, code: str) -> None:
    """A clean stop for shutdown or lease loss is a retryable FAILED, never CANCELLED."""
    v = outcome_of(error=TaskCancelled(reason), cancel_reason=reason)
    assert (v.outcome, v.error_code, v.retryable) == (Outcome.FAILED, code, True)


def test_other_exception_is_failed_without_its_message() -> None:
    """Any other exception is FAILED/HANDLER_ERROR; only its type travels, never its text."""
    v = outcome_of(error=ValueError("password=hunter2"))
    assert (v.outcome, v.error_code, v.retryable) == (Outcome.FAILED, "HANDLER_ERROR", False)
    assert v.result == {"error": "HANDLER_ERROR", "exception": "ValueError"}
    assert "hunter2" not in repr(v)
    # A TaskCancelled raised by hand, with no cancellation, is just an error.
    assert outcome_of(error=TaskCancelled("x")).error_code == "HANDLER_ERROR"


@pytest.mark.parametrize(
    ("value", "code"),
    [
        ({"blob": b"x"}, "RESULT_NOT_JSON"),
        ({"x": float("nan")}, "RESULT_NOT_JSON"),
        ({"s": "\ud800"}, "RESULT_NOT_JSON"),
        ({1: "a", "1": "b"}, "RESULT_NOT_JSON"),
        ("x" * (256 * 1024), "RESULT_TOO_LARGE"),
    ],
    ids=["bytes", "nan", "surrogate", "duplicate-key", "too-large"],
)
def test_unsendable_result_is_failed(value: object, code: str) -> None:
    """A result that is not strict JSON or is over 256 KiB becomes FAILED with a stable code."""
    v = outcome_of(value=value)
    assert (v.outcome, v.error_code, v.retryable) == (Outcome.FAILED, code, False)
    assert v.result["error"] == code


def test_unsendable_details_keep_the_outcome() -> None:
    """A Fail/UnknownEffect with unsendable details keeps its outcome and code, minus details."""
    v = outcome_of(error=UnknownEffect("CHARGED", details={"card": b"1234"}))
    assert (v.outcome, v.error_code) == (Outcome.UNKNOWN, "CHARGED")
    assert v.result["result_dropped"] == "RESULT_NOT_JSON"


def test_not_run_and_abandoned() -> None:
    """Started-but-not-run and abandoned-at-shutdown have truthful, stable outcomes."""
    v = not_run(cancel_requested=True, reason="cancel_requested")
    assert (v.outcome, v.ran) == (Outcome.CANCELLED, False)
    v = not_run(cancel_requested=False, reason="shutdown")
    assert (v.outcome, v.error_code, v.retryable) == (Outcome.FAILED, "WORKER_SHUTDOWN", True)
    v = abandoned()
    assert (v.outcome, v.error_code) == (Outcome.UNKNOWN, "SHUTDOWN_TIMEOUT")


def test_fail_validates_and_pickles() -> None:
    """Fail checks its code at raise time and survives pickling."""
    with pytest.raises(ValueError):
        Fail("not a code")
    with pytest.raises(TypeError):
        Fail("CODE", retryable="yes")  # type: ignore[arg-type]
    again = pickle.loads(pickle.dumps(Fail("QUOTA", "m", retryable=True)))
    assert (again.code, again.message, again.retryable) == ("QUOTA", "m", True)
    assert not issubclass(TaskCancelled, Exception), "except Exception must not swallow it"


# ----------------------------------------------------------------------------- context


def test_context_cancel_first_reason_wins() -> None:
    """The first cancel reason sticks; a later cancel request is still recorded."""
    ctx = TaskContext(_task(), new_id())
    assert ctx.cancel_reason is None and not ctx.cancelled.is_set()
    ctx.raise_if_cancelled()
    assert cancel_context(ctx, "shutdown") is True
    assert cancel_context(ctx, "cancel_requested") is False
    assert ctx.cancel_reason == "shutdown" and ctx.cancel_requested
    with pytest.raises(TaskCancelled):
        ctx.raise_if_cancelled()
    with pytest.raises(TaskCancelled):
        ctx.sleep(10)
    with pytest.raises(ValueError):
        cancel_context(ctx, "bored")


def test_context_fields_remaining_and_logger(caplog: pytest.LogCaptureFixture) -> None:
    """The context exposes the task; remaining() follows the deadline; its logger names ids."""
    clock = ManualClock(50.0)
    task = _task()
    attempt_id = new_id()
    ctx = TaskContext(task, attempt_id, deadline=60.0, clock=clock)
    assert (ctx.task_id, ctx.attempt, ctx.max_attempts, ctx.payload, ctx.handler) == (
        task.task_id,
        2,
        3,
        {"w": 1},
        "resize",
    )
    assert ctx.remaining() == 10.0
    clock.advance(20.0)
    assert ctx.remaining() == 0.0
    with caplog.at_level(logging.INFO, logger="orbit_sync"):
        ctx.logger.info("hello")
        worker_log(ctx).info("library line")
    record, library = caplog.records[-2:]
    # The handler's lines go under orbit_sync.task.<handler>, apart from the library's own.
    assert (record.name, library.name) == ("orbit_sync.task.resize", "orbit_sync.worker")
    assert task.task_id in record.getMessage() and attempt_id in record.getMessage()
    assert record.task_id == task.task_id  # type: ignore[attr-defined]
    assert record.attempt_id == attempt_id  # type: ignore[attr-defined]
    assert record.handler == "resize"  # type: ignore[attr-defined]
    assert attempt_id in repr(ctx)


# ----------------------------------------------------------------------------- backoff


def test_backoff_is_exponential_bounded_and_jittered() -> None:
    """Delays double up to the maximum, in [cap/2, cap] (the first in [0, initial]), and vary."""
    b = Backoff(initial=0.1, maximum=2.0)
    assert [b.cap(n) for n in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0]
    assert b.cap(10_000) == 2.0
    rng = random.Random(7)
    delays = [b.delay(3, rng) for _ in range(50)]
    assert all(0.4 <= d <= 0.8 for d in delays)
    assert len(set(delays)) > 1
    # The first reconnect after a welcomed session: full jitter, anywhere in [0, initial].
    first = [b.delay(0, rng) for _ in range(200)]
    assert all(0.0 <= d <= 0.1 for d in first)
    assert min(first) < 0.05 < max(first), "below the equal-jitter floor too"
    with pytest.raises(ValueError):
        Backoff(initial=3.0, maximum=1.0)
    with pytest.raises(ValueError):
        Backoff(initial=0.0)


# ----------------------------------------------------------------------------- pool


# ----------------------------------------------------------------------------- worker API


def test_worker_validates_configuration() -> None:
    """Bad queue ids, capacities, handler names and duplicate handlers are refused up front."""
    client = object()
    with pytest.raises(ValueError):
        Worker(client, queue_id="nope")  # type: ignore[arg-type]
    for capacity in (0, 257):
        with pytest.raises(ValueError):
            Worker(client, queue_id=new_id(), capacity=capacity)  # type: ignore[arg-type]
    worker = Worker(client, queue_id=new_id())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        worker.registration  # noqa: B018 - no handler registered yet

    @worker.handler("resize", version=2)
    def resize(ctx: TaskContext, payload: object) -> object:
        return payload

    with pytest.raises(ValueError):
        worker.register("resize", resize, version="2")
    with pytest.raises(ValueError):
        worker.register("Bad Name", resize)
    reg = worker.registration
    assert [(c.handler, c.handler_version) for c in reg.capabilities] == [("resize", "2")]
    assert reg.cancellation_notifications is True
    assert reg.instance_secret not in repr(reg) and reg.instance_secret not in repr(worker)
    # A worker that never started stops at once, and cannot start afterwards.
    assert worker.stop().drained is True
    with pytest.raises(RuntimeError):
        worker.start()


# ----------------------------------------------------------------------------- environment


def test_handler_environment_runs_handlers_without_a_server() -> None:
    """HandlerEnvironment maps a handler's ending to the verdict the worker would send."""
    env = HandlerEnvironment(handler="resize", attempt=2)

    def resize(ctx: TaskContext, payload: dict[str, int]) -> dict[str, int]:
        ctx.raise_if_cancelled()
        return {"w": payload["w"] * 2, "attempt": ctx.attempt}

    verdict = env.run(resize, {"w": 10})
    assert (verdict.outcome, verdict.result) == (Outcome.SUCCEEDED, {"w": 20, "attempt": 2})
    assert env.context is not None and env.context.remaining() > 29
    env.cancel()
    verdict = env.run(resize, {"w": 10})
    assert (verdict.outcome, verdict.error_code) == (Outcome.CANCELLED, "CANCELLED")
    env.cancel("shutdown")
    assert env.run(resize, {"w": 1}).error_code == "WORKER_SHUTDOWN"
    assert env.run(lambda ctx, p: 1 / 0, {}).result == {
        "error": "HANDLER_ERROR",
        "exception": "ZeroDivisionError",
    }
