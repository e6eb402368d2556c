"""Helpers for the worker's tests: a worker bound to a mock server, probes, and a child process.

Run as a script, this module is the child worker of the SIGTERM tests::

    python tests/_worker_helpers.py URL TOKEN QUEUE_ID FLAG_PATH MODE

It runs a :class:`Worker` on the main thread (so ``run()`` handles signals) and prints the
shutdown report as one JSON line. MODE ``drain``: the handler waits for FLAG_PATH to exist, then
returns. MODE ``stubborn``: the handler ignores cancellation and never returns. MODE
``announce``: the handler prints ``running TASK_ID`` on stdout, then never returns (the kill -9
tests, and the second-signal test, which must know the handler is running).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

if __name__ == "__main__":  # the child process: make the package importable from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orbit_sync.client import Client
from orbit_sync.models import Task, TaskState, new_id
from orbit_sync.testing import EventRecord, ManualClock, MockOrbitServer
from orbit_sync.worker import (
    Backoff,
    DisconnectEvent,
    SessionEvent,
    TaskContext,
    Worker,
    WorkerListener,
)

#: Prefixes of the threads a worker (and its connections) create; never the mock server's.
WORKER_THREAD_PREFIXES = (
    "orbit-worker",
    "orbit-handler",
    "orbit-lease",
    "orbit-finish",
    "orbit-sync-reader",
    "orbit-sync-deadlines",
)


def leased_task(*, attempt: int = 1) -> Task:
    """A made-up LEASED ``resize`` task (payload ``{"w": 1}``), for a context without a server."""
    return Task(
        task_id=new_id(),
        queue_id=new_id(),
        namespace_id=new_id(),
        handler="resize",
        handler_version="1",
        payload_version="1",
        payload={"w": 1},
        state=TaskState.LEASED,
        revision=1,
        attempt=attempt,
        max_attempts=3,
    )


class Probe:
    """What handlers report back to the test: who started, how often, why they stopped."""

    def __init__(self) -> None:
        self.started: queue.Queue[str] = queue.Queue()
        self.release = threading.Event()
        self.runs: collections.Counter[str] = collections.Counter()
        self.reasons: dict[str, str | None] = {}
        self.threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def enter(self, ctx: TaskContext) -> None:
        """Record that the handler for ``ctx`` is running."""
        with self._lock:
            self.runs[ctx.task_id] += 1
            self.threads[ctx.task_id] = threading.current_thread()
        self.started.put(ctx.task_id)

    def wait_started(self, count: int = 1, timeout: float = 10.0) -> list[str]:
        """Wait until *count* handlers have started; return their task ids."""
        return [self.started.get(timeout=timeout) for _ in range(count)]


#: make_worker's reconnect backoff: fast, and on a fake clock one move of its maximum covers it.
FAST_BACKOFF = Backoff(initial=0.05, maximum=0.2)


class Sessions(WorkerListener):
    """Counts the sessions a worker established and saw end, for :func:`let_reconnect`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.established = 0
        self.ended = 0

    def connected(self, event: SessionEvent) -> None:
        """A session was established: its resumes were answered."""
        with self._cond:
            self.established += 1
            self._cond.notify_all()

    def disconnected(self, event: DisconnectEvent) -> None:
        """A session ended: the connection thread is about to wait out its reconnect delay."""
        with self._cond:
            self.ended += 1
            self._cond.notify_all()

    def wait(self, done: Callable[[Sessions], bool], timeout: float = 10.0) -> bool:
        """Wait (real time, at most *timeout*) until *done(self)*."""
        with self._cond:
            return self._cond.wait_for(lambda: done(self), timeout)


def let_reconnect(server: MockOrbitServer, clock: ManualClock, sessions: Sessions) -> None:
    """After a cut, on *server*'s ManualClock followed by the worker's *clock*: wait until the
    worker saw its session end and sleeps out its reconnect delay, move time past the delay
    (the longest of :data:`FAST_BACKOFF`), and wait for the next session (its resumes answered:
    the leases they renewed are what the worker's clock schedules from)."""
    assert isinstance(server.clock, ManualClock)
    assert sessions.wait(lambda s: 0 < s.established <= s.ended), "the session never ended"
    # The session's own waits on the clock ended before "disconnected": this is the delay (or,
    # when it was 0, already the next session's wait for its heartbeat: moving on is harmless).
    assert clock.wait_for_sleepers(1, "orbit-worker-connection")
    server.advance(FAST_BACKOFF.maximum)
    assert sessions.wait(lambda s: s.established > s.ended), "the worker never reconnected"


