"""Call overhead: ``conn.renew()`` against a bare websocket-client round trip of the same frame to
the same server (the mock server in its own process).

The baseline sends pre-encoded ``task.renew`` frames (a fresh ``message_id`` each, so the server
does the same work as for ours) on its own session and reads the answer: it is the floor of a
renewal on this machine, server included. Ours adds encoding, the slot table, the reader thread's
hand-off and the strict decode. With 32 threads, ours shares one ``WorkerConnection`` (32 calls in
flight) and the baseline uses 32 raw sockets, one per thread.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import websocket

from benchmarks._common import Child, percentile
from orbit_sync import _codec
from orbit_sync.client import Client
from orbit_sync.models import (
    AttemptRef,
    Capability,
    CapacityReport,
    Registration,
    new_id,
    new_message_id,
    new_secret,
)

HANDLER = "bench"
#: Calls per side in each turn of the 1-thread comparison taken in blocks.
BLOCK = 50
#: Sets of each 1-thread comparison taken in turns; the median set counts.
TURN_SETS = 3


class RawSession:
    """One bare websocket-client session: hello, capacity, assignments, start; then raw frames."""

    def __init__(
        self, url: str, token: str, queue_id: str, capacity: int, handler: str = HANDLER
    ) -> None:
        self.registration = Registration(
            queue_id=queue_id,
            capabilities=[Capability(handler, "1", "1")],
            capacity=capacity,
            instance_id=new_id(),
            instance_secret=new_secret(),
        )
        self.ws = websocket.create_connection(
            url + "/v1/worker/connect",
            header=[f"Authorization: Bearer {token}"],
            subprotocols=[_codec.SUBPROTOCOL],
            skip_utf8_validation=True,
            enable_multithread=False,
        )
        welcome = self.request("worker.hello", self.registration, None)
        self.session_id: str = welcome["session_id"]
        self.pushes: list[dict[str, Any]] = []
        self.request("worker.capacity", CapacityReport(sequence=1, capacity=capacity))

    def request(self, kind: str, body: Any, session_id: str | bool | None = True) -> dict[str, Any]:
        sid = self.session_id if session_id is True else session_id
        mid = new_message_id()
        self.ws.send(_codec.encode_request(kind, mid, sid, body))  # type: ignore[arg-type]
        while True:
            frame: dict[str, Any] = json.loads(self.ws.recv())
            if frame.get("reply_to") == mid:
                if frame["type"] == "error":
                    raise RuntimeError(f"{kind}: {frame['body'].get('code')}")
                return frame
            self.pushes.append(frame)

    def attempts(self, n: int) -> list[AttemptRef]:
        """Wait for *n* assignments and start each; return their refs."""
        refs: list[AttemptRef] = []
        while len(refs) < n:
            frame = self.pushes.pop(0) if self.pushes else json.loads(self.ws.recv())
            if frame.get("type") != "task.assign":
                continue
            body = frame["body"]
            ref = AttemptRef(
                body["task"]["task_id"],
                body["attempt_id"],
                int(body["epoch"]),
                body["lease_secret"],
            )
            self.request("task.start", ref)
            refs.append(ref)
        return refs

    def renew_frames(self, ref: AttemptRef, n: int) -> list[str]:
        return [
            _codec.encode_request("task.renew", new_message_id(), self.session_id, ref)
            for _ in range(n)
        ]

    def close(self) -> None:
        self.ws.close()


def _registration(queue_id: str, capacity: int) -> Registration:
    # A fresh instance per connection: capacity sequences belong to an instance.
    return Registration(
        queue_id=queue_id,
        capabilities=[Capability(HANDLER, "1", "1")],
        capacity=capacity,
        instance_id=new_id(),
        instance_secret=new_secret(),
    )


def _timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _raw_loop(session: RawSession, frames: list[str]) -> list[float]:
    ws = session.ws
    out = []
    for text in frames:
        t = time.perf_counter()
        ws.send(text)
        ws.recv()
        out.append(time.perf_counter() - t)
    return out


def _threads(work: list[Callable[[], list[float]]]) -> tuple[list[float], float]:
    """Run each callable on its own thread at once; (all samples, wall seconds)."""
    results: list[list[float]] = [[] for _ in work]
    gate = threading.Barrier(len(work) + 1)

    def run(i: int) -> None:
        gate.wait()
        results[i] = work[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    gate.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return [s for r in results for s in r], wall


@contextlib.contextmanager
def _placed(server_pid: int) -> Iterator[bool]:
    """Pin the calling thread (and the threads it starts from now on) to one CPU and every thread
    of the server process to another, then give both back every CPU; yields False (pinning
    nothing) where that cannot be done: not Linux, or fewer than two CPUs."""
    get = getattr(os, "sched_getaffinity", None)
    cpus = sorted(get(0)) if get else []
    if len(cpus) < 2:
        yield False
        return
    server_threads = [int(t) for t in os.listdir(f"/proc/{server_pid}/task")]
    try:
        os.sched_setaffinity(0, {cpus[0]})
        for tid in server_threads:
            with contextlib.suppress(OSError):  # a thread that has ended meanwhile
                os.sched_setaffinity(tid, {cpus[1]})
        yield True
    finally:
        os.sched_setaffinity(0, cpus)
        for tid in server_threads:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def _one_thread_pair(
    url: str, token: str, queue_id: str
) -> Iterator[tuple[Any, AttemptRef, RawSession, AttemptRef]]:
    """A connection of ours and a raw session, each holding one started attempt to renew:
    ``(conn, ref, raw, raw_ref)``. The connection's threads start on the calling thread's CPUs."""
    raw = RawSession(url, token, queue_id, 1)
    try:
        raw_ref = raw.attempts(1)[0]
        with Client(url, token).dial_worker(_registration(queue_id, 1)) as conn:
            conn.capacity(CapacityReport(sequence=1, capacity=1))
            ref = conn.next_assignment(timeout=10).attempt
            conn.start(ref)
            yield conn, ref, raw, raw_ref
    finally:
        raw.close()


#: One side of a comparison taken in turns: one call, timed, its sample in a list.
Side = Callable[[], list[float]]


def _renewing(conn: Any, ref: AttemptRef) -> Side:
    """``conn.renew(ref)``, timed."""
    return lambda: _timed(lambda: conn.renew(ref), 1)


def _raw_round_trips(session: RawSession, ref: AttemptRef, n: int) -> Side:
    """One raw round trip per call, each with its own of *n* frames encoded now."""
    frames = iter(session.renew_frames(ref, n))
    return lambda: _raw_loop(session, [next(frames)])


def _turns(ours: Side, base: Side, rounds: int) -> dict[str, Any]:
    """A 1-thread comparison with the two sides taking turns call by call, in
    :data:`TURN_SETS` sets of *rounds* calls per side: the set with the median p50 ratio counts
    (the host's state drifts over seconds, so one set's ratio moves by a tenth from run to run),
    and ``ratios`` keeps every set's."""
    sets = []
    for _ in range(TURN_SETS):
        ours_samples: list[float] = []
        base_samples: list[float] = []
        for _ in range(rounds):
            ours_samples += ours()
            base_samples += base()
        sets.append({"ours": _summary(ours_samples), "base": _summary(base_samples)})
    ratios = [s["ours"]["p50"] / s["base"]["p50"] for s in sets]
    median = sorted(range(len(sets)), key=ratios.__getitem__)[len(sets) // 2]
    return {**sets[median], "ratios": ratios}


class HandOff:
    """The design's hand-off and nothing else: a bare websocket-client session whose own reader
    thread gives each answer to the waiting caller through a ``threading.Event``. No decode, no
    call table, no deadline, no lock: what any SDK with a reader thread and blocking callers pays
    at least, measured on the same host in the same run. It reads exactly as the raw loop does
    (websocket-client's ``recv``), so the two differ by the hand-off alone."""

    def __init__(self, session: RawSession) -> None:
        self._ws = session.ws
        self._answered = threading.Event()
        self._reader = threading.Thread(target=self._read, name="bench-hand-off", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                self._ws.recv()
            except Exception:  # the session was closed: the benchmark is over
                return
            self._answered.set()

    def call(self, text: str) -> None:
        """Send one frame and wait for the reader to hand its answer over."""
        self._ws.send(text)
        if not self._answered.wait(10):
            raise RuntimeError("no answer within 10 s")
        self._answered.clear()


def _handed_off(hand: HandOff, session: RawSession, ref: AttemptRef, n: int) -> Side:
    """One call through the hand-off alone, each with its own of *n* frames encoded now."""
    frames = iter(session.renew_frames(ref, n))
    return lambda: _timed(functools.partial(hand.call, next(frames)), 1)


def _summary(samples: list[float], wall: float | None = None) -> dict[str, float]:
    out = {"p50": percentile(samples, 50), "p99": percentile(samples, 99), "n": len(samples)}
    if wall:
        out["per_s"] = len(samples) / wall
    return out


def bench(server: Child, info: dict[str, Any], *, rounds: int, threads: int) -> dict[str, Any]:
    """The 1-thread comparisons (in halves, in turns per call, in blocks, and in turns with the
    threads placed on CPUs) and the 32-thread one."""
    url, token, queue_id = info["url"], info["token"], info["queue_id"]
    # One attempt for each 1-thread session (ours, the raw one and the hand-off, then ours and
    # the raw one placed), two for each of the 32 threads (ours, then a raw socket).
    server.send({"op": "enqueue", "n": 5 + threads * 2, "handler": HANDLER})
    results: dict[str, Any] = {}

    # --- 1 thread
    with _one_thread_pair(url, token, queue_id) as (conn, ref, raw, raw_ref):
        ours: list[float] = []
        base: list[float] = []
        half = max(1, rounds // 2)
        for _ in range(2):
            ours += _timed(lambda: conn.renew(ref), half)
            base += _raw_loop(raw, raw.renew_frames(raw_ref, half))
        # The same comparison with the two sides taking turns call by call: each sample of one
        # side then finds the machine (CPU idle states, thread placement) as the other left it.
        n = rounds * TURN_SETS
        results["one_mixed"] = _turns(
            _renewing(conn, ref), _raw_round_trips(raw, raw_ref, n), rounds
        )
        # The design's hand-off alone (a bare session with a reader thread and an Event), in
        # turns with the raw loop and with ours: how much of the gap any reader thread costs.
        floor = RawSession(url, token, queue_id, 1)
        try:
            floor_ref = floor.attempts(1)[0]  # before its reader thread takes the socket
            hand_off = _handed_off(HandOff(floor), floor, floor_ref, 2 * n)
            results["hand_off"] = _turns(hand_off, _raw_round_trips(raw, raw_ref, n), rounds)
            results["vs_hand_off"] = _turns(_renewing(conn, ref), hand_off, rounds)
        finally:
            floor.close()
        # And in blocks of BLOCK calls per side: within a block each side runs back to back.
        block_ours: list[float] = []
        block_base: list[float] = []
        for _ in range(max(1, rounds // BLOCK)):
            block_ours += _timed(lambda: conn.renew(ref), BLOCK)
            block_base += _raw_loop(raw, raw.renew_frames(raw_ref, BLOCK))
    results["one"] = {"ours": _summary(ours), "base": _summary(base)}
    results["one_blocks"] = {"ours": _summary(block_ours), "base": _summary(block_base)}

    # The turns again with both sides' threads on one CPU and the server's on another: what is
    # left is the client's own work and hand-offs, without the cost of waking a thread on an
    # idle CPU (on a VM without halt polling, tens of microseconds per wake-up, paid by ours
    # for its reader and its caller and by the raw loop once).
    with _placed(server.proc.pid) as placed:
        if placed:  # the connection's threads start here, on the pinned CPU
            with _one_thread_pair(url, token, queue_id) as (conn, ref, raw, raw_ref):
                results["one_placed"] = _turns(
                    _renewing(conn, ref), _raw_round_trips(raw, raw_ref, rounds * TURN_SETS), rounds
                )

    # --- 32 threads: one connection vs one raw socket per thread
    assigned: list[AttemptRef] = []
    got = threading.Condition()

    def on_assignment(a: Any) -> None:
        with got:
            assigned.append(a.attempt)
            got.notify_all()

    registration = _registration(queue_id, threads)
    per_thread = max(1, rounds // 4)
    with Client(url, token).dial_worker(registration, on_assignment=on_assignment) as conn:
        conn.capacity(CapacityReport(sequence=1, capacity=threads))
        with got:
            if not got.wait_for(lambda: len(assigned) >= threads, timeout=30):
                raise RuntimeError(f"only {len(assigned)} of {threads} assignments came")
        refs = assigned[:threads]
        for r in refs:
            conn.start(r)
        ours_n, ours_wall = _threads(
            [lambda r=r: _timed(lambda: conn.renew(r), per_thread) for r in refs]  # type: ignore[misc]
        )
    sessions = [RawSession(url, token, queue_id, 1) for _ in range(threads)]
    try:
        work = []
        for s in sessions:
            frames = s.renew_frames(s.attempts(1)[0], per_thread)
            work.append(lambda s=s, f=frames: _raw_loop(s, f))
        base_n, base_wall = _threads(work)  # type: ignore[arg-type]
    finally:
        for s in sessions:
            s.close()
    results["many"] = {
        "threads": threads,
        "ours": _summary(ours_n, ours_wall),
        "base": _summary(base_n, base_wall),
    }
    return results
