"""``WorkerOptions``: a Worker's options, validated once and frozen; ``Worker.options`` returns
them, ``Worker.from_options`` builds a Worker from them, and ``Worker.with_options`` a new Worker
with the same handlers (and executors) and options, except the changes (what ``orbit-sync
worker`` uses)."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import pytest

from orbit_sync import Client, SystemClock
from orbit_sync.testing import ManualClock
from orbit_sync.worker import Backoff, Worker, WorkerOptions

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


def test_options_are_the_frozen_constructor_arguments() -> None:
    """Worker.options is a frozen WorkerOptions of every keyword, defaults included; the client
    is Worker.client."""
    worker = make()
    options = worker.options
    assert isinstance(options, WorkerOptions)
    assert options.queue_id == QUEUE and options.capacity == 2
    assert options.drain_timeout == 3 and options.handle_signals is False
    assert options.cancel_grace == 5.0  # a default
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        options.capacity = 99  # type: ignore[misc]
    assert worker.options.capacity == 2
    assert worker.client.base_url == "ws://127.0.0.1:9"  # type: ignore[attr-defined]
    assert "options-token" not in repr(options)


def test_what_is_left_out_reads_as_its_default() -> None:
    """No clock is real time, no logger orbit_sync.worker's, no backoff the default one; two
    options built alike are equal."""
    options = WorkerOptions(queue_id=QUEUE)
    assert isinstance(options.clock, SystemClock)
    assert options.logger is logging.getLogger("orbit_sync.worker")
    assert options.reconnect_backoff == Backoff()
    assert options.listeners == ()
    assert options == WorkerOptions(queue_id=QUEUE, clock=None, logger=None)
    clock = ManualClock()
    assert WorkerOptions(queue_id=QUEUE, clock=clock).clock is clock


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"queue_id": "not-hex"}, ValueError, "queue_id must be 32 lowercase hex"),
        ({"capacity": 0}, ValueError, "capacity must be an int between 1 and 256"),
        ({"drain_timeout": -1}, ValueError, "drain_timeout must be >= 0"),
        ({"dial_timeout": 0}, ValueError, "dial_timeout must be > 0"),
        ({"renew_retry_delay": 9}, ValueError, "renew_retry_delay must be between"),
        ({"max_in_flight": 2}, ValueError, "max_in_flight must be an int between 3"),
        ({"clock": object()}, TypeError, r"clock must be an orbit_sync\.Clock"),
        ({"process_pool": 0}, ValueError, "process_pool must be a positive int"),
        ({"process_max_tasks_per_child": 0}, ValueError, "process_max_tasks_per_child must"),
        ({"process_max_memory_per_child": 1.5}, ValueError, "process_max_memory_per_child must"),
        ({"outbox": 3}, TypeError, "outbox must be a file path"),
        ({"time_limit": 0}, ValueError, "time_limit must be > 0"),
        ({"first_connect_timeout": 0}, ValueError, "first_connect_timeout must be > 0"),
    ],
)
def test_a_wrong_option_raises_naming_it(
    changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Each option is checked in WorkerOptions, the one place: built directly, through Worker's
    keywords or evolved, a wrong value raises the same error."""
    with pytest.raises(error, match=message):
        WorkerOptions(**{"queue_id": QUEUE, **changes})
    with pytest.raises(error, match=message):
        Worker(
            Client("ws://127.0.0.1:9", "options-token-0123456789"), **{"queue_id": QUEUE, **changes}
        )
    with pytest.raises(error, match=message):
        attrs.evolve(WorkerOptions(queue_id=QUEUE), **changes)


def test_from_options_builds_a_worker_with_those_options() -> None:
    """from_options(client, options) gives a Worker holding them; anything but a WorkerOptions is
    refused."""
    client = Client("ws://127.0.0.1:9", "options-token-0123456789")
    options = attrs.evolve(make().options, capacity=5, handle_signals=True)
    worker = Worker.from_options(client, options)
    worker.register("echo", lambda ctx, payload: payload)
    assert worker.options == options and worker.client is client
    assert worker.registration.capacity == 5 and worker.registration.queue_id == QUEUE
    with pytest.raises(TypeError, match="WorkerOptions"):
        Worker.from_options(client, {"queue_id": QUEUE})  # type: ignore[arg-type]


def test_reading_options_as_a_dict_still_works_with_a_warning() -> None:
    """options["capacity"] and options.get() (Worker.options was a dict) warn at the caller's
    line and read the option; the client is no option any more: the KeyError says where it is."""
    options = make().options
    with pytest.warns(DeprecationWarning, match=r"read options\.capacity") as caught:
        assert options["capacity"] == 2
    assert caught[0].filename == __file__
    with pytest.warns(DeprecationWarning):
        assert options.get("outbox", "x") is None
    with pytest.warns(DeprecationWarning):
        assert options.get("no_such_option", 7) == 7
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        options["no_such_option"]
    with pytest.raises(KeyError, match=r"Worker\.client"):
        options["client"]


def test_with_options_keeps_handlers_and_executors() -> None:
    """The copy has the changes, every other option, every handler and its executor."""
    worker = make()
    client = Client("ws://127.0.0.1:10", "other-token-0123456789")
    copy = worker.with_options(capacity=5, client=client)
    assert copy is not worker
    assert copy.options == attrs.evolve(worker.options, capacity=5)
    assert copy.client is client and worker.client is not client
    caps = {(c.handler, c.handler_version) for c in copy.registration.capabilities}
    assert caps == {("echo", "2"), ("child", "1")}
    assert copy.registration.capacity == 5
    assert copy.executors == {("echo", "2", "1"): "thread", ("child", "1", "1"): "process"}
    assert copy.executors == worker.executors
    assert worker.registration.capacity == 2  # the original is unchanged


def test_with_options_checks_the_changes() -> None:
    """A bad change raises like the constructor would."""
    with pytest.raises(ValueError, match="capacity"):
        make().with_options(capacity=0)
    with pytest.raises(TypeError):
        make().with_options(no_such_option=1)