class FailedDials(logging.Handler):
    """The worker's "cannot connect ..." lines (one per failed dial) with their levels, while
    attached to the ``orbit_sync.worker`` logger (``with FailedDials() as dials:``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[int, str]] = []
        self.ended = False
        self._cond = threading.Condition()

    def __enter__(self) -> FailedDials:
        logging.getLogger("orbit_sync.worker").addHandler(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        logging.getLogger("orbit_sync.worker").removeHandler(self)

    @property
    def count(self) -> int:
        """Failed dials so far."""
        return len(self.lines)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("cannot connect"):
            with self._cond:
                self.lines.append((record.levelno, record.getMessage()))
                self._cond.notify_all()

    def end(self) -> None:
        """No more lines will come (the worker stopped): wake the waiter."""
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def wait(self, count: int) -> bool:
        """Wait until *count* lines came (False: the worker stopped first, or 10 s passed)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.count >= count or self.ended, 10) and (
                self.count >= count
            )


def run_until_it_gives_up(
    worker: Worker, clock: ManualClock, dials: FailedDials, *, step: float = 10.0
) -> BaseException | None:
    """Run *worker* on a thread whose every failed dial is followed by its reconnect delay
    passing at once on the worker's fake *clock* (moved by *step*), until ``run()`` raises (the
    error is returned) or 30 dials failed (None); the worker is stopped either way."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            worker.run()
        except BaseException as exc:
            raised.append(exc)
        finally:
            dials.end()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        for seen in range(1, 30):
            if not dials.wait(seen) or not thread.is_alive():
                break
            if clock.wait_for_sleepers(1, "orbit-worker-connection", timeout=5):
                clock.advance(step)
    finally:
        gave_up = not thread.is_alive()
        worker.stop()
        thread.join(15)
    return raised[0] if gave_up and raised else None


def make_worker(server: MockOrbitServer, *, capacity: int = 4, **kwargs: Any) -> Worker:
    """A Worker for *server*'s default queue that reconnects fast and leaves signals alone."""
    kwargs.setdefault("reconnect_backoff", FAST_BACKOFF)
    kwargs.setdefault("handle_signals", False)
    return Worker(
        Client(server.url, server.token), queue_id=server.queue_id, capacity=capacity, **kwargs
    )


@contextlib.contextmanager
def running(worker: Worker) -> Iterator[Worker]:
    """Start *worker*, wait for its session, and always stop it (at once) afterwards."""
    worker.start()
    try:
        assert worker.wait_ready(10.0), "the worker never connected"
        yield worker
    finally:
        worker.stop(drain=False)


def events(server: MockOrbitServer, kind: str, task_id: str | None = None) -> list[EventRecord]:
    """The server's events of *kind* (for *task_id* when given)."""
    return [
        e for e in server.events() if e.kind == kind and (task_id is None or e.task_id == task_id)
    ]


def has_event(
    kind: str, task_id: str | None = None, detail: str | None = None
) -> Callable[[MockOrbitServer], bool]:
    """A ``server.wait_until`` predicate: an event of *kind* (and *detail*) was recorded."""

    def check(server: MockOrbitServer) -> bool:
        return any(detail is None or e.detail == detail for e in events(server, kind, task_id))

    return check


def worker_threads() -> list[str]:
    """Names of live threads a worker or its connections created."""
    return [t.name for t in threading.enumerate() if t.name.startswith(WORKER_THREAD_PREFIXES)]


# --------------------------------------------------------------------------- child process


def _child(url: str, token: str, queue_id: str, flag: str, mode: str) -> int:
    worker = Worker(
        Client(url, token),
        queue_id=queue_id,
        capacity=2,
        drain_timeout=20.0,
        cancel_grace=0.5,
        flush_timeout=5.0,
    )
    never = threading.Event()
    printing = threading.Lock()

    @worker.handler("slow")
    def slow(ctx: TaskContext, payload: Any) -> Any:
        if mode == "announce":
            with printing:  # two handlers print at once: keep their lines whole
                print(f"running {ctx.task_id}", flush=True)
            never.wait()
        if mode == "stubborn":
            never.wait()  # ignores cancellation entirely
        while not os.path.exists(flag):
            ctx.sleep(0.02)  # the flag is another process's signal: poll it, honouring cancel
        return {"cancelled": ctx.cancelled.is_set(), "pid": os.getpid()}

    report = worker.run()
    print(
        json.dumps(
            {
                "drained": report.drained,
                "cancelled": [a.task_id for a in report.cancelled],
                "abandoned": [a.task_id for a in report.abandoned],
                "unreported": [a.task_id for a in report.unreported],
                "non_daemon": [
                    t.name
                    for t in threading.enumerate()
                    if not t.daemon and t is not threading.main_thread()
                ],
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(_child(*sys.argv[1:6]))
