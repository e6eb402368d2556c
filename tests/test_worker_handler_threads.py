"""The handler threads (``_pool.HandlerThreads``): they take assignments from a real
connection's queue of 8 and run each attempt on themselves, start on demand up to their size,
retire when idle beyond the one kept waiting, and take what a connection left unread."""

from __future__ import annotations

import threading
from typing import Any

from _scripted import LEASE_SECRET, WAIT, ScriptedServer, assignment_body, command_body, open_pair

from orbit_sync.connection import BatchCall
from orbit_sync.models import Assignment, AttemptRef, new_id
from orbit_sync.worker.runtime._link import Intake
from orbit_sync.worker.runtime._pool import EXTRA, HandlerThreads

REF = AttemptRef("1" * 32, "2" * 32, 1, LEASE_SECRET)


class Runs:
    """What the threads ran: (attempt id, thread, daemon?), with a gate to hold them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, threading.Thread, bool]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Event()

    def run(self, conn: object, assignment: Assignment) -> None:
        me = threading.current_thread()
        with self.lock:
            self.seen.append((assignment.attempt_id, me, me.daemon))
        self.started.release()
        self.release.wait(WAIT)


def _push(peer: object, count: int) -> list[str]:
    ids = [new_id() for _ in range(count)]
    for attempt_id in ids:
        peer.push("task.assign", assignment_body(task_id=new_id(), attempt_id=attempt_id))  # type: ignore[attr-defined]
    return ids


def test_threads_are_daemons_bounded_and_start_on_demand() -> None:
    """Size 2: the threads start one by one as each takes an assignment, up to the size; a third
    assignment waits in the queue until a thread is free, then runs; all on daemon threads."""
    runs = Runs()
    intake = Intake()
    threads = HandlerThreads(2, intake, runs.run)
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            threads.start()
            assert threads.thread_count() == 1, "one thread waits before any assignment"
            intake.offer(conn)
            ids = _push(peer, 3)
            assert runs.started.acquire(timeout=WAIT) and runs.started.acquire(timeout=WAIT)
            assert not runs.started.acquire(timeout=0.1), "a third must wait for a free thread"
            assert threads.thread_count() == 2
            runs.release.set()
            assert runs.started.acquire(timeout=WAIT)
            assert sorted(s[0] for s in runs.seen) == sorted(ids)
            assert runs.seen[-1][0] == ids[-1], "the one that waited ran last"
            assert all(daemon for _, _, daemon in runs.seen)
        finally:
            conn.close()
            assert threads.shutdown(WAIT) == []


def test_a_thread_about_to_wait_holding_its_attempt_gets_a_taker_beside_it() -> None:
    """Size 1, its thread held (as while it waits to re-send its start): ensure_taker starts
    another that takes the next assignment, and so on up to EXTRA beyond the size, no further."""
    runs = Runs()
    intake = Intake()
    held: list[threading.Thread] = []

    def run(conn: object, assignment: Assignment) -> None:
        held.append(threading.current_thread())
        threads.ensure_taker()  # what the shell does before such a wait
        runs.run(conn, assignment)

    threads = HandlerThreads(1, intake, run)
    most = 1 + EXTRA
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            threads.start()
            intake.offer(conn)
            ids = _push(peer, most + 1)
            for _ in range(most):
                assert runs.started.acquire(timeout=WAIT)
            assert not runs.started.acquire(timeout=0.1), "no thread beyond size + EXTRA"
            assert threads.thread_count() == most == len(set(held))
            runs.release.set()
            assert runs.started.acquire(timeout=WAIT)
            assert sorted(s[0] for s in runs.seen) == sorted(ids)
        finally:
            conn.close()
            assert threads.shutdown(WAIT) == []


def test_at_most_size_handlers_run_at_once() -> None:
    """The threads' running semaphore, taken around each handler's call, lets size handlers run
    at once however many threads hold attempts."""
    threads = HandlerThreads(2, Intake(), lambda conn, assignment: None)
    assert threads.running.acquire(timeout=WAIT) and threads.running.acquire(timeout=WAIT)
    assert not threads.running.acquire(timeout=0.05), "a third handler waits for a slot"
    threads.running.release()
    assert threads.running.acquire(timeout=WAIT)


def test_idle_threads_beyond_the_one_waiting_retire() -> None:
    """After a burst of four on four threads, the idle ones retire after the idle timeout until
    one is left waiting on the queue; a later assignment still runs."""
    runs = Runs()
    intake = Intake()
    threads = HandlerThreads(4, intake, runs.run, idle_timeout=0.05)
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            threads.start()
            intake.offer(conn)
            _push(peer, 4)
            for _ in range(4):
                assert runs.started.acquire(timeout=WAIT)
            runs.release.set()  # all four ran at once, on four threads; now they are idle
            ran = {thread for _, thread, _ in runs.seen}
            assert len(ran) == 4
            for thread in ran:  # the one left waiting makes this join its short bound
                thread.join(0.5)
            assert sum(not t.is_alive() for t in ran) == 3, "idle threads never retired"
            assert threads.thread_count() == 1
            [late] = _push(peer, 1)
            assert runs.started.acquire(timeout=WAIT)
            assert runs.seen[-1][0] == late
        finally:
            conn.close()
            assert threads.shutdown(WAIT) == []


def test_what_a_connection_left_unread_is_taken_then_the_next_connection() -> None:
    """Assignments received before a connection ended are still taken, in order, after its
    end; then the threads wait for the next connection the intake offers and take its own."""
    runs = Runs()
    intake = Intake()
    threads = HandlerThreads(1, intake, runs.run)
    with ScriptedServer() as server:
        conn, peer = open_pair(server)
        try:
            threads.start()
            intake.offer(conn)
            ids = _push(peer, 3)  # its one thread held by the first: two left on the queue
            assert runs.started.acquire(timeout=WAIT)
            _read_up_to_here(conn, peer, 3)
            conn.close()
            assert conn.done.wait(WAIT)
            runs.release.set()
            for _ in range(2):
                assert runs.started.acquire(timeout=WAIT)
            assert [s[0] for s in runs.seen] == ids
            conn2, peer2 = open_pair(server)
            try:
                intake.offer(conn2)
                [later] = _push(peer2, 1)
                assert runs.started.acquire(timeout=WAIT)
                assert runs.seen[-1][0] == later
            finally:
                conn2.close()
        finally:
            conn.close()
            assert threads.shutdown(WAIT) == []


def _read_up_to_here(conn: Any, peer: Any, count: int) -> None:
    """Return once *conn*'s reader has read every frame *peer* sent so far: a call's answer,
    sent after them, arrives after them."""
    [call] = conn.send_many([BatchCall("task.renew", REF)])
    peer.ack(peer.recv(), command_body("renew"))
    call.result()
    assert conn.assignments_received == count
