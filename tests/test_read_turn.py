"""Who reads a connection's socket: the read turn on its own (fake clock), then on a real
connection to the mock server, where a blocked caller reads its own answer."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from orbit_sync import Client, connection
from orbit_sync._readturn import ReadTurn, Step, Take
from orbit_sync.errors import WorkerError
from orbit_sync.models import (
    AttemptRef,
    Capability,
    CapacityReport,
    Finish,
    Registration,
    new_id,
    new_secret,
)
from orbit_sync.testing import MockOrbitServer

WAIT = 5.0
LINGER = 0.01


class Fake:
    """A fake clock and the connection's two inputs to the turn."""

    def __init__(self) -> None:
        self.now = 100.0
        self.input = False
        self.ended = False

    def turn(self) -> ReadTurn:
        return ReadTurn(
            lambda: self.input, lambda: self.ended, clock=lambda: self.now, linger=LINGER
        )


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def still_blocked(thread: threading.Thread) -> bool:
    thread.join(timeout=5 * LINGER)  # several linger periods of real time
    return thread.is_alive()


def lingering(fake: Fake) -> tuple[ReadTurn, threading.Thread, list[Any]]:
    """A turn a caller has just given back, and a reader thread lingering in reader_next."""
    turn = fake.turn()
    assert turn.take(None) is Take.TAKEN
    turn.release(False)
    thread, out = in_thread(turn.reader_next)
    assert still_blocked(thread)  # the clock has not moved: still lingering
    return turn, thread, out


def test_a_free_turn_is_taken_and_a_second_caller_follows() -> None:
    """The first caller takes the turn, the next follows, and once it is given back it is free."""
    turn = Fake().turn()
    assert turn.take(None) is Take.TAKEN
    assert turn.take(None) is Take.FOLLOW
    turn.unfollow()
    turn.release(False)
    assert turn.take(None) is Take.TAKEN


def test_a_caller_waits_for_the_readers_one_message() -> None:
    """While the reader reads a message, a caller's take waits; reader_done hands it over."""
    fake = Fake()
    fake.input = True
    turn = fake.turn()
    assert turn.reader_next() is Step.READ
    thread, out = in_thread(lambda: turn.take(None))
    assert still_blocked(thread)
    turn.reader_done()
    thread.join(WAIT)
    assert out == [Take.TAKEN]


def test_a_callers_wait_for_the_reader_ends_at_its_deadline() -> None:
    """A caller whose deadline has passed does not wait for the reader's message."""
    fake = Fake()
    fake.input = True
    turn = fake.turn()
    assert turn.reader_next() is Step.READ
    assert turn.take(fake.now - 1) is Take.NO


def test_the_reader_lingers_after_a_caller_then_waits_on_the_socket() -> None:
    """Right after a caller gave the turn back, the reader stays off the socket for the linger
    period (on the clock), then goes back to waiting on it."""
    fake = Fake()
    assert fake.turn().reader_next() is Step.WAIT  # no caller ever read: straight to the socket
    _, thread, out = lingering(fake)
    fake.now += LINGER
    thread.join(WAIT)
    assert out == [Step.WAIT]


def test_input_is_read_at_once_when_no_caller_holds_the_turn() -> None:
    """Lingering never delays bytes already waiting: the reader reads them."""
    fake = Fake()
    turn = fake.turn()
    turn.take(None)
    turn.release(False)
    fake.input = True
    assert turn.reader_next() is Step.READ


@pytest.mark.parametrize("why", ["calls in flight", "a follower"])
def test_somebody_still_waiting_sends_the_reader_back_at_once(why: str) -> None:
    """A caller giving the turn back while others still await answers wakes the reader now."""
    turn, thread, out = lingering(Fake())
    assert turn.take(None) is Take.TAKEN
    if why == "a follower":
        assert turn.take(None) is Take.FOLLOW
    turn.release(why == "calls in flight")
    thread.join(WAIT)  # the clock never moved
    assert out == [Step.WAIT]


def test_an_ended_connection_stops_the_reader_and_refuses_the_turn() -> None:
    """wake() gets a lingering reader out at once once the connection has ended."""
    fake = Fake()
    turn, thread, out = lingering(fake)
    fake.ended = True
    turn.wake()
    thread.join(WAIT)
    assert out == [Step.EXIT]
    assert turn.take(None) is Take.NO


