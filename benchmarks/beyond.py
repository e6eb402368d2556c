"""The process executor and the durable outbox, each against its baseline in the same run.

Run with ``.venv/bin/python benchmarks/beyond.py`` (``--quick`` for a short run; ``make bench``
runs it after ``benchmarks/run.py``).
Each measurement runs a fresh mock server in its own process and our worker in another, so the
worker's GIL is shared with nothing but itself:

- ``lateness``: 8 CPU-bound handlers under a 2 s lease window for ``--seconds``; every renewal's
  lateness (its send past the moment it was due) and a bare ``Event.wait`` thread's lateness in
  the same worker process (the floor), with lease losses. Once with thread handlers, once with
  ``executor="process"`` (8 children). Target: process-mode p99 <= 20 ms, zero losses.
- ``noop``: ``--tasks`` no-op tasks, capacity 8; wall time and worker-process CPU per task with
  thread handlers and with process handlers (2 children), timed after the first 20 (so child
  start-up is not counted): the cost of the process hop.

- ``outbox``: the same no-op run with thread handlers and ``Worker(outbox=...)`` against the
  same without: worker CPU and wall time per task (two fsync'd SQLite transactions per task).

Prints one table and writes ``benchmarks/beyond_results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _server_proc
from benchmarks._common import Child, FloorWaiter, emit, percentile, proc_cpu, wait_succeeded

HERE = Path(__file__).resolve().parent


def spin(ctx: Any, payload: Any) -> None:
    """CPU-bound pure Python until the configured seconds pass (or the context is cancelled)."""
    end = time.monotonic() + float(os.environ["ORBIT_BENCH_SPIN"])
    while time.monotonic() < end and not ctx.cancelled.is_set():
        sum(range(3000))


def noop(ctx: Any, payload: Any) -> None:
    """Nothing at all."""


def child_main(args: argparse.Namespace) -> None:
    """The worker process: one measurement, one JSON line."""
    from benchmarks._worker_proc import FrameTap
    from orbit_sync import Client, Worker

    tap = FrameTap(renewals=True) if args.mode == "lateness" else None
    worker = Worker(
        Client(args.url, token=os.environ["ORBIT_BENCH_TOKEN"]),
        queue_id=args.queue_id,
        capacity=8,
        handle_signals=False,
        drain_timeout=5.0,
        cancel_grace=1.0,
        flush_timeout=5.0,
        process_pool=args.children,
        outbox=args.outbox or None,
    )
    fn = spin if args.mode == "lateness" else noop
    name = "spin" if args.mode == "lateness" else "noop"
    worker.register(name, fn, executor=args.executor)
    waiter = FloorWaiter()
    worker.start()
    waiter.start()
    # The no-op run is timed after a warm-up, so child start-up is not counted per task.
    warm = args.warmup if args.mode == "noop" else 0
    ok = wait_succeeded(worker, warm, args.timeout)
    cpu0, t0 = proc_cpu(), time.perf_counter()
    ok = ok and wait_succeeded(worker, args.tasks, args.timeout)
    wall, cpu = time.perf_counter() - t0, proc_cpu() - cpu0
    waiter.stop()
    stats = worker.stats()
    worker.stop(drain=False, timeout=5)
    emit(
        {
            "ok": ok,
            "wall": wall,
            "cpu": cpu,
            "succeeded": stats.succeeded,
            "timed": stats.succeeded - warm,
            "lease_losses": stats.lease_losses,
            "lateness": tap.lateness if tap is not None else [],
            "floor": waiter.floor,
        }
    )


def measure(
    mode: str, executor: str, *, tasks: int, seconds: float, outbox: str = ""
) -> dict[str, Any]:
    server, info = _server_proc.start(lease_duration=2.0 if mode == "lateness" else 30.0)
    try:
        server.send(
            {"op": "enqueue", "n": tasks, "handler": "spin" if mode == "lateness" else "noop"}
        )
        cmd = [str(HERE / "beyond.py"), "child", mode, "--url", info["url"]]
        cmd += ["--queue-id", info["queue_id"], "--executor", executor, "--tasks", str(tasks)]
        cmd += ["--children", "8" if mode == "lateness" else "2", "--outbox", outbox]
        env = {"ORBIT_BENCH_TOKEN": info["token"], "ORBIT_BENCH_SPIN": str(seconds)}
        with Child(cmd, env=env) as child:
            return child.read()
    finally:
        server.close()


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1000 if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    child = sub.add_parser("child")
    child.add_argument("mode", choices=["lateness", "noop"])
    child.add_argument("--url", required=True)
    child.add_argument("--queue-id", required=True)
    child.add_argument("--executor", choices=["thread", "process"], required=True)
    child.add_argument("--tasks", type=int, required=True)
    child.add_argument("--children", type=int, default=2)
    child.add_argument("--timeout", type=float, default=300.0)
    child.add_argument("--warmup", type=int, default=20)
    child.add_argument("--outbox", default="")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tasks", type=int, default=500)
    args = parser.parse_args(argv)
    if args.command == "child":
        child_main(args)
        return 0
    seconds = 3.0 if args.quick else args.seconds
    tasks = 100 if args.quick else args.tasks
    out: dict[str, Any] = {"seconds": seconds, "tasks": tasks}
    rows = []
    for executor in ("thread", "process"):
        r = measure("lateness", executor, tasks=8, seconds=seconds)
        out[f"lateness_{executor}"] = {
            "p50_ms": _ms(r["lateness"], 50),
            "p99_ms": _ms(r["lateness"], 99),
            "renewals": len(r["lateness"]),
            "floor_p99_ms": _ms(r["floor"], 99),
            "lease_losses": r["lease_losses"],
            "ok": r["ok"],
        }
        lat = out[f"lateness_{executor}"]
        rows.append(
            f"renewal lateness p99, 8 CPU-bound {executor} handlers, 2 s lease: "
            f"{lat['p99_ms']:.1f} ms ({lat['renewals']} renewals; same-process Event.wait floor "
            f"p99 {lat['floor_p99_ms']:.1f} ms; lease losses {lat['lease_losses']})"
        )
    runs = {
        executor: measure("noop", executor, tasks=tasks, seconds=0)
        for executor in ("thread", "process")
    }
    with tempfile.TemporaryDirectory() as scratch:
        outbox = f"{scratch}/outbox.sqlite"
        runs["outbox"] = measure("noop", "thread", tasks=tasks, seconds=0, outbox=outbox)
    for name, r in runs.items():
        out[f"noop_{name}"] = {
            "wall_per_task_us": r["wall"] / max(1, r["timed"]) * 1e6,
            "cpu_per_task_us": r["cpu"] / max(1, r["timed"]) * 1e6,
            "succeeded": r["succeeded"],
            "ok": r["ok"],
        }
    base = out["noop_thread"]
    for name, label in (("process", "process vs thread"), ("outbox", "outbox vs none (threads)")):
        ours = out[f"noop_{name}"]
        wall_ratio = ours["wall_per_task_us"] / base["wall_per_task_us"]
        cpu_ratio = ours["cpu_per_task_us"] / base["cpu_per_task_us"]
        rows.append(
            f"no-op task, {label}: wall {ours['wall_per_task_us']:.0f} vs "
            f"{base['wall_per_task_us']:.0f} us/task ({wall_ratio:.2f}x), worker CPU "
            f"{ours['cpu_per_task_us']:.0f} vs {base['cpu_per_task_us']:.0f} us/task "
            f"({cpu_ratio:.2f}x)"
        )
    proc = out["lateness_process"]
    verdict = "PASS" if proc["p99_ms"] <= 20 and proc["lease_losses"] == 0 else "FAIL"
    rows.append(f"target: process-mode lateness p99 <= 20 ms with zero lease losses: {verdict}")
    print("\n".join(rows))
    (HERE / "beyond_results.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
