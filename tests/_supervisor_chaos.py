"""The supervisor under abuse: recycling and random SIGKILLs of its children, or a handler that
leaks. Used by ``tests/test_supervisor_chaos.py`` (small runs) and, as a script, by
``make supervisor-chaos`` (the full runs)::

    python tests/_supervisor_chaos.py chaos --tasks 1000 --processes 2 --recycle 50
    python tests/_supervisor_chaos.py leak --tasks 2000 --limit 100

The mock server runs in this process; the supervisor (``orbit-sync worker --processes N``) and
its children in their own. What every run checks:

- chaos: every task ends terminal (SUCCEEDED: retries are allowed, the tasks are idempotent),
  a handler runs at most once per attempt, each SUCCEEDED task stores what its handler returned,
  and no worker process outlives the supervisor;
- leak: every task SUCCEEDED, and the RSS each handler saw after leaking its megabyte stays
  within the limit plus what one child can have in flight past it (its capacity, in MB).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run from a checkout: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orbit_sync.testing import MockOrbitServer, RetrySafety

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"})
APP = Path(__file__).with_name("_supervised_app.py")
_MB = 1024 * 1024
#: RSS that is not the leak: allocator arenas and connection buffers move by a megabyte or two.
#: Without recycling a 400-task run would reach the child's baseline plus 200 MB.
ALLOCATOR_SLACK_MB = 4


def children_of(pid: int) -> set[int]:
    """The live processes whose parent is *pid* (Linux /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.add(int(entry))
    return found


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until *pid* (not our child) has exited; True if it has."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


class Run:
    """One supervisor over the mock server, with the app module in a scratch directory."""

    def __init__(self, server: MockOrbitServer, args: list[str], env: dict[str, str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="orbit-supervisor-"))
        shutil.copy(APP, self.dir / "app.py")
        self.marks = self.dir / "marks"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("ORBIT_")}
        full_env.update(
            ORBIT_URL=server.url,
            ORBIT_TOKEN=server.token,
            ORBIT_QUEUE_ID=server.queue_id,
            APP_MARKS=str(self.marks),
            APP_QUIET="1",
            **env,
        )
        self.log = open(self.dir / "stderr", "w+")  # noqa: SIM115 (closed in stop())
        argv = [sys.executable, "-m", "orbit_sync", "worker", "app:make", *args]
        self.proc = subprocess.Popen(
            argv, cwd=self.dir, env=full_env, stdout=subprocess.DEVNULL, stderr=self.log
        )
        #: Every child pid seen, for the orphan check.
        self.seen: set[int] = set()

    def children(self) -> set[int]:
        now = children_of(self.proc.pid)
        self.seen |= now
        return now

    def runs_per_attempt(self) -> collections.Counter[str]:
        text = self.marks.read_text() if self.marks.exists() else ""
        return collections.Counter(line.split()[0] for line in text.splitlines() if line)

    def stop(self, timeout: float = 60.0) -> tuple[int, str, list[int]]:
        """SIGTERM the supervisor; (its status, its stderr, children still alive after it)."""
        self.children()
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(timeout)
        orphans = [pid for pid in self.seen if not wait_gone(pid, 10.0)]
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        return status, text, orphans

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _server() -> MockOrbitServer:
    """The mock server of a run. The supervisor is under test, not the server's recovery scan:
    the lease of an attempt a killed or recycled child held is recovered as it expires
    (*exact_recovery*), not at the next 2 s scan, so a run does not wait out scan periods."""
    return MockOrbitServer(
        assignment_rate=None, lease_duration=2.0, session_window=6.0, exact_recovery=True
    )


def _enqueue(server: MockOrbitServer, handler: str, n: int) -> list[str]:
    return [
        server.enqueue(
            handler,
            {"n": i},
            max_attempts=100,
            backoff_initial=0.05,
            backoff_max=0.5,
            retry_safety=RetrySafety.IDEMPOTENT,
        )
        for i in range(n)
    ]


def _wait_all(server: MockOrbitServer, ids: list[str], limit: float) -> float:
    started = time.monotonic()
    for task_id in ids:
        try:
            server.wait_for(task_id, TERMINAL, timeout=max(0.0, started + limit - time.monotonic()))
        except TimeoutError:
            break
    return time.monotonic() - started


def _ending(status: int, stderr: str, orphans: list[int]) -> list[str]:
    """What the supervisor's end broke: a process outliving it, a status other than 0."""
    violations = []
    if orphans:
        violations.append(f"worker processes outlived the supervisor: {orphans}")
    if status != 0:
        violations.append(f"supervisor exit status {status}: {stderr[-2000:]}")
    return violations