def test_close_waits_for_a_reading_caller_then_nobody_reads_again() -> None:
    """The reader exits only after a caller holding the turn gave it back."""
    fake = Fake()
    turn = fake.turn()
    assert turn.take(None) is Take.TAKEN
    thread, _ = in_thread(turn.close)
    assert still_blocked(thread)
    turn.release(False)
    thread.join(WAIT)
    assert not thread.is_alive()
    assert turn.take(None) is Take.NO


# --------------------------------------------------------------------------- on a connection


@pytest.fixture
def server() -> Iterator[MockOrbitServer]:
    """A mock server that assigns at once."""
    with MockOrbitServer(lease_duration=30.0, assignment_rate=None) as srv:
        yield srv


def _registration(server: MockOrbitServer, capacity: int = 1) -> Registration:
    return Registration(
        queue_id=server.queue_id,
        capabilities=[Capability("resize", "1", "1")],
        capacity=capacity,
        instance_id=new_id(),
        instance_secret=new_secret(),
    )


def _threads_of(caplog: pytest.LogCaptureFixture, text: str) -> set[str]:
    return {r.threadName for r in caplog.records if text in r.getMessage()}


@pytest.mark.parametrize("callbacks", [False, True])
def test_a_blocked_call_reads_its_own_answer_without_push_callbacks(
    server: MockOrbitServer, caplog: pytest.LogCaptureFixture, callbacks: bool
) -> None:
    """Without push callbacks the answer is handled on the calling thread; with them (user code
    runs on frames) it is always the reader thread's."""
    caplog.set_level(logging.DEBUG, logger="orbit_sync.connection")
    extra: dict[str, Any] = {"on_assignment": lambda a: None} if callbacks else {}
    bogus = AttemptRef(new_id(), new_id(), 1, new_secret())
    with Client(server.url, server.token).dial_worker(_registration(server), **extra) as conn:
        conn.capacity(CapacityReport(sequence=1, capacity=1))
        for _ in range(3):
            with pytest.raises(WorkerError):
                conn.renew(bogus)  # answered with an error, which is logged where it is handled
    threads = _threads_of(caplog, "answering message_id=")
    if callbacks:
        assert threads and all(name.startswith("orbit-sync-reader-") for name in threads)
    else:  # the reader thread may win a race for one of them, not for all
        assert threading.current_thread().name in threads


def test_next_assignment_reads_for_itself(
    server: MockOrbitServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer waiting for an assignment reads the push on its own thread: with the reader
    thread lingering for a minute after each call, the push is only read by the consumer."""
    monkeypatch.setattr(connection, "ReadTurn", functools.partial(ReadTurn, linger=60.0))
    caplog.set_level(logging.DEBUG, logger="orbit_sync.connection")
    with Client(server.url, server.token).dial_worker(_registration(server)) as conn:
        conn.capacity(CapacityReport(sequence=1, capacity=1))
        handled: set[str] = set()
        for _ in range(3):  # the reader may race the first one; later ones find it lingering
            task_id = server.enqueue("resize", {"n": 1})
            assignment = conn.next_assignment(timeout=WAIT)
            assert assignment.task.task_id == task_id
            handled |= _threads_of(caplog, f"assignment task_id={task_id}")
            conn.start(assignment.attempt)
            conn.finish(Finish(assignment.attempt, "SUCCEEDED", {"ok": True}))
    assert threading.current_thread().name in handled


def test_many_blocked_callers_at_once_all_get_their_answers(server: MockOrbitServer) -> None:
    """Eight threads renewing at once on one connection: one reads, the others follow, and the
    reader takes over between them; every call is answered."""
    with Client(server.url, server.token).dial_worker(_registration(server)) as conn:
        conn.capacity(CapacityReport(sequence=1, capacity=1))
        server.enqueue("resize", {"n": 1})
        ref = conn.next_assignment(timeout=WAIT).attempt
        conn.start(ref)
        errors: list[BaseException] = []
        done = [0]
        lock = threading.Lock()

        def renew_many() -> None:
            try:
                for _ in range(25):
                    assert conn.renew(ref).lease.active
                    with lock:
                        done[0] += 1
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=renew_many) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert done[0] == 8 * 25


def test_the_reader_still_reads_when_nobody_waits(server: MockOrbitServer) -> None:
    """After callers read for themselves, the reader thread goes back to the socket: the
    server ending the session ends the connection with nobody calling."""
    with Client(server.url, server.token).dial_worker(_registration(server)) as conn:
        for sequence in range(1, 4):
            conn.capacity(CapacityReport(sequence=sequence, capacity=1))
        server.disconnect(conn.session_id)
        assert conn.done.wait(WAIT)
        assert conn.err is not None
