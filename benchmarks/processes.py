"""The ``processes`` section of ``make bench``: ``orbit-sync worker --processes 2`` against
``--processes 1`` in the same run, the mock server in its own process.

For each handler (``noop``: the worker's own cost per task; ``spin``: a few ms of Python CPU,
the work a second process is for) and each process count, a fresh server holds the tasks; the
supervisor starts, its children connect, then each handler's tasks in turn are enqueued and
drained. Figures: tasks per second (from the enqueue to the last SUCCEEDED), CPU per task of the
supervisor and its children together (``/proc``, every thread), and the RSS of each idle child
before the first handler's run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from benchmarks import _server_proc
from benchmarks._common import ROOT, child_env, proc_cpu, proc_status

#: Tasks per handler: (full run, quick run).
TASKS = {"noop": (4000, 200), "spin": (1200, 60)}


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def run_handlers(
    handlers: list[tuple[str, int]], processes: int, settle: float = 1.0
) -> dict[str, dict[str, Any]]:
    """One supervisor with *processes* children draining, handler after handler, *n* tasks of
    each ``(handler, n)`` of *handlers*, on a server of its own (even in quick mode: no task of
    another section may be waiting there). One start for every handler: the figures are taken
    from the enqueue of a handler's tasks to the last of them SUCCEEDED."""
    server, info = _server_proc.start()
    env = {
        **child_env(),
        "ORBIT_URL": info["url"],
        "ORBIT_TOKEN": info["token"],
        "ORBIT_QUEUE_ID": info["queue_id"],
    }
    argv = [sys.executable, "-m", "orbit_sync", "worker", "benchmarks._supervised_bench:make"]
    argv += ["--processes", str(processes)]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    results: dict[str, dict[str, Any]] = {}
    ok = True
    try:
        if not server.send({"op": "sessions", "n": processes, "timeout": 60})["ok"]:
            raise RuntimeError("the worker processes did not connect")
        time.sleep(settle)  # imports done, first capacity reports answered
        children = _children(proc.pid)
        idle_rss = [proc_status(pid)["VmRSS"] for pid in children]
        pids = [proc.pid, *children]
        for handler, tasks in handlers:
            cpu0, t0 = sum(proc_cpu(pid) for pid in pids), time.perf_counter()
            server.send({"op": "enqueue", "n": tasks, "handler": handler})
            ok = server.send({"op": "done", "timeout": 600})["ok"]
            wall, cpu = time.perf_counter() - t0, sum(proc_cpu(pid) for pid in pids) - cpu0
            results[handler] = {
                "handler": handler,
                "processes": processes,
                "tasks": tasks,
                "wall": wall,
                "cpu": cpu,
                "per_s": tasks / wall,
                "per_task": cpu / tasks,
                "idle_rss": idle_rss,
                "supervisor_rss": proc_status(proc.pid)["VmRSS"],
            }
            if not ok:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        server.close()
    if not ok or proc.returncode != 0:
        raise RuntimeError(f"run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return results


def bench_processes(servers: Any, o: dict[str, Any], out: dict[str, Any]) -> list[dict[str, Any]]:
    from benchmarks.run import row

    quick = not o["peers"]
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    handlers = [(handler, small if quick else full) for handler, (full, small) in TASKS.items()]
    settle = 0.2 if quick else 1.0
    runs = {n: run_handlers(handlers, n, settle) for n in (1, 2)}
    for handler, _ in handlers:
        one, two = runs[1][handler], runs[2][handler]
        results[handler] = {"1": one, "2": two}
        rows.append(
            row(
                f"{handler}: tasks/s, --processes 2 vs 1",
                two["per_s"],
                one["per_s"],
                "/s",
                higher_is_better=True,
            )
        )
        rows.append(
            row(f"{handler}: CPU/task, --processes 2 vs 1", two["per_task"], one["per_task"], "us")
        )
    two = results["noop"]["2"]
    rows.append(
        row(
            "idle RSS per child vs supervisor",
            max(two["idle_rss"]),
            two["supervisor_rss"],
            "MB",
            note="children: " + ", ".join(f"{r / 1e6:.1f} MB" for r in two["idle_rss"]),
        )
    )
    out["processes"] = results
    return rows
