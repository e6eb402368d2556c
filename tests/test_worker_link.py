"""The link keeps failed requests for the connection thread to re-send, and its gate bounds the
requests in flight: on fake time, no sockets."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from orbit_sync.testing import ManualClock
from orbit_sync.worker.runtime._link import Gate, GaveUp, Link

WAIT = 5.0


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


def test_gate_waits_for_a_freed_slot_and_close_releases_every_waiter() -> None:
    """A caller past the gate's slots waits until one is released and then takes it; closing
    wakes every waiter with GaveUp, and a closed gate lends no slot, even a free one."""
    gate = Gate(1)
    assert gate.acquire() == 1
    took = threading.Event()
    gave_up: list[BaseException] = []

    def take() -> None:
        try:
            gate.acquire()
            took.set()
        except GaveUp as exc:
            gave_up.append(exc)

    waiter = threading.Thread(target=take)
    waiter.start()
    assert not took.wait(0.05), "no slot is free: it waits"
    gate.release()
    assert took.wait(WAIT), "the released slot went to the waiter"
    waiter.join(WAIT)
    blocked = [threading.Thread(target=take) for _ in range(2)]
    for t in blocked:
        t.start()
    gate.close()
    for t in blocked:
        t.join(WAIT)
        assert not t.is_alive()
    assert len(gave_up) == 2
    gate.release()
    with pytest.raises(GaveUp):  # the slot is free, yet a closed gate lends it to no one
        gate.acquire()


def test_gate_lends_at_most_its_free_slots_to_a_batch() -> None:
    """A batch takes as many slots as are free, up to what it asks (at least one when it
    waits); without waiting it may take none; released slots are free again."""
    gate = Gate(3)
    assert gate.acquire(2) == 2
    assert gate.acquire(5, wait=False) == 1
    assert gate.acquire(5, wait=False) == 0
    gate.release(3)
    assert gate.acquire(10) == 3


def test_wait_for_returns_once_a_newer_connection_is_published_or_the_link_closes() -> None:
    """A thread holding a failed request waits for a connection newer than the failed one and
    published (an opened one is not enough: its resumes have not gone out), then re-sends; a
    closed link ends the wait with False."""
    link = Link(ManualClock())
    conn: Any = object()
    gen = link.publish(conn)
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(link.wait_for(newer_than=gen)))
    waiter.start()
    link.open(object())  # type: ignore[arg-type]
    waiter.join(0.05)
    assert waiter.is_alive(), "opened, not published: its resumes are not out yet"
    link.publish(conn)
    waiter.join(WAIT)
    assert results == [True]
    closing = threading.Thread(target=lambda: results.append(link.wait_for(newer_than=99)))
    closing.start()
    link.close()
    closing.join(WAIT)
    assert results == [True, False]
