"""Registration mistakes raise TypeError at once, not HANDLER_ERROR at run time."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from orbit_sync.client import Client
from orbit_sync.worker import TaskContext, Worker

QUEUE = "0" * 32


def _worker() -> Worker:
    # Never started: registration needs no server.
    return Worker(Client("ws://127.0.0.1:9/", "t" * 32), queue_id=QUEUE, handle_signals=False)


def test_bare_decorator_raises() -> None:
    """``@worker.handler`` without parentheses raises instead of registering nothing."""
    worker = _worker()
    with pytest.raises(TypeError, match=r'@worker.handler\("name"\)'):

        @worker.handler  # type: ignore[arg-type]
        def resize(ctx: TaskContext, payload: Any) -> Any:
            return {}

    with pytest.raises(ValueError, match="register at least one handler"):
        _ = worker.registration


async def _async_handler(ctx: TaskContext, payload: Any) -> Any:
    return {}


class _AsyncCallable:
    async def __call__(self, ctx: TaskContext, payload: Any) -> Any:
        return {}


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda: {}, "cannot be called as fn"),
        (lambda ctx: {}, "cannot be called as fn"),
        (lambda ctx, payload, extra: {}, "cannot be called as fn"),
        (lambda *, ctx, payload: {}, "cannot be called as fn"),
        (_async_handler, "not async def"),
        (_AsyncCallable(), "not async def"),
        ("resize", "must be callable"),
    ],
    ids=["no-args", "one-arg", "three-args", "keyword-only", "async", "async-callable", "str"],
)
def test_unusable_signature_raises(fn: Any, match: str) -> None:
    """A handler that cannot take ``(ctx, payload)`` is refused when registered."""
    worker = _worker()
    with pytest.raises(TypeError, match=match):
        worker.register("resize", fn)
    with pytest.raises(TypeError, match=match):
        worker.handler("resize")(fn)


class _Callable:
    def __call__(self, ctx: TaskContext, payload: Any) -> Any:
        return {}


def _three(ctx: TaskContext, payload: Any, scale: int) -> Any:
    return {"scale": scale}


@pytest.mark.parametrize(
    "fn",
    [
        lambda ctx, payload: {},
        lambda ctx, payload, extra=1: {},
        lambda *args: {},
        lambda ctx, *rest, **kw: {},
        _Callable(),
        functools.partial(_three, scale=2),
        print,  # a builtin: checked as far as its signature allows
    ],
    ids=["plain", "default", "varargs", "rest", "callable", "partial", "builtin"],
)
def test_usable_signatures_are_accepted(fn: Any) -> None:
    """Anything callable as ``fn(ctx, payload)`` registers."""
    worker = _worker()
    worker.register("resize", fn)
    assert [c.handler for c in worker.registration.capabilities] == ["resize"]


def test_time_limits_shows_each_handlers_limit_its_own_or_the_workers() -> None:
    """Worker.time_limits: a handler's own limit, else the worker's time_limit, else None."""
    worker = Worker(
        Client("ws://127.0.0.1:9/", "t" * 32), queue_id=QUEUE, handle_signals=False, time_limit=30
    )
    worker.register("own", lambda ctx, payload: None, time_limit=5)
    worker.register("default", lambda ctx, payload: None)
    worker.register("none", lambda ctx, payload: None, time_limit=None)
    assert worker.time_limits == {
        ("own", "1", "1"): 5,
        ("default", "1", "1"): 30,
        ("none", "1", "1"): None,
    }