def chaos(
    *,
    tasks: int,
    processes: int = 2,
    recycle: int = 50,
    kill_every: tuple[float, float] = (1.0, 3.0),
    seed: int = 1,
    delay: float = 0.01,
    time_limit: float = 300.0,
    max_kills: int | None = None,
) -> dict[str, Any]:
    """*tasks* tasks under a supervisor recycling every *recycle* tasks while a random child is
    SIGKILLed every *kill_every* seconds (at most *max_kills* times); the figures and what
    broke."""
    rng = random.Random(seed)
    kills: list[int] = []
    with _server() as server:
        ids = _enqueue(server, "echo", tasks)
        run = Run(
            server,
            ["--processes", str(processes), "--max-tasks-per-child", str(recycle)],
            {"APP_DELAY": str(delay), "APP_CAPACITY": "4", "APP_DRAIN": "5"},
        )
        done = threading.Event()

        def killer() -> None:
            while not done.wait(rng.uniform(*kill_every)):
                # Bounded in the suite's small run: on a slow host a child takes about as long to
                # start as the gap between kills, and the supervisor's crash backoff then grows
                # faster than the run can finish.
                if max_kills is not None and len(kills) >= max_kills:
                    return
                victims = sorted(run.children())
                if victims:
                    victim = rng.choice(victims)
                    os.kill(victim, signal.SIGKILL)
                    kills.append(victim)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        seconds = _wait_all(server, ids, time_limit)
        done.set()
        thread.join()
        status, stderr, orphans = run.stop()
        runs = run.runs_per_attempt()
        run.close()
        snaps = {t.task_id: t for t in server.tasks()}
        server.check_invariants()
    states = collections.Counter(snaps[t].state.value for t in ids)
    succeeded = [t for t in ids if snaps[t].state.value == "SUCCEEDED"]
    wrong = [t for i, t in enumerate(ids) if t in succeeded and snaps[t].result["n"] != i]
    unran = [t for t in succeeded if not any(a.attempt_id in runs for a in snaps[t].attempts)]
    result = {
        "tasks": tasks,
        "seconds": round(seconds, 2),
        "tasks_per_s": round(tasks / seconds, 1) if seconds else 0.0,
        "states": dict(states),
        "kills": len(kills),
        "recycled": stderr.count("recycling this worker process"),
        "restarted": stderr.count("; restarting it in"),
        "attempts": sum(len(s.attempts) for s in snaps.values()),
        "status": status,
    }
    violations = []
    if sum(n for s, n in states.items() if s not in TERMINAL):
        violations.append(f"not terminal: {dict(states)}")
    if states["SUCCEEDED"] != tasks:
        violations.append(f"not all SUCCEEDED: {dict(states)}")
    repeated = [a for a, n in runs.items() if n > 1]
    if repeated:
        violations.append(f"{len(repeated)} attempts ran twice")
    if wrong or unran:
        violations.append(f"{len(wrong)} wrong results, {len(unran)} results without a run")
    result["violations"] = violations + _ending(status, stderr, orphans)
    return result


def leak(
    *, tasks: int, limit: int = 100, processes: int = 2, capacity: int = 2, time_limit: float = 600
) -> dict[str, Any]:
    """*tasks* tasks of a handler that leaks 1 MB each under ``--max-memory-per-child limit``."""
    with _server() as server:
        ids = _enqueue(server, "leak", tasks)
        run = Run(
            server,
            ["--processes", str(processes), "--max-memory-per-child", str(limit)],
            {"APP_CAPACITY": str(capacity)},
        )
        seconds = _wait_all(server, ids, time_limit)
        status, stderr, orphans = run.stop()
        run.close()
        snaps = {t.task_id: t for t in server.tasks()}
    states = collections.Counter(snaps[t].state.value for t in ids)
    rss = [snaps[t].result["rss"] for t in ids if snaps[t].state.value == "SUCCEEDED"]
    pids = {snaps[t].result["pid"] for t in ids if snaps[t].state.value == "SUCCEEDED"}
    # After the attempt that passes the limit the child drains: what it holds (capacity) and
    # what was already on its way to it (capacity again at most) may still leak a megabyte each.
    bound = (limit + 2 * capacity + ALLOCATOR_SLACK_MB) * _MB
    result = {
        "tasks": tasks,
        "seconds": round(seconds, 2),
        "states": dict(states),
        "children": len(pids),
        "max_rss_mb": round(max(rss, default=0) / _MB, 1),
        "bound_mb": bound // _MB,
        "status": status,
    }
    violations = []
    if states["SUCCEEDED"] != tasks:
        violations.append(f"not all SUCCEEDED: {dict(states)}")
    if max(rss, default=0) > bound:
        violations.append(f"a child's RSS reached {result['max_rss_mb']} MB")
    result["violations"] = violations + _ending(status, stderr, orphans)
    return result


def main(argv: list[str] | None = None) -> int:
    """``make supervisor-chaos``: the full runs; prints their figures as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("chaos")
    c.add_argument("--tasks", type=int, default=1000)
    c.add_argument("--processes", type=int, default=2)
    c.add_argument("--recycle", type=int, default=50)
    c.add_argument("--seed", type=int, default=1)
    lk = sub.add_parser("leak")
    lk.add_argument("--tasks", type=int, default=2000)
    lk.add_argument("--limit", type=int, default=100)
    args = parser.parse_args(argv)
    if args.what == "chaos":
        result = chaos(
            tasks=args.tasks, processes=args.processes, recycle=args.recycle, seed=args.seed
        )
    else:
        result = leak(tasks=args.tasks, limit=args.limit)
    print(json.dumps(result))
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
