"""The link keeps failed requests for the connection thread to re-send, and its gate bounds the
requests in flight: on fake time, no sockets."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from orbit_sync.testing import ManualClock
from orbit_sync.worker._link import Gate, GaveUp, Link


class _Conn:
    """A stand-in for a published connection (the link only stores and closes it)."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        """Record the close."""
        self.closed.set()


def _link() -> tuple[Link, ManualClock]:
    clock = ManualClock(0.0)
    return Link(clock, slots=4), clock


def _job(ran: list[str], name: str) -> Any:
    return lambda: ran.append(name)


def test_kept_request_waits_for_a_newer_connection() -> None:
    """A request kept after a failure on connection n is due only once n+1 is published."""
    link, _ = _link()
    gen = link.publish(_Conn())  # type: ignore[arg-type]
    ran: list[str] = []
    assert link.keep(_job(ran, "finish"), newer_than=gen)
    jobs, next_at = link.take_due()
    assert jobs == [] and next_at == math.inf
    link.retract(gen)
    assert link.take_due() == ([], math.inf)  # no connection at all
    link.publish(_Conn())  # type: ignore[arg-type]
    jobs, next_at = link.take_due()
    for job in jobs:
        job()
    assert ran == ["finish"] and next_at == math.inf
    assert link.take_due() == ([], math.inf)  # taken once


def test_kept_request_published_meanwhile_is_due_at_once() -> None:
    """A request kept for "newer than n" while n+1 is already current is due immediately, so a
    reconnect that happened before the failure was reported loses nothing."""
    link, _ = _link()
    first = link.publish(_Conn())  # type: ignore[arg-type]
    link.publish(_Conn())  # type: ignore[arg-type]
    ran: list[str] = []
    link.keep(_job(ran, "start"), newer_than=first)
    jobs, _ = link.take_due()
    assert len(jobs) == 1


def test_retry_delay_runs_on_the_clock_and_keeps_order() -> None:
    """A transient retry is due after its delay on the link's clock; due jobs run in the order
    they were kept, and the next due time is reported."""
    link, clock = _link()
    link.publish(_Conn())  # type: ignore[arg-type]
    ran: list[str] = []
    link.keep(_job(ran, "late"), delay=2.0)
    link.keep(_job(ran, "a"))
    link.keep(_job(ran, "b"))
    jobs, next_at = link.take_due()
    for job in jobs:
        job()
    assert ran == ["a", "b"] and next_at == clock.now() + 2.0
    clock.advance(1.0)
    assert link.take_due()[0] == []
    clock.advance(1.0)
    jobs, next_at = link.take_due()
    for job in jobs:
        job()
    assert ran == ["a", "b", "late"] and next_at == math.inf


def test_close_hands_back_every_kept_request_and_refuses_new_ones() -> None:
    """Closing the link returns the kept requests (to be given up) and keeps nothing more."""
    link, _ = _link()
    ran: list[str] = []
    link.keep(_job(ran, "x"), newer_than=5)
    link.keep(_job(ran, "y"), delay=30.0)
    jobs = link.close()
    for job in jobs:
        job()
    assert sorted(ran) == ["x", "y"]
    assert not link.keep(_job(ran, "z"))
    assert link.take_due() == ([], math.inf)


def test_keep_and_publish_racing_lose_nothing() -> None:
    """Requests kept from many threads while connections are published: each is taken once."""
    link, _ = _link()
    ran: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(5)

    def keeper(base: int) -> None:
        start.wait(5)
        for n in range(200):

            def job(value: int = base + n) -> None:
                with lock:
                    ran.append(value)

            link.keep(job, newer_than=0)

    threads = [threading.Thread(target=keeper, args=(k * 1000,)) for k in range(4)]
    for thread in threads:
        thread.start()
    start.wait(5)
    for _ in range(50):
        link.publish(_Conn())  # type: ignore[arg-type]
        jobs, _ = link.take_due()
        for job in jobs:
            job()
    for thread in threads:
        thread.join(5)
    jobs, _ = link.take_due()
    for job in jobs:
        job()
    assert sorted(ran) == sorted(k * 1000 + n for k in range(4) for n in range(200))


def test_on_close_runs_once_at_close_or_at_once_when_already_closed() -> None:
    """A subscriber runs once when the link closes (an unsubscribed one never), and a late
    subscriber runs at once: a replay try started during shutdown still ends."""
    link, _ = _link()
    ran: list[str] = []
    link.on_close(_job(ran, "a"))
    unsubscribe = link.on_close(_job(ran, "b"))
    unsubscribe()
    link.close()
    link.close()
    assert ran == ["a"]
    link.on_close(_job(ran, "late"))
    assert ran == ["a", "late"]


def test_gate_hands_freed_slots_to_queued_jobs_in_arrival_order() -> None:
    """A job queued for a slot holds no thread: each release hands the slot to the first
    queued job (returned to run), in arrival order; closing keeps queued jobs, which still get
    the slots released after it, and refuses new ones."""
    gate = Gate(1)
    ran: list[str] = []
    assert gate.acquire_or_queue(lambda: ran.append("never"))  # a free slot: taken, not queued
    assert not gate.acquire_or_queue(lambda: ran.append("a"))
    assert not gate.acquire_or_queue(lambda: ran.append("b"))
    job = gate.release()
    assert job is not None
    job()
    gate.close()
    with pytest.raises(GaveUp):
        gate.acquire_or_queue(lambda: ran.append("late"))
    job = gate.release()
    assert job is not None
    job()
    assert gate.release() is None
    assert ran == ["a", "b"]
    with pytest.raises(GaveUp):  # the slot is free, yet a closed gate lends it to no one
        gate.acquire_or_queue(lambda: ran.append("closed"))


def test_gate_takes_a_free_slot_once_nothing_is_queued_and_never_lends_more() -> None:
    """The request gate: past its slots a request is queued, holding no thread, and a freed
    slot goes to it first (its job is returned to the freeing thread); with nothing queued the
    freed slot is free again, taken by the next request, and only one."""
    gate = Gate(1)
    ran: list[str] = []
    assert gate.acquire_or_queue(lambda: ran.append("never"))
    assert not gate.acquire_or_queue(lambda: ran.append("queued"))
    assert ran == []
    job = gate.release()
    assert job is not None and ran == [], "the queued request took it"
    job()
    assert ran == ["queued"]
    assert gate.release() is None  # nothing queued: the slot is free
    assert gate.acquire_or_queue(lambda: ran.append("never either"))
    assert not gate.acquire_or_queue(lambda: ran.append("behind")), "none is free"
    assert ran == ["queued"]
