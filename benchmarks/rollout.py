"""``make rollout``: what a Kubernetes rolling update of workers costs, measured end to end.

The mock server runs in its own process with tasks that allow one attempt each
(``max_attempts=1``) and a handler that counts its side effects in a file
(``benchmarks/_rollout_app.py``). Then, per mode, *pods* worker pods serve the queue while each
pod in turn is replaced, *rounds* times over: SIGTERM to the old pod, a new one started at once,
the next pod only once the new one's sessions are up (the order of a rolling update with
``maxUnavailable: 0``). A pod is one ``orbit-sync worker`` process (``plain``) or a supervisor
``orbit-sync worker --processes 2 --max-tasks-per-child 50`` (``supervised``: its processes are
also recycled every 50 tasks meanwhile; ``--recycle`` sets that number).

Printed per mode, and checked (exit 1 when one fails):

- every task ``SUCCEEDED`` with exactly one attempt and exactly one side effect, that attempt's;
- no lease expired (no attempt ``EXPIRED`` or ``UNKNOWN``, no result kept only as evidence);
- every pod stopped with exit status 0 (its drain finished everything it held);
- the longest gap without a finish while the restarts went on stays under two lease windows,
  and the restarts happened while tasks were still running.

Usage: ``python benchmarks/rollout.py [--tasks 2000] [--pods 4] [--rounds 3] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _server_proc
from benchmarks._common import ROOT, child_env

#: A worker's log line once its session is up (the pod's readiness, as a probe would see it).
ESTABLISHED = re.compile(r"session \S+ established")
#: Each mode: worker processes per pod and slots per worker process (the same 4 slots per pod in
#: both modes); a supervised pod's processes are recycled every ``--recycle`` tasks.
MODES: dict[str, tuple[int, int]] = {"plain": (1, 4), "supervised": (2, 2)}


class Pod:
    """One pod: its process (a worker, or a supervisor and its workers) and what its standard
    error says, followed on a thread."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        self._cond = threading.Condition()
        self._sessions = 0
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._reader = threading.Thread(target=self._follow, daemon=True)
        self._reader.start()

    def _follow(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self._tail.append(line)
                self._sessions += bool(ESTABLISHED.search(line))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_ready(self, sessions: int, timeout: float) -> bool:
        """Wait until *sessions* sessions of this pod were established; False if it exited or
        *timeout* passed first."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._sessions >= sessions or self.proc.poll() is not None, timeout
            )
            return self._sessions >= sessions

    def stop(self) -> None:
        """SIGTERM: the pod drains and exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """The pod's exit status (killed, and -9, if it did not exit within *timeout*)."""
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self._reader.join(5)
        return status

    def tail(self) -> str:
        with self._cond:
            return "".join(self._tail)


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode's run; its figures and what broke."""
    per_pod, capacity = MODES[mode]
    extra = []
    if mode == "supervised":
        extra = ["--processes", str(per_pod), "--max-tasks-per-child", str(args.recycle)]
    server, ready = _server_proc.start(lease_duration=args.lease)
    tmp = tempfile.TemporaryDirectory(prefix="orbit-rollout-")
    effects = Path(tmp.name) / "effects"
    env = {
        **child_env(),
        "ORBIT_URL": ready["url"],
        "ORBIT_TOKEN": ready["token"],
        "ORBIT_QUEUE_ID": ready["queue_id"],
        "ROLLOUT_EFFECTS": str(effects),
        "ROLLOUT_TASK_SECONDS": str(args.task_seconds),
        "ROLLOUT_CAPACITY": str(capacity),
    }
    argv = [sys.executable, "-m", "orbit_sync", "--log-level", "INFO", "worker"]
    argv += ["benchmarks._rollout_app:make", *extra]
    pods = [Pod(argv, env) for _ in range(args.pods)]
    retired: list[Pod] = []
    windows: list[tuple[float, float]] = []
    problems: list[str] = []
    try:
        for pod in pods:
            if not pod.wait_ready(per_pod, 60):
                raise RuntimeError(f"a {mode} pod never became ready:\n{pod.tail()}")
        server.send(
            {
                "op": "enqueue",
                "n": args.tasks,
                "handler": "rollout",
                "options": {"max_attempts": 1},
            }
        )
        started = time.time()
        for _ in range(args.rounds):
            for i in range(args.pods):
                began = time.time()
                pods[i].stop()
                retired.append(pods[i])
                pods[i] = Pod(argv, env)
                if not pods[i].wait_ready(per_pod, 60):
                    problems.append(f"a new {mode} pod never became ready:\n{pods[i].tail()}")
                windows.append((began, time.time()))
        slots = args.pods * per_pod * capacity
        budget = 60 + 3 * args.tasks * args.task_seconds / slots
        if not server.send({"op": "settled", "timeout": budget})["ok"]:
            problems.append(f"not every task ended within {budget:.0f} s")
        tasks = server.send({"op": "attempts"})["tasks"]
    finally:
        for pod in pods:
            pod.stop()
        statuses = [pod.wait(60) for pod in [*retired, *pods]]
        server.close()
    runs = collections.Counter()
    ran: dict[str, set[str]] = collections.defaultdict(set)
    if effects.exists():
        for line in effects.read_text().splitlines():
            task_id, attempt_id, _pid = line.split()
            runs[task_id] += 1
            ran[task_id].add(attempt_id)
    tmp.cleanup()
    return _figures(mode, args, tasks, runs, ran, windows, statuses, started, problems)


def _figures(
    mode: str,
    args: argparse.Namespace,
    tasks: list[dict[str, Any]],
    runs: collections.Counter[str],
    ran: dict[str, set[str]],
    windows: list[tuple[float, float]],
    statuses: list[int],
    started: float,
    problems: list[str],
) -> dict[str, Any]:
    states = collections.Counter(t["state"] for t in tasks)
    one_attempt = [t for t in tasks if t["state"] == "SUCCEEDED" and len(t["attempts"]) == 1]
    own_effect = [
        t
        for t in one_attempt
        if runs[t["task_id"]] == 1 and ran[t["task_id"]] == {t["attempts"][0]["attempt_id"]}
    ]
    expired = sum(a["state"] in ("EXPIRED", "UNKNOWN") for t in tasks for a in t["attempts"]) + sum(
        t["evidence"] for t in tasks
    )
    finishes = sorted(
        a["finished_at"] for t in tasks for a in t["attempts"] if a["finished_at"] is not None
    )
    first, last = windows[0][0], windows[-1][1]
    inside = [first, *(f for f in finishes if first < f < last), last]
    gap = max(b - a for a, b in itertools.pairwise(inside))
    during = sum(end <= finishes[-1] for _, end in windows) if finishes else 0
    figures: dict[str, Any] = {
        "mode": mode,
        "tasks": len(tasks),
        "states": dict(states),
        "one_attempt_succeeded": len(one_attempt),
        "one_own_side_effect": len(own_effect),
        "duplicate_side_effects": sum(n - 1 for n in runs.values() if n > 1),
        "lease_expiries": expired,
        "restarts": len(windows),
        "restarts_during_run": during,
        "longest_gap_s": round(gap, 3),
        "gap_limit_s": 2 * args.lease,
        "run_s": round(finishes[-1] - started, 2) if finishes else None,
        "exit_statuses": dict(collections.Counter(statuses)),
    }
    violations = list(problems)
    if len(own_effect) != args.tasks or len(tasks) != args.tasks:
        violations.append(
            f"{args.tasks - len(own_effect)} tasks without exactly one SUCCEEDED attempt and"
            " its one side effect"
        )
    if expired:
        violations.append(f"{expired} lease expiries")
    if any(statuses):
        violations.append(f"pods exited with {figures['exit_statuses']}")
    if gap >= 2 * args.lease:
        violations.append(f"a gap of {gap:.2f} s without a finish during the restarts")
    if during < len(windows):
        violations.append(
            f"only {during} of {len(windows)} restarts ended before the last task finished:"
            " give the run more tasks or longer ones"
        )
    figures["violations"] = violations
    return figures


def _line(f: dict[str, Any]) -> str:
    return (
        f"{f['mode']:<10} {f['one_own_side_effect']}/{f['tasks']} SUCCEEDED with 1 attempt and 1"
        f" side effect, {f['duplicate_side_effects']} duplicates, {f['lease_expiries']} lease"
        f" expiries; {f['restarts']} restarts ({f['restarts_during_run']} during the run),"
        f" longest gap without a finish {f['longest_gap_s']:.2f} s (limit {f['gap_limit_s']:g} s);"
        f" run {f['run_s']} s; pod exit statuses {f['exit_statuses']}"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="times each pod is replaced")
    parser.add_argument("--task-seconds", type=float, default=0.2)
    parser.add_argument("--lease", type=float, default=5.0, help="the server's lease window")
    parser.add_argument(
        "--recycle", type=int, default=50, help="--max-tasks-per-child of supervised pods"
    )
    parser.add_argument("--modes", default="plain,supervised")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    print(
        f"rollout: {args.tasks} tasks (max_attempts=1, {args.task_seconds:g} s each), {args.pods}"
        f" pods replaced one after the other {args.rounds} times, {args.lease:g} s leases",
        flush=True,
    )
    results = []
    for mode in args.modes.split(","):
        figures = run_mode(mode, args)
        results.append(figures)
        print(_line(figures), flush=True)
        for violation in figures["violations"]:
            print(f"  FAILED: {violation}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if any(f["violations"] for f in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
