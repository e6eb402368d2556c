"""``make bench``: every figure against a baseline measured in the same run, targets beside them.

Run ``make bench`` (it sets up ``benchmarks/.venv`` with the peers and Debian's redis-server
first, see ``benchmarks/setup_env.py``), or ``python benchmarks/run.py --quick`` for a small run
without peers that checks the harness itself (tests/test_bench_harness.py runs it). The mock
server always runs in its own process; our Worker and each peer run in theirs, measured from
inside (process CPU time of every thread, peak RSS). Prints one table and writes
``benchmarks/results.json``.

Sections:

- codec: our strict decode / encode against ``json.loads`` / ``json.dumps`` of the same frames;
  reading a server frame with our frame path against websocket-client's own codec
  (``frame_buffer``/``ABNF`` over one buffered read, :mod:`benchmarks.frames_cpu`), and what the
  difference is per no-op task;
- call overhead: ``conn.renew()`` against a bare websocket-client round trip of the same frame to
  the same server, 1 thread, and 32 threads (one connection) against 32 raw sockets; with 1
  thread taking turns call by call (the target's figure, the median of three sets: each side
  then finds the machine's CPU idle states and thread placement as the other left them), in
  turns of 50 calls, and in alternating halves of the run (a back-to-back loop on one thread
  keeps a core warm); the design's hand-off alone (a bare websocket-client session whose reader
  thread hands each answer to the caller through an ``Event``, no SDK code) in turns against the
  raw loop and against ours; and once more in turns with the client's threads on one CPU and the
  server's on another ("placed", Linux with 2+ CPUs), which takes the cost of waking a thread on
  a halted CPU out of both sides;
- worker: CPU per task, tasks/s and peak RSS draining no-op tasks with ``Worker(capacity=32)``,
  against Dramatiq 2 (``-p 1 -t 32``; pure no-op, the target's figure, and one Redis INCR per
  task) and Celery 5 (``--pool threads -c 32``, ``acks_late``) in the same run; ours and
  Dramatiq's no-op run in five rounds taken in turns, and each side's median round counts;
- dispatch latency: an assignment frame leaving the frame reader to the handler's first line
  (it includes the ``start`` round trip), against the raw round trip;
- renewal lateness: p99 with 8 CPU-bound handlers and a 2 s lease, against a bare
  ``Event.wait`` thread in the same process (the floor), in three rounds of which the median
  ratio counts (one in ``--quick``); lease losses over all rounds;
- idle: RSS and threads of ``Worker(capacity=256)`` before and after a burst;
- mock server: its CPU per task against the worker's with 1,000 and 100,000 tasks waiting
  (flatness), enqueue through the admin API, RSS after 10^5 and 10^6 requests;
- processes: ``orbit-sync worker --processes 2`` against ``--processes 1`` (tasks/s and CPU per
  task, no-op and CPU-bound handlers) and the idle RSS of each child
  (:mod:`benchmarks.processes`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from benchmarks import _server_proc, frames_cpu, mockserver, roundtrip
from benchmarks._common import HERE, ROOT, Child, percentile
from benchmarks.processes import bench_processes
from orbit_sync import _codec
from orbit_sync.models import (
    AttemptRef,
    Capability,
    Finish,
    Outcome,
    Registration,
    new_secret,
)

VECTORS = json.loads((ROOT / "tests" / "vectors" / "frames.json").read_text())

FULL = {
    "rounds": 2000,
    "threads": 32,
    "tasks": 5000,
    "dispatch_tasks": 1000,
    "spin_seconds": 12.0,
    "idle_capacity": 256,
    "burst": 2000,
    "retire": 30.0,
    "flat_drained": 2000,
    "flat_waiting": (1000, 100_000),
    "flat_timeout": 120.0,
    "admin_n": 100_000,
    "admin_per_task": 2000,
    "memory_marks": [100_000, 1_000_000],
    "peers": True,
    "profile": True,
}
QUICK = {
    "rounds": 40,
    "threads": 4,
    "tasks": 60,
    "dispatch_tasks": 0,  # taken from the no-op run
    "spin_seconds": 1.0,
    "idle_capacity": 8,
    "burst": 40,
    "retire": 0.2,
    "flat_drained": 10,
    "flat_waiting": (20, 200),
    "flat_timeout": 30.0,
    "admin_n": 200,
    "admin_per_task": 5,
    "memory_marks": [100, 300],
    "peers": False,
    "profile": False,
}


# --------------------------------------------------------------------------- table rows


def row(
    name: str,
    ours: float,
    base: float,
    unit: str,
    *,
    target: float | None = None,
    higher_is_better: bool = False,
    absolute: bool = False,
    note: str = "",
) -> dict[str, Any]:
    """One line of the table; the ratio is always ours / baseline.

    The target applies to the ratio, or with *absolute* to our figure itself (in *unit*).
    """
    ratio = ours / base if base else float("nan")
    verdict = None
    if target is not None:
        value = ours * _SCALE[unit] if absolute else ratio
        verdict = value >= target if higher_is_better else value <= target
    return {
        "name": name,
        "ours": ours,
        "base": base,
        "unit": unit,
        "ratio": ratio,
        "target": None
        if target is None
        else (">= " if higher_is_better else "<= ")
        + f"{target:g}"
        + (f" {unit}" if absolute and unit != "n" else ""),
        "pass": verdict,
        "note": note,
    }


_SCALE = {"us": 1e6, "ms": 1e3, "s": 1.0, "MB": 1 / 1e6, "/s": 1.0, "n": 1.0}


def _fmt(value: float, unit: str) -> str:
    if value != value:
        return "n/a"
    scaled = value * _SCALE[unit]
    text = f"{scaled:,.0f}" if abs(scaled) >= 100 else f"{scaled:.3g}"
    return f"{text} {unit}" if unit != "n" else text


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'figure':<46}{'ours':>13}{'baseline':>13}{'ratio':>8}  {'target':<10}{'':<5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        verdict = "" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        ratio = "n/a" if r["ratio"] != r["ratio"] else f"{r['ratio']:.2f}"
        lines.append(
            f"{r['name']:<46}{_fmt(r['ours'], r['unit']):>13}{_fmt(r['base'], r['unit']):>13}"
            f"{ratio:>8}  {r['target'] or '':<10}{verdict:<5}"
        )
        if r["note"]:
            lines.append(f"    {r['note']}")
    return "\n".join(line.rstrip() for line in lines)


# --------------------------------------------------------------------------- codec


def _per_call(fn: Callable[[], object], *, repeat: int, number: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def bench_codec(quick: bool) -> list[dict[str, Any]]:
    """Strict decode of start acks (times vary per frame) and encoding of a finish."""
    repeat, number = (2, 50) if quick else (7, 2000)
    frame = next(v for v in VECTORS["server_to_client"] if v["name"] == "ack-start-ok")["frame"]
    frames = [
        frame.replace("08:00:30Z", f"08:00:30.{i:06d}Z")
        .replace("08:00:00Z", f"08:00:00.{i:06d}Z")
        .encode()
        for i in range(2000)
    ]
    ctx = VECTORS["context"]
    reg = Registration(ctx["queue_id"], [Capability(**c) for c in ctx["capabilities"]], 4)
    session = _codec.SessionContext(ctx["session_id"], 2, reg)
    pending = dict.fromkeys(ctx["pending_message_ids"], "task.start").get
    it = itertools.cycle(frames)
    dec = _per_call(
        lambda: _codec.decode_server_frame(next(it), session, pending), repeat=repeat, number=number
    )
    dec_base = _per_call(lambda: json.loads(next(it)), repeat=repeat, number=number)

    ref = AttemptRef("1" * 32, "2" * 32, 3, new_secret())
    finish = Finish(ref, Outcome.SUCCEEDED, {"rows": list(range(50)), "ok": True})
    as_dict = {
        "protocol_version": "1",
        "type": "task.finish",
        "message_id": "4" * 32,
        "session_id": "3" * 32,
        "body": _codec.unstructure(finish),
    }
    enc = _per_call(
        lambda: _codec.encode_request("task.finish", "4" * 32, "3" * 32, finish),
        repeat=repeat,
        number=number,
    )
    enc_base = _per_call(lambda: json.dumps(as_dict), repeat=repeat, number=number)
    ours, theirs = frames_cpu.frame_cpu(rounds=3 if quick else 7, tasks=50 if quick else 2000)
    per_task = len(frames_cpu.FRAMES_PER_TASK)
    return [
        row("decode start ack vs json.loads", dec, dec_base, "us"),
        row("encode finish vs json.dumps", enc, enc_base, "us"),
        row(
            "read a server frame vs websocket-client ABNF",
            ours,
            theirs,
            "us",
            note=f"worker CPU per no-op task ({per_task} server frames) with websocket-client's "
            f"codec: {(theirs - ours) * per_task * 1e6:+.1f} us",
        ),
    ]


# --------------------------------------------------------------------------- processes


class Servers:
    """Mock server processes: a fresh one per section, or one shared by all in quick mode."""

    def __init__(self, shared: bool) -> None:
        self._shared: tuple[Child, dict[str, Any]] | None = None
        if shared:
            # A 2 s lease serves every section, the renewal one included.
            self._shared = _server_proc.start(lease_duration=2.0)

    def open(self, lease: float = 30.0) -> tuple[Child, dict[str, Any]]:
        return self._shared or _server_proc.start(lease_duration=lease)

    def done(self, server: Child) -> None:
        if self._shared is None or server is not self._shared[0]:
            server.close()

    def close(self) -> None:
        if self._shared is not None:
            self._shared[0].close()


def worker_child(
    info: dict[str, Any], mode: str, *extra: str, prefix: list[str] | None = None
) -> Child:
    """Our worker process (:mod:`benchmarks._worker_proc`); the token goes in its environment."""
    args = [
        str(HERE / "_worker_proc.py"),
        mode,
        "--url",
        info["url"],
        "--queue-id",
        info["queue_id"],
        *extra,
    ]
    if prefix:
        return Child([*prefix[1:], sys.executable, *args], python=prefix[0], env=_token_env(info))
    return Child(args, env=_token_env(info))


def _token_env(info: dict[str, Any]) -> dict[str, str]:
    return {"ORBIT_BENCH_TOKEN": info["token"]}


def run_noop(
    server: Child,
    info: dict[str, Any],
    tasks: int,
    timeout: float,
    *,
    frames: bool = False,
    capacity: int = 32,
    batch_scheduling: bool = False,
) -> dict[str, Any]:
    extra = ["--tasks", str(tasks), "--capacity", str(capacity), "--timeout", str(timeout)]
    if batch_scheduling:
        extra.append("--batch-scheduling")
    extra += ["--server-pid", str(server.pid)]
    if frames:
        extra.append("--frames")
    with worker_child(info, "noop", *extra) as child:
        return child.read()


# --------------------------------------------------------------------------- sections


def _p50_ratio(sides: dict[str, Any]) -> float:
    base = sides["base"]["p50"]
    return float(sides["ours"]["p50"] / base) if base else float("nan")


def _p50_p99_rows(
    label: str, sides: dict[str, Any], *, target: float | None = None, note: str = ""
) -> list[dict[str, Any]]:
    """The p50 row (with *target* and *note*) and the p99 row of one comparison."""
    return [
        row(
            f"renew p50, {label}",
            sides["ours"]["p50"],
            sides["base"]["p50"],
            "us",
            target=target,
            note=note,
        ),
        row(f"renew p99, {label}", sides["ours"]["p99"], sides["base"]["p99"], "us"),
    ]


def _sets(turns: dict[str, Any]) -> str:
    """The p50 ratios of every set of a comparison taken in turns, for its note."""
    ratios = turns["ratios"]
    return f"{len(ratios)} sets ({'/'.join(f'{r:.2f}' for r in ratios)}x)"


def bench_calls(servers: Servers, o: dict[str, Any], out: dict[str, Any]) -> list[dict[str, Any]]:
    server, info = servers.open(lease=60.0)
    try:
        r = roundtrip.bench(server, info, rounds=o["rounds"], threads=o["threads"])
    finally:
        servers.done(server)
    out["calls"] = r
    one, turns, many = r["one"], r["one_mixed"], r["many"]
    n = many["threads"]
    halves, in_blocks = (_p50_ratio(one), _p50_ratio(r["one_blocks"]))
    # Placed: the client on one CPU and the server on another (Linux, 2+ CPUs), the same code
    # and target without the machine's cost of waking threads on idle CPUs.
    placed = r.get("one_placed")
    return [
        # The two sides take turns call by call: each sample of one side finds the machine (CPU
        # idle states, thread placement) as the other left it. Measured in halves of the run, a
        # raw loop running back to back keeps a core warm and the ratio mostly measures that.
        *_p50_p99_rows(
            "1 thread vs raw round trip",
            turns,
            target=1.4,
            note=(
                f"sides taking turns per call, median of {_sets(turns)}; in turns of "
                f"{roundtrip.BLOCK} calls: {in_blocks:.2f}x; in halves of the run: {halves:.2f}x"
            ),
        ),
        # The design's hand-off with no SDK code (a bare session's reader thread handing each
        # answer over through an Event): the share of the gap any reader thread costs, and ours
        # against it.
        *_p50_p99_rows(
            "1 thread, hand-off alone vs raw",
            r["hand_off"],
            note=(
                "a bare websocket-client session whose reader thread hands each answer to the "
                f"caller through an Event; in turns, median of {_sets(r['hand_off'])}"
            ),
        ),
        *_p50_p99_rows(
            "1 thread vs the hand-off alone",
            r["vs_hand_off"],
            note=f"in turns, median of {_sets(r['vs_hand_off'])}",
        ),
        *(
            _p50_p99_rows(
                "1 thread vs raw, placed",
                placed,
                target=1.4,
                note=(
                    "client threads on one CPU, server on another; sides taking turns per call, "
                    f"median of {_sets(placed)}"
                ),
            )
            if placed is not None
            else []
        ),
        *_p50_p99_rows(f"{n} threads vs {n} raw sockets", many),
        row(
            f"renews/s, {n} threads vs {n} raw sockets",
            many["ours"]["per_s"],
            many["base"]["per_s"],
            "/s",
            higher_is_better=True,
        ),
    ]


#: Rounds of our worker and of Dramatiq's no-op worker, taken in turns; each side's median
#: round is reported, so a burst of other load on the host moves one round, not the ratio
#: (Dramatiq's CPU per task moves 2x with the host's load, ours less: five rounds, not three).
WORKER_ROUNDS = 5


def _our_noop_run(
    servers: Servers, tasks: int, frames: bool, batch_scheduling: bool = False
) -> dict[str, Any]:
    server, info = servers.open()
    try:
        server.send({"op": "enqueue", "n": tasks, "handler": "noop"})
        ours = run_noop(server, info, tasks, 600, frames=frames, batch_scheduling=batch_scheduling)
    finally:
        servers.done(server)
    return _figures(ours, tasks, "our worker")


def _figures(run: dict[str, Any], tasks: int, name: str) -> dict[str, Any]:
    """Check that *run* finished its *tasks*; add its CPU per task and tasks per second."""
    if not run["ok"]:
        done = f" ({run['tasks']} done)" if "tasks" in run else ""
        raise RuntimeError(f"{name} did not finish {tasks} tasks{done}")
    run["per_task"] = run["cpu"] / tasks
    run["per_s"] = tasks / run["wall"]
    return run


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median CPU per task (its other figures come with it)."""
    return sorted(runs, key=lambda r: float(r["per_task"]))[len(runs) // 2]


def bench_worker(servers: Servers, o: dict[str, Any], out: dict[str, Any]) -> list[dict[str, Any]]:
    tasks = o["tasks"]
    rows: list[dict[str, Any]] = []
    if not o["peers"]:
        ours = _our_noop_run(servers, tasks, frames=True)
        out["worker"] = {k: v for k, v in ours.items() if k != "dispatch"}
        rows.append(
            row("worker CPU/task (no peers in --quick)", ours["per_task"], float("nan"), "us")
        )
        if "dispatch" in ours:
            out["dispatch_samples"] = ours["dispatch"]
        return rows
    from benchmarks.peers import driver

    mine: list[dict[str, Any]] = []
    batched: list[dict[str, Any]] = []
    noops: list[dict[str, Any]] = []
    peers: dict[str, dict[str, Any]] = {}
    with driver.redis_server() as url:
        for _ in range(WORKER_ROUNDS):
            mine.append(_our_noop_run(servers, tasks, frames=False))
            noops.append(_figures(driver.dramatiq(url, tasks, "noop"), tasks, "Dramatiq no-op"))
            # The opt-in SCHED_BATCH policy (docs/deploy.md, "Scheduling policy"), in turns.
            batched.append(_our_noop_run(servers, tasks, frames=False, batch_scheduling=True))
        incr = driver.dramatiq(url, tasks, "incr")
        peers["Dramatiq INCR"] = _figures(incr, tasks, "Dramatiq INCR")
        peers["Dramatiq no-op"] = _median_run(noops)
        peers["Celery no-op"] = _figures(driver.celery(url, tasks), tasks, "Celery no-op")
    ours = _median_run(mine)
    ours["rounds"] = [r["per_task"] for r in mine]
    out["worker"] = ours
    peers["Dramatiq no-op"]["rounds"] = [p["per_task"] for p in noops]
    out["peers"] = peers
    for name, p in peers.items():
        # The target: no more CPU per task than Dramatiq spends on the same no-op task.
        turns = name == "Dramatiq no-op"
        note = ""
        if turns:
            mine_us = "/".join(f"{r * 1e6:.0f}" for r in ours["rounds"])
            them_us = "/".join(f"{r * 1e6:.0f}" for r in p["rounds"])
            note = f"median of {WORKER_ROUNDS} rounds in turns: {mine_us} vs {them_us} us"
        rows.append(
            row(
                f"worker CPU/task vs {name}",
                ours["per_task"],
                p["per_task"],
                "us",
                target=1.0 if turns else None,
                note=note,
            )
        )
    batch = _median_run(batched)
    rows.append(
        row(
            "worker CPU/task, batch_scheduling=True vs default",
            batch["per_task"],
            ours["per_task"],
            "us",
            note="median of {} rounds in turns: {} vs {} us".format(
                WORKER_ROUNDS,
                "/".join(f"{r['per_task'] * 1e6:.0f}" for r in batched),
                "/".join(f"{r * 1e6:.0f}" for r in ours["rounds"]),
            ),
        )
    )
    for name, p in peers.items():
        rows.append(
            row(f"tasks/s vs {name}", ours["per_s"], p["per_s"], "/s", higher_is_better=True)
        )
    for name, p in peers.items():
        rows.append(row(f"peak RSS vs {name}", ours["peak_rss"], p["peak_rss"], "MB"))
    return rows


def bench_dispatch(
    servers: Servers, o: dict[str, Any], out: dict[str, Any]
) -> list[dict[str, Any]]:
    delays = out.pop("dispatch_samples", None)
    if delays is None:
        server, info = servers.open()
        try:
            server.send({"op": "enqueue", "n": o["dispatch_tasks"], "handler": "noop"})
            delays = run_noop(server, info, o["dispatch_tasks"], 300, frames=True)["dispatch"]
        finally:
            servers.done(server)
    if not delays:
        raise RuntimeError("no dispatch latency sample: the frame tap saw no assignment")
    nan = float("nan")
    base = out["calls"]["one"]["base"] if "calls" in out else {"p50": nan, "p99": nan}
    out["dispatch"] = {
        "p50": percentile(delays, 50),
        "p99": percentile(delays, 99),
        "n": len(delays),
    }
    note = "includes the start round trip; baseline: one raw renew round trip"
    return [
        row(
            "dispatch latency p50 vs raw round trip p50",
            out["dispatch"]["p50"],
            base["p50"],
            "us",
            note=note,
        ),
        row(
            "dispatch latency p99 vs raw round trip p99", out["dispatch"]["p99"], base["p99"], "us"
        ),
    ]


#: Rounds of the renewal lateness run: its p99 is the worst one or two of about 100 renewals
#: on each side, so one hiccup of the host moves a round by 3x; the median round counts.
LATENESS_ROUNDS = 3


def _lateness_round(servers: Servers, o: dict[str, Any]) -> dict[str, Any]:
    server, info = servers.open(lease=2.0)
    try:
        server.send({"op": "enqueue", "n": 8, "handler": "spin"})
        extra = ["--tasks", "8", "--seconds", str(o["spin_seconds"]), "--timeout", "60"]
        with worker_child(info, "lateness", *extra) as child:
            r = child.read()
    finally:
        servers.done(server)
    late, floor = r["lateness"], r["floor"]
    p99, floor_p99 = percentile(late, 99), percentile(floor, 99)
    return {
        "p50": percentile(late, 50),
        "p99": p99,
        "max": max(late, default=float("nan")),
        "n": len(late),
        "floor_p50": percentile(floor, 50),
        "floor_p99": floor_p99,
        "floor_n": len(floor),
        "ratio": p99 / floor_p99 if floor_p99 else float("nan"),
        "lease_losses": r["lease_losses"],
        "succeeded": r["succeeded"],
    }


def bench_lateness(
    servers: Servers, o: dict[str, Any], out: dict[str, Any]
) -> list[dict[str, Any]]:
    runs = [_lateness_round(servers, o) for _ in range(LATENESS_ROUNDS if o["peers"] else 1)]
    lat = dict(sorted(runs, key=lambda r: float(r["ratio"]))[len(runs) // 2])
    lat["rounds"] = [r["ratio"] for r in runs]
    lat["lease_losses"] = sum(r["lease_losses"] for r in runs)
    out["lateness"] = lat
    note = f"{lat['n']} renewals; baseline: bare Event.wait thread, {lat['floor_n']} wakes"
    if len(runs) > 1:
        ratios = "/".join(f"{r:.2f}" for r in lat["rounds"])
        note = f"median of {len(runs)} rounds ({ratios}x); {note}"
    return [
        row(
            "renewal lateness p99 (8 CPU-bound, 2 s lease)",
            lat["p99"],
            lat["floor_p99"],
            "ms",
            target=0.5,
            note=note,
        ),
        row(
            f"lease losses (8 CPU-bound, 2 s lease{', all rounds' if len(runs) > 1 else ''})",
            lat["lease_losses"],
            float("nan"),
            "n",
            target=0,
            absolute=True,
        ),
    ]


def bench_idle(servers: Servers, o: dict[str, Any], out: dict[str, Any]) -> list[dict[str, Any]]:
    server, info = servers.open()
    cap = o["idle_capacity"]
    try:
        extra = ["--capacity", str(cap), "--retire", str(o["retire"]), "--timeout", "120"]
        extra += ["--settle", "1.0" if o["peers"] else "0.1"]
        with worker_child(info, "idle", *extra) as child:
            before = child.read()
            server.send({"op": "enqueue", "n": o["burst"], "handler": "burst"})
            after = child.send({"n": o["burst"]})
    finally:
        servers.done(server)
    out["idle"] = {"before": before, "after": after, "capacity": cap}
    return [
        row(f"idle RSS after/before burst, capacity {cap}", after["rss"], before["rss"], "MB"),
        row(
            f"idle threads after/before burst, capacity {cap}",
            after["threads"],
            before["threads"],
            "n",
            target=1.1,
            note=f"peak {after['peak_threads']} threads in the burst; read "
            f"{after['waited']:.1f} s after it (idle pool threads retire)",
        ),
    ]


def bench_server_cpu(
    servers: Servers, o: dict[str, Any], out: dict[str, Any]
) -> list[dict[str, Any]]:
    def drain(server: Child, info: dict[str, Any], n: int, timeout: float) -> dict[str, Any]:
        return run_noop(server, info, n, timeout)

    flat = {}
    for waiting in o["flat_waiting"]:
        flat[waiting] = mockserver.cpu_flatness(
            drain, waiting, o["flat_drained"], o["flat_timeout"], servers
        )
    low, high = (flat[w] for w in o["flat_waiting"])
    out["server_cpu"] = {str(k): v for k, v in flat.items()}
    lw, hw = o["flat_waiting"]
    partial = [
        f"{w:,} waiting: {f['tasks']} of {o['flat_drained']} drained in the time limit"
        for w, f in flat.items()
        if not f["ok"]
    ]
    return [
        row(
            f"server CPU/task vs worker's, {lw:,} waiting",
            low["server_per_task"],
            low["worker_per_task"],
            "us",
            target=1.0,
        ),
        row(
            f"server CPU/task vs worker's, {hw:,} waiting",
            high["server_per_task"],
            high["worker_per_task"],
            "us",
            target=1.0,
            note="; ".join(partial),
        ),
        row(
            f"server CPU/task, {hw:,} vs {lw:,} waiting (flat)",
            high["server_per_task"],
            low["server_per_task"],
            "us",
            target=1.25,
        ),
    ]


def bench_admin(servers: Servers, o: dict[str, Any], out: dict[str, Any]) -> list[dict[str, Any]]:
    admin = mockserver.admin_enqueue(o["admin_n"], o["admin_per_task"], servers)
    out["admin_enqueue"] = admin
    note = (
        f"bulk endpoint, {admin['count']:,} tasks"
        if admin["bulk"]
        else f"no bulk endpoint: per-task endpoint on {admin['count']:,} tasks, extrapolated"
    )
    scale = o["admin_n"] / admin["count"]
    return [
        row(
            f"admin enqueue of {o['admin_n']:,} vs Python API",
            admin["seconds"] * scale,
            admin["base_seconds"] * scale,
            "s",
            target=60 * o["admin_n"] / 100_000,
            absolute=True,
            note=note + " (target: seconds, not minutes)",
        ),
        row(
            f"admin list of {admin['listed']:,} tasks vs Python API",
            admin["list_seconds"],
            admin["list_base_seconds"],
            "s",
            note="every page, AdminClient.tasks()"
            + (
                f"; one page of 1,000: {admin['page_seconds'] * 1000:.0f} ms"
                if admin["page_seconds"] is not None
                else "; no pagination: one GET /tasks"
            ),
        ),
    ]


def bench_memory(servers: Servers, o: dict[str, Any], out: dict[str, Any]) -> list[dict[str, Any]]:
    memory = mockserver.memory_under_load(o["memory_marks"], servers)
    out["server_memory"] = memory
    m1, m2 = (memory["marks"][str(m)] for m in o["memory_marks"])
    return [
        row(
            f"server RSS after {o['memory_marks'][1]:,} vs {o['memory_marks'][0]:,} requests",
            m2,
            m1,
            "MB",
            target=1.1,
            note=f"idle {memory['idle_rss'] / 1e6:.0f} MB; {memory['errors']} error answers; "
            f"{memory['seconds']:.0f} s",
        ),
    ]


# --------------------------------------------------------------------------- profile


def profile_worker(o: dict[str, Any], out: dict[str, Any], top: int = 12) -> list[str]:
    """py-spy over a no-op run of our worker (not the measured one), samples holding the GIL only:
    the top functions by own time, and our functions by inclusive time."""
    py_spy = Path(sys.executable).parent / "py-spy"
    if not py_spy.exists():
        return ["(py-spy is not installed in this venv: no profile)"]
    server, info = _server_proc.start()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "profile.txt"
        try:
            server.send({"op": "enqueue", "n": o["tasks"], "handler": "noop"})
            prefix = [str(py_spy), "record", "--format", "raw", "--rate", "250", "--gil"]
            prefix += ["--nonblocking", "-o", str(raw), "--"]
            with worker_child(info, "noop", "--tasks", str(o["tasks"]), prefix=prefix) as child:
                child.read()
        except RuntimeError as exc:
            return [f"(py-spy failed: {str(exc).splitlines()[-1] if str(exc) else exc})"]
        finally:
            server.close()
        if not raw.exists():
            return ["(py-spy wrote no profile)"]
        own: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        total = 0
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            if "importlib._bootstrap" in stack:
                continue  # start-up imports, not the work per task
            frames = [_short(f) for f in stack.split(";") if f.strip(" ()")]
            if not frames:
                continue
            total += int(count)
            own[frames[-1]] += int(count)
            for name in set(frames):
                if "orbit_sync" in name:
                    inclusive[name] += int(count)
    if not total:
        return ["(py-spy recorded no sample)"]
    out["profile"] = {
        "samples": total,
        "own": [{"function": f, "share": n / total} for f, n in own.most_common(top)],
        "inclusive": [{"function": f, "share": n / total} for f, n in inclusive.most_common(top)],
    }
    lines = [f"{total} samples holding the GIL (imports left out); own time:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in own.most_common(top)]
    lines += ["orbit_sync functions, inclusive time:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in inclusive.most_common(top)]
    return lines


def _short(frame: str) -> str:
    """``fn (path/to/pkg/module.py:12)`` -> ``fn (pkg/module.py)``: lines change, functions do
    not; ``orbit_sync`` modules keep their package path."""
    name, _, where = frame.partition(" (")
    parts = Path(where.split(":")[0].rstrip(")")).parts
    parts = parts[parts.index("orbit_sync") :] if "orbit_sync" in parts else parts[-2:]
    return f"{name} ({'/'.join(parts)})"


# --------------------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory": mem,
        "python": platform.python_version(),
        "system": platform.platform(),
        "load_before": os.getloadavg()[0],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _commit(),
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


Section = Callable[[Servers, dict[str, Any], dict[str, Any]], list[dict[str, Any]]]

SECTIONS: dict[str, Section] = {
    "calls": bench_calls,
    "worker": bench_worker,
    "dispatch": bench_dispatch,
    "lateness": bench_lateness,
    "idle": bench_idle,
    "server-cpu": bench_server_cpu,
    "admin": bench_admin,
    "memory": bench_memory,
    "processes": bench_processes,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, no peers (seconds)")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")
    parser.add_argument(
        "--only",
        default="",
        metavar="A,B",
        help=f"run only these sections ({', '.join(SECTIONS)}, profile)",
    )
    parser.add_argument(
        "--output", type=Path, default=HERE / "results.json", help="where to write the JSON"
    )
    args = parser.parse_args(argv)
    only = {name for name in args.only.split(",") if name}
    unknown = only - set(SECTIONS) - {"profile", "codec"}
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    o = QUICK if args.quick else FULL
    out: dict[str, Any] = {"mode": "quick" if args.quick else "full", "machine": machine()}
    rows = bench_codec(args.quick) if not only or "codec" in only else []

    def save(complete: bool) -> None:
        # Written after every section, so a long run that is stopped keeps what it measured.
        out["rows"], out["complete"] = rows, complete
        args.output.write_text(json.dumps(out, indent=1, default=str) + "\n")

    servers = Servers(shared=args.quick)
    try:
        for name, section in SECTIONS.items():
            if only and name not in only:
                continue
            start = time.perf_counter()
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            rows += section(servers, o, out)
            out.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 2)
            save(False)
    finally:
        servers.close()
    profile: list[str] = []
    if (o["profile"] and not args.no_profile and not only) or "profile" in only:
        print("[bench] profile ...", file=sys.stderr, flush=True)
        profile = profile_worker(o, out)
    save(True)
    m = out["machine"]
    print(
        f"\nmake bench ({out['mode']}) on {m['cores']} cores ({m['cpu'] or 'unknown CPU'}), "
        f"Python {m['python']}, load {m['load_before']:.1f} at start, commit "
        f"{m['commit'] or '?'}; ratios are ours / baseline"
    )
    print(table(rows))
    if profile:
        print(f"\nworker profile (py-spy), no-op run of {o['tasks']:,} tasks:")
        print("\n".join(profile))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
