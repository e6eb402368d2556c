"""Our Worker in its own process, measured from inside it; prints one JSON line per phase.

Modes (the server URL and queue come as arguments, the token in ``$ORBIT_BENCH_TOKEN`` so that
no command line shows it):

- ``noop``: drain ``--tasks`` pre-enqueued no-op tasks with ``Worker(capacity=--capacity)``;
  reports process CPU, wall time and peak RSS over the run (and the server's CPU over the same
  window when ``--server-pid`` is given). ``--frames`` adds the dispatch latency: the time from
  an assignment frame leaving the transport's frame reader to the handler's first line.
- ``lateness``: ``--tasks`` CPU-bound handlers for ``--seconds`` under a short lease; reports
  every renewal's lateness (its send time past the moment it was due: half the remaining local
  lease, as the README promises; 0 for one sent before) and a bare ``Event.wait`` thread's
  lateness in the same process over the same time (the floor), with lease losses.
- ``idle``: ``Worker(capacity=--capacity)`` idle, then (on the harness's ``go``) a burst, then
  idle again; reports RSS and thread counts.

The frame hooks wrap the transport's read and write entry points (``Transport.recv_message``,
``send_text``, ``send_texts``), so they see every frame the connection reads or writes whatever
sits above them; they parse only the frames they need.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (
    FloorWaiter,
    commands,
    emit,
    proc_cpu,
    proc_status,
    wait_succeeded,
)

#: The local deadline is the lease minus this margin (README: "At most once, nothing lost").
LEASE_MARGIN = 0.25
#: The watchdog never renews sooner than this after a grant.
MIN_RENEW_INTERVAL = 0.05


def _wire_time(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 UTC wire time (any number of fraction digits)."""
    main, _, frac = text.rstrip("Z").partition(".")
    base = _dt.datetime.strptime(main, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=_dt.timezone.utc)
    return base.timestamp() + (float("0." + frac) if frac else 0.0)


class FrameTap:
    """Timestamps frames as the transport parses and writes them (class-level wrappers)."""

    def __init__(self, *, renewals: bool) -> None:
        from orbit_sync._transport import Transport

        self.assigned: dict[str, float] = {}
        self.lateness: list[float] = []
        self._renewals = renewals
        self._sent: dict[str, tuple[str, float]] = {}  # message_id -> (attempt_id, sent at)
        self._due: dict[str, float] = {}  # attempt_id -> when its next renewal is due
        self._lock = threading.Lock()
        original_recv = Transport.recv_message
        original_send = Transport.send_text
        original_send_many = Transport.send_texts
        tap = self

        def recv_message(transport: Any) -> bytes:
            data = original_recv(transport)
            tap._received(data, time.perf_counter())
            return data

        def send_text(transport: Any, text: str) -> None:
            if renewals:
                tap._sending(text, time.perf_counter())
            original_send(transport, text)

        def send_texts(transport: Any, texts: Any) -> None:
            if renewals:
                now = time.perf_counter()
                for text in texts:
                    tap._sending(text, now)
            original_send_many(transport, texts)

        Transport.recv_message = recv_message  # type: ignore[method-assign]
        Transport.send_text = send_text  # type: ignore[method-assign]
        Transport.send_texts = send_texts  # type: ignore[method-assign]

    def _received(self, data: bytes, now: float) -> None:
        if b'"task.assign"' in data:
            body = json.loads(data)["body"]
            with self._lock:
                self.assigned.setdefault(body["attempt_id"], now)
        elif self._renewals and b'"lease"' in data:
            frame = json.loads(data)
            with self._lock:
                sent = self._sent.pop(frame.get("reply_to", ""), None)
            lease = frame.get("body", {}).get("lease") or {}
            if sent is None or not lease.get("active"):
                return
            attempt_id, sent_at = sent
            window = _wire_time(lease["lease_until"]) - _wire_time(lease["server_time"])
            deadline = sent_at + window - LEASE_MARGIN
            due = now + min(max(deadline - now, 0.0), max(MIN_RENEW_INTERVAL, (deadline - now) / 2))
            with self._lock:
                self._due[attempt_id] = due

    def _sending(self, text: str, now: float) -> None:
        if '"task.renew"' not in text and '"task.start"' not in text:
            return
        frame = json.loads(text)
        attempt_id = frame["body"]["attempt_id"]
        with self._lock:
            self._sent[frame["message_id"]] = (attempt_id, now)
            if frame["type"] == "task.renew":
                due = self._due.pop(attempt_id, None)
                if due is not None:  # sent before it was due: not late
                    self.lateness.append(max(0.0, now - due))


def _worker(args: argparse.Namespace, capacity: int, listeners: Any = ()) -> Any:
    from orbit_sync import Client, Worker

    return Worker(
        Client(args.url, token=os.environ["ORBIT_BENCH_TOKEN"]),
        queue_id=args.queue_id,
        capacity=capacity,
        handle_signals=False,
        drain_timeout=5.0,
        cancel_grace=1.0,
        flush_timeout=5.0,
        listeners=list(listeners),
        batch_scheduling=args.batch_scheduling,
    )


