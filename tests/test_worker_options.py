"""``Worker.options`` and ``Worker.with_options``: a new Worker with the same handlers (and
executors) and constructor arguments, except the changes (what ``orbit-sync worker`` uses)."""

from __future__ import annotations

from typing import Any

import pytest

from orbit_sync import Client
from orbit_sync.worker import Worker
from orbit_sync.worker._process import ProcessHandler

QUEUE = "c" * 32


def in_a_child(ctx: Any, payload: Any) -> Any:
    """A handler importable by reference (process executor)."""
    return payload


def make() -> Worker:
    """A Worker with a thread handler and a process handler, not started."""
    worker = Worker(
        Client("ws://127.0.0.1:9", "options-token-0123456789"),
        queue_id=QUEUE,
        capacity=2,
        drain_timeout=3,
        handle_signals=False,
    )
    worker.register("echo", lambda ctx, payload: payload, version="2")
    worker.register("child", in_a_child, executor="process")
    return worker


def test_options_are_the_constructor_arguments() -> None:
    """options() holds every constructor argument, defaults included, as a copy."""
    worker = make()
    options = worker.options
    assert options["queue_id"] == QUEUE and options["capacity"] == 2
    assert options["drain_timeout"] == 3 and options["handle_signals"] is False
    assert options["cancel_grace"] == 5.0  # a default
    options["capacity"] = 99
    assert worker.options["capacity"] == 2


def test_with_options_keeps_handlers_and_executors() -> None:
    """The copy has the changes, every other argument, every handler and its executor."""
    worker = make()
    client = Client("ws://127.0.0.1:10", "other-token-0123456789")
    copy = worker.with_options(capacity=5, client=client)
    assert copy is not worker
    assert copy.options["capacity"] == 5 and copy.options["client"] is client
    assert copy.options["drain_timeout"] == 3 and copy.options["queue_id"] == QUEUE
    caps = {(c.handler, c.handler_version) for c in copy.registration.capabilities}
    assert caps == {("echo", "2"), ("child", "1")}
    assert copy.registration.capacity == 5
    child = copy._handlers[("child", "1", "1")]
    assert isinstance(child, ProcessHandler) and child.fn is in_a_child
    assert child is not worker._handlers[("child", "1", "1")]  # its own process pool
    assert worker.registration.capacity == 2  # the original is unchanged


def test_with_options_checks_the_changes() -> None:
    """A bad change raises like the constructor would."""
    with pytest.raises(ValueError, match="capacity"):
        make().with_options(capacity=0)
    with pytest.raises(TypeError):
        make().with_options(no_such_option=1)
