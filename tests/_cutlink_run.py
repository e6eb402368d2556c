"""A Worker through a CuttingLink: tasks over a slow link that keeps cutting, then the same run
without cuts, compared. Used by ``tests/test_worker_cutlink.py`` (a small fixed seed) and, as a
script, by ``make chaos`` (long runs)::

    python tests/_cutlink_run.py --tasks 1000 --rtt 0.09 --mean-cut 0.3 --seeds 1,2,3

Every run checks what must hold whatever the cuts hit: every task ends terminal, a handler runs
at most once per attempt, and every SUCCEEDED task stores what its handler returned. The script
prints, per seed, the throughput with cuts over the throughput of the same run without them.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from typing import Any

if __name__ == "__main__":  # run from a checkout: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orbit_sync.client import Client
from orbit_sync.testing import CuttingLink, MockOrbitServer, RetrySafety
from orbit_sync.worker import Backoff, TaskContext, Worker

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"})


@dataclasses.dataclass
class RunResult:
    """What one run did, and what it broke."""

    tasks: int
    seconds: float
    states: dict[str, int]
    not_terminal: int
    cuts: int
    connections: int
    reconnects: int
    #: Attempts whose handler ran more than once (must be empty).
    repeated: list[str]
    #: SUCCEEDED tasks whose stored result is not what the handler returned (must be empty).
    wrong_results: list[str]
    unreported: int
    #: Attempts the server created (more than *tasks*: some were lost and assigned again).
    attempts: int = 0
    #: Attempts whose lease ran out before they started: most are assignments a cut lost on the
    #: wire, which hold one of the worker's slots on the server until their lease expires.
    expired: int = 0

    @property
    def throughput(self) -> float:
        """Terminal tasks per second of the run."""
        done = self.tasks - self.not_terminal
        return done / self.seconds if self.seconds > 0 else 0.0

    @property
    def violations(self) -> list[str]:
        """What broke a guarantee (empty when the run is correct)."""
        out = []
        if self.not_terminal:
            out.append(f"{self.not_terminal} tasks not terminal")
        if self.repeated:
            out.append(f"{len(self.repeated)} attempts ran twice")
        if self.wrong_results:
            out.append(f"{len(self.wrong_results)} results differ from what the handler returned")
        return out


def run(
    *,
    tasks: int,
    rtt: float,
    mean_cut: float | None,
    seed: int,
    capacity: int = 32,
    lease: float = 2.0,
    time_limit: float = 120.0,
    backoff: Backoff | None = None,
) -> RunResult:
    """Run *tasks* no-op tasks through a link with *rtt* and cuts every *mean_cut* s on average."""
    runs: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    with MockOrbitServer(
        assignment_rate=None, lease_duration=lease, session_window=3 * lease
    ) as server:
        with CuttingLink(server.url, rtt=rtt, mean_cut=mean_cut, seed=seed) as link:
            worker = Worker(
                Client(link.url, server.token),
                queue_id=server.queue_id,
                capacity=capacity,
                reconnect_backoff=backoff or Backoff(initial=0.05, maximum=1.0),
                handle_signals=False,
                drain_timeout=0,
                cancel_grace=0,
                flush_timeout=1.0,
                dial_timeout=2.0,
                call_timeout=2.0,
            )

            @worker.handler("noop")
            def noop(ctx: TaskContext, payload: Any) -> Any:
                with lock:
                    runs[ctx.attempt_id] += 1
                return {"i": payload["i"]}

            ids = [
                server.enqueue(
                    "noop",
                    {"i": i},
                    max_attempts=100,
                    backoff_initial=0.05,
                    backoff_max=0.5,
                    retry_safety=RetrySafety.IDEMPOTENT,
                )
                for i in range(tasks)
            ]
            started = time.monotonic()
            worker.start()
            deadline = started + time_limit
            for task_id in ids:
                try:
                    server.wait_for(
                        task_id, TERMINAL, timeout=max(0.0, deadline - time.monotonic())
                    )
                except TimeoutError:
                    break
            seconds = time.monotonic() - started
            link.calm()
            report = worker.stop(drain=False)
            stats = worker.stats()
            cuts, connections = link.cuts, link.connections
        snaps = {t.task_id: t for t in server.tasks()}
        server.check_invariants()
    states = collections.Counter(snaps[t].state.value for t in ids)
    attempts = [a for t in ids for a in snaps[t].attempts]
    wrong = [
        t
        for i, t in enumerate(ids)
        if snaps[t].state.value == "SUCCEEDED" and snaps[t].result != {"i": i}
    ]
    return RunResult(
        tasks=tasks,
        seconds=seconds,
        states=dict(states),
        not_terminal=sum(n for s, n in states.items() if s not in TERMINAL),
        cuts=cuts,
        connections=connections,
        reconnects=stats.reconnects,
        repeated=sorted(a for a, n in runs.items() if n > 1),
        wrong_results=wrong,
        unreported=len(report.unreported),
        attempts=len(attempts),
        expired=sum(1 for a in attempts if a.state.value == "EXPIRED"),
    )


def main(argv: list[str] | None = None) -> int:
    """``make chaos``: run each seed with and without cuts; print the throughput ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rtt", type=float, default=0.09)
    parser.add_argument("--mean-cut", type=float, default=0.3)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--lease", type=float, default=2.0, help="the server's lease window (s)")
    parser.add_argument("--backoff-initial", type=float, default=0.05)
    parser.add_argument("--backoff-max", type=float, default=1.0)
    parser.add_argument("--time-limit", type=float, default=300.0)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--verbose", action="store_true", help="show the worker's log lines")
    args = parser.parse_args(argv)
    if not args.verbose:
        # Thousands of expected "connection lost" lines would drown the figures.
        logging.getLogger("orbit_sync").setLevel(logging.CRITICAL)
    rows = []
    failed = False
    for seed in (int(s) for s in args.seeds.split(",")):
        common: dict[str, Any] = {
            "tasks": args.tasks,
            "rtt": args.rtt,
            "seed": seed,
            "capacity": args.capacity,
            "lease": args.lease,
            "backoff": Backoff(initial=args.backoff_initial, maximum=args.backoff_max),
            "time_limit": args.time_limit,
        }
        calm = run(mean_cut=None, **common)
        cut = run(mean_cut=args.mean_cut, **common)
        ratio = cut.throughput / calm.throughput if calm.throughput else 0.0
        row = {
            "seed": seed,
            "tasks": args.tasks,
            "rtt_ms": round(args.rtt * 1000),
            "mean_cut_s": args.mean_cut,
            "calm_tasks_per_s": round(calm.throughput, 1),
            "cut_tasks_per_s": round(cut.throughput, 1),
            "ratio": round(ratio, 3),
            "cuts": cut.cuts,
            "connections": cut.connections,
            "cut_states": cut.states,
            "attempts": cut.attempts,
            "expired_unstarted": cut.expired,
            "violations": calm.violations + cut.violations,
        }
        rows.append(row)
        failed = failed or bool(row["violations"])
        print(
            f"seed {seed}: {args.tasks} tasks, rtt {row['rtt_ms']} ms, cut every "
            f"~{args.mean_cut} s ({cut.cuts} cuts, {cut.connections} connections): "
            f"{row['cut_tasks_per_s']} tasks/s vs {row['calm_tasks_per_s']} without cuts, "
            f"ratio {row['ratio']}; {cut.attempts} attempts ({cut.expired} expired unstarted); "
            f"states {cut.states}"
            + (f"; VIOLATIONS {row['violations']}" if row["violations"] else ""),
            flush=True,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