class Delivered:
    """A listener whose ``done`` is set once *n* finishes were delivered: the lateness run waits
    on it instead of polling ``Worker.stats()``, whose locks (the watchdog's among them) a
    polling thread would hold now and then just as the watchdog wakes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.done = threading.Event()
        self._lock = threading.Lock()

    def attempt_finished(self, event: Any) -> None:
        with self._lock:
            if event.delivered:
                self.n -= 1
            if self.n <= 0:
                self.done.set()


def run_noop(args: argparse.Namespace) -> dict[str, Any]:
    tap = FrameTap(renewals=False) if args.frames else None
    started: dict[str, float] = {}
    count = [0]
    lock = threading.Lock()
    all_ran = threading.Event()
    worker = _worker(args, args.capacity)

    @worker.handler("noop")
    def noop(ctx: Any, payload: Any) -> None:
        if tap is not None:
            started[ctx.attempt_id] = time.perf_counter()
        with lock:
            count[0] += 1
            if count[0] >= args.tasks:
                all_ran.set()

    server_cpu0 = proc_cpu(args.server_pid) if args.server_pid else 0.0
    cpu0, t0 = proc_cpu(), time.perf_counter()
    worker.start()
    ok = all_ran.wait(args.timeout) and wait_succeeded(worker, args.tasks, args.timeout)
    wall = time.perf_counter() - t0
    cpu = proc_cpu() - cpu0
    server_cpu = proc_cpu(args.server_pid) - server_cpu0 if args.server_pid else None
    stats = worker.stats()
    worker.stop(drain=False, timeout=5)
    out: dict[str, Any] = {
        "ok": ok,
        "tasks": stats.succeeded,
        "wall": wall,
        "cpu": cpu,
        "server_cpu": server_cpu,
        "peak_rss": proc_status()["VmHWM"],
    }
    if tap is not None:
        delays = [started[a] - t for a, t in tap.assigned.items() if a in started]
        out["dispatch"] = delays
    return out


def _cpu_bound(ctx: Any, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not ctx.cancelled.is_set():
        sum(range(3000))


def run_lateness(args: argparse.Namespace) -> dict[str, Any]:
    tap = FrameTap(renewals=True)
    delivered = Delivered(args.tasks)
    worker = _worker(args, args.tasks, [delivered])
    running = threading.Barrier(args.tasks + 1)

    @worker.handler("spin")
    def spin(ctx: Any, payload: Any) -> None:
        running.wait()
        _cpu_bound(ctx, args.seconds)

    waiter = FloorWaiter()
    worker.start()
    running.wait(timeout=args.timeout)
    waiter.start()
    ok = delivered.done.wait(args.seconds + args.timeout)
    waiter.stop()
    stats = worker.stats()
    worker.stop(drain=False, timeout=5)
    return {
        "ok": ok,
        "lateness": tap.lateness,
        "floor": waiter.floor,
        "lease_losses": stats.lease_losses,
        "succeeded": stats.succeeded,
    }


def run_idle(args: argparse.Namespace) -> None:
    worker = _worker(args, args.capacity)
    done = [0]
    lock = threading.Lock()
    burst_done = threading.Event()
    target = [0]

    @worker.handler("burst")
    def burst(ctx: Any, payload: Any) -> None:
        time.sleep(0.02)  # long enough that the burst occupies every slot at once
        with lock:
            done[0] += 1
            if done[0] >= target[0]:
                burst_done.set()

    worker.start()
    end = time.monotonic() + args.timeout
    while not worker.stats().connected and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(args.settle)  # let the connection's start-up settle before the idle reading
    before = proc_status()
    emit({"phase": "idle", "rss": before["VmRSS"], "threads": before["Threads"]})
    for command in commands():
        target[0] = int(command["n"])
        ok = burst_done.wait(args.timeout) and wait_succeeded(worker, target[0], args.timeout)
        peak = proc_status()
        # Give idle pool threads the chance to retire, watching for it, up to --retire seconds.
        retire_end = time.monotonic() + args.retire
        while proc_status()["Threads"] > before["Threads"] and time.monotonic() < retire_end:
            time.sleep(0.1)
        after = proc_status()
        emit(
            {
                "ok": ok,
                "peak_threads": peak["Threads"],
                "rss": after["VmRSS"],
                "threads": after["Threads"],
                "waited": args.retire - max(0.0, retire_end - time.monotonic()),
            }
        )
        break
    worker.stop(drain=False, timeout=5)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["noop", "lateness", "idle"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue-id", required=True)
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--retire", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--server-pid", type=int, default=0)
    parser.add_argument("--frames", action="store_true")
    parser.add_argument("--batch-scheduling", action="store_true")
    args = parser.parse_args()
    if args.mode == "noop":
        emit(run_noop(args))
    elif args.mode == "lateness":
        emit(run_lateness(args))
    else:
        run_idle(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
