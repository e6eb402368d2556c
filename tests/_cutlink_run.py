"""A Worker through a CuttingLink: tasks over a slow link that keeps cutting, then the same run
without cuts, compared; each run is a chaos run (``orbit_sync.testing.chaos``, the one chaos
engine) whose link cuts on its own seeded clock. Used by ``tests/test_worker_cutlink.py`` (a
small fixed seed) and, as a script, by ``make chaos`` (long runs, the Worker's default settings)::

    python tests/_cutlink_run.py --tasks 1000 --rtt 0.09 --mean-cut 0.3 --seeds 1,2,3 \
        --capacity 16 --lease 3 --task-max 1.5 --defaults --cut-for 230 \
        --min-ratio 0.2 --max-gap 10 --max-settle 30

Every run checks what must hold whatever the cuts hit: every task ends terminal, a handler runs
at most once per attempt, and every SUCCEEDED task stores what its handler returned. The script
prints, per seed, the throughput with cuts over the throughput of the same run without them.

``--defaults`` runs the Worker with its default settings (reconnect backoff, dial and call
timeouts); ``--task-max S`` makes each handler take a seeded 0-S seconds; ``--cut-for S`` stops
the cuts after S seconds (then the link is calm until every task is terminal). The script then
also prints the longest time without a finished task while the link was cutting and the time
from the end of the cuts to the last task terminal. ``--min-ratio``, ``--max-gap`` and
``--max-settle`` make those three figures targets: a seed that misses one fails the run (exit 1),
as a broken guarantee does. ``--timeline PREFIX`` writes, per seed, ``PREFIX-seedN.json``: what
the worker saw of the run with cuts (sessions, failed dials, lost leases, finishes) and every
attempt as the server stored it, on one time axis, to see what a long gap holds.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import itertools
import json
import logging
import os
import random
import sys
import threading
import time
from typing import Any

if __name__ == "__main__":  # run from a checkout: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orbit_sync.client import Client
from orbit_sync.testing import TaskSnapshot, chaos
from orbit_sync.worker import (
    AttemptFinished,
    Backoff,
    DisconnectEvent,
    LeaseEvent,
    SessionEvent,
    TaskContext,
    Worker,
    WorkerListener,
)

TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "NEEDS_REVIEW"})
#: The queue the chaos run's server serves (it takes the worker's).
QUEUE = "c" * 32


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
    #: Seconds the link was cutting (the whole run without ``cut_for``).
    cut_seconds: float = 0.0
    #: Tasks terminal while the link was cutting.
    done_while_cutting: int = 0
    #: The longest time without a task ending terminal while the link was cutting (s).
    longest_gap: float = 0.0
    #: When that longest time began (s from the start).
    gap_at: float = 0.0
    #: Tasks not yet terminal when that longest time began.
    gap_left: int = 0
    #: The attempts of the task whose end closed it: (state, assigned, started or None) in s
    #: from the start, to tell a link that carried nothing from a straggler's lost attempts.
    gap_closer: list[tuple[str, float, float | None]] = dataclasses.field(default_factory=list)
    #: From the end of the cuts to the last task terminal (s); 0 when all ended during cuts.
    settle_seconds: float = 0.0
    #: The chaos run's own findings (every promise it checks; must be empty).
    broken: list[str] = dataclasses.field(default_factory=list)

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
        return out + self.broken


class Timeline(WorkerListener):
    """What one run did, on one time axis (s from the worker's start): the worker's sessions,
    failed dials, lost leases and finishes as it saw them (``events``), and every attempt as
    the server stored it (``attempts``, filled in once the run is over)."""

    def __init__(self) -> None:
        self._start = 0.0
        self.events: list[tuple[float, str, str]] = []
        #: ``(task index, attempt id, state, assigned, started, finished)``.
        self.attempts: list[tuple[int, str, str, float, float | None, float | None]] = []

    def begin(self, at: float) -> None:
        """The worker starts now (``time.monotonic()`` *at*)."""
        self._start = at

    def _note(self, kind: str, detail: str) -> None:
        # list.append is atomic: listeners are called from the worker's threads.
        self.events.append((round(time.monotonic() - self._start, 3), kind, detail))

    def connected(self, event: SessionEvent) -> None:
        self._note("connected", "reconnect" if event.reconnect else "first")

    def disconnected(self, event: DisconnectEvent) -> None:
        self._note("disconnected", event.reason)

    def dial_failed(self, event: DisconnectEvent) -> None:
        self._note("dial_failed", event.reason)

    def lease_lost(self, event: LeaseEvent) -> None:
        self._note("lease_lost", f"{event.attempt_id} {event.reason}")

    def attempt_finished(self, event: AttemptFinished) -> None:
        delivered = "delivered" if event.delivered else "not delivered"
        self._note("finished", f"{event.attempt_id} {event.outcome.value} {delivered}")

    def as_json(self) -> dict[str, Any]:
        """The timeline as JSON-ready data."""
        return {"events": self.events, "attempts": self.attempts}


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
    defaults: bool = False,
    task_max: float = 0.0,
    cut_for: float | None = None,
    timeline: Timeline | None = None,
) -> RunResult:
    """Run *tasks* tasks through a link with *rtt* and cuts every *mean_cut* s on average: a
    chaos run (``orbit_sync.testing.chaos``) with no scheduled fault, the link cutting on its
    own clock.

    Handlers take a seeded 0-*task_max* s; *defaults* keeps the Worker's default backoff and
    timeouts; the cuts stop after *cut_for* s when given; *timeline* records the run.
    """
    runs: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    durations = random.Random(seed)
    pauses = [round(durations.uniform(0, task_max), 3) for _ in range(tasks)]
    tuned: dict[str, Any] = {}
    if not defaults:
        tuned = {
            "reconnect_backoff": backoff or Backoff(initial=0.05, maximum=1.0),
            "dial_timeout": 2.0,
            "call_timeout": 2.0,
        }
    worker = Worker(
        Client("ws://127.0.0.1:9", "unused"),  # the chaos run points it at its own link
        queue_id=QUEUE,
        capacity=capacity,
        drain_timeout=0,
        cancel_grace=0,
        flush_timeout=1.0,
        **tuned,
    )

    @worker.handler("noop")
    def noop(ctx: TaskContext, payload: Any) -> Any:
        with lock:
            runs[ctx.attempt_id] += 1
        if payload["s"]:
            ctx.sleep(payload["s"])
        return {"i": payload["i"]}

    if timeline is not None:
        timeline.begin(time.monotonic())
    report = chaos.run(
        worker,
        seed=seed,
        tasks=tasks,
        rates=chaos.FaultRates(rtt=rtt, lease=lease),
        payload=lambda i: {"i": i, "s": pauses[i]},
        enqueue={"max_attempts": 100},
        time_limit=time_limit,
        link_cuts=None if mean_cut is None else (mean_cut, cut_for),
        listeners=() if timeline is None else (timeline,),
        replay=f"python tests/_cutlink_run.py --tasks {tasks} --rtt {rtt} --seeds {seed} ...",
    )
    seconds, started_wall = report.seconds, report.started_wall
    snaps = {t.task_id: t for t in report.snapshots}
    ids = [t.task_id for t in report.snapshots]
    calm_at = cut_for if mean_cut is not None and cut_for is not None else None
    states = collections.Counter(snaps[t].state.value for t in ids)
    if timeline is not None:
        timeline.attempts = [
            (
                i,
                a.attempt_id,
                a.state.value,
                round(a.assigned_at.timestamp() - started_wall, 3),
                _since(a.started_at, started_wall, 3),
                _since(a.finished_at, started_wall, 3),
            )
            for i, t in enumerate(ids)
            for a in snaps[t].attempts
        ]
    attempts = [a for t in ids for a in snaps[t].attempts]
    # When each task ended, in seconds from the start (the server runs on the real clock).
    ends = sorted(
        _ended(snaps[t]) - started_wall
        for t in ids
        if snaps[t].state.value in TERMINAL and snaps[t].attempts
    )
    cut_end = seconds if mean_cut is None or calm_at is None else min(calm_at, seconds)
    if mean_cut is None:
        cut_end = 0.0
    marks = [0.0, *[e for e in ends if e <= cut_end], cut_end]
    gap, gap_at = max(((b - a, a) for a, b in itertools.pairwise(marks)), default=(0.0, 0.0))
    closer = min(
        (t for t in ids if snaps[t].state.value in TERMINAL and snaps[t].attempts),
        key=lambda t: abs(_ended(snaps[t]) - started_wall - (gap_at + gap)),
        default=None,
    )
    settle = max(0.0, ends[-1] - cut_end) if ends and cut_end < seconds else 0.0
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
        cuts=report.cuts,
        connections=report.connections,
        reconnects=report.reconnects,
        repeated=sorted(a for a, n in runs.items() if n > 1),
        wrong_results=wrong,
        unreported=report.unreported,
        attempts=len(attempts),
        expired=sum(1 for a in attempts if a.state.value == "EXPIRED"),
        cut_seconds=cut_end,
        done_while_cutting=sum(1 for e in ends if e <= cut_end),
        longest_gap=gap if mean_cut is not None else 0.0,
        gap_at=gap_at,
        gap_left=sum(1 for e in ends if e > gap_at) + (tasks - len(ends)),
        gap_closer=[]
        if closer is None
        else [
            (
                a.state.value,
                round(a.assigned_at.timestamp() - started_wall, 1),
                _since(a.started_at, started_wall, 1),
            )
            for a in snaps[closer].attempts
        ],
        settle_seconds=settle,
        broken=[str(v) for v in report.violations],
    )


def _since(moment: dt.datetime | None, origin: float, digits: int) -> float | None:
    """*moment* (a server timestamp) in s after *origin* (wall clock), rounded; None stays."""
    return None if moment is None else round(moment.timestamp() - origin, digits)


def _ended(task: TaskSnapshot) -> float:
    """When a terminal task's last attempt ended (wall-clock seconds)."""
    finished = task.attempts[-1].finished_at
    assert finished is not None
    return finished.timestamp()


def _attempts(attempts: list[tuple[str, float, float | None]]) -> str:
    """A task's attempts as ``STATE assigned[/started]`` in s from the start."""
    return ", ".join(
        f"{state} {assigned}" + ("" if started is None else f"/{started}")
        for state, assigned, started in attempts
    )


def settled(cut: RunResult) -> str:
    """When the last task ended, said against the end of the cuts."""
    if cut.done_while_cutting == cut.tasks:
        return f"all terminal while cutting (none left when the cuts stopped, {cut.seconds:.1f} s)"
    return f"all terminal {cut.settle_seconds:.1f} s after the cuts stopped"


def missed_targets(args: argparse.Namespace, ratio: float, cut: RunResult) -> list[str]:
    """The targets asked for on the command line that the run with cuts missed."""
    missed = []
    if args.min_ratio is not None and ratio < args.min_ratio:
        missed.append(f"ratio {ratio:.3f} < {args.min_ratio}")
    if args.max_gap is not None and cut.longest_gap >= args.max_gap:
        missed.append(f"{cut.longest_gap:.1f} s without a finish while cutting")
    if args.max_settle is not None and cut.settle_seconds > args.max_settle:
        missed.append(f"all terminal {cut.settle_seconds:.1f} s after the cuts stopped")
    return missed


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
    parser.add_argument(
        "--defaults", action="store_true", help="the Worker's default backoff and timeouts"
    )
    parser.add_argument("--task-max", type=float, default=0.0, help="handlers take 0-S s")
    parser.add_argument("--cut-for", type=float, help="stop the cuts after S s")
    parser.add_argument("--min-ratio", type=float, help="fail below this throughput ratio")
    parser.add_argument(
        "--max-gap", type=float, help="fail at this many s or more without a finish while cutting"
    )
    parser.add_argument(
        "--max-settle", type=float, help="fail if tasks end more than S s after the cuts stop"
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--timeline", metavar="PREFIX", help="write each cut run's timeline to PREFIX-seedN.json"
    )
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
            "defaults": args.defaults,
            "task_max": args.task_max,
        }
        calm = run(mean_cut=None, **common)
        timeline = Timeline() if args.timeline else None
        cut = run(mean_cut=args.mean_cut, cut_for=args.cut_for, timeline=timeline, **common)
        if timeline is not None:
            with open(f"{args.timeline}-seed{seed}.json", "w", encoding="utf-8") as out:
                json.dump(timeline.as_json(), out)
        # Throughput while the link was cutting, over the calm run's.
        cutting = cut.done_while_cutting / cut.cut_seconds if cut.cut_seconds else 0.0
        ratio = cutting / calm.throughput if calm.throughput else 0.0
        row = {
            "seed": seed,
            "tasks": args.tasks,
            "rtt_ms": round(args.rtt * 1000),
            "mean_cut_s": args.mean_cut,
            "calm_tasks_per_s": round(calm.throughput, 1),
            "cut_tasks_per_s": round(cutting, 1),
            "cut_seconds": round(cut.cut_seconds, 1),
            "longest_gap_s": round(cut.longest_gap, 1),
            "longest_gap_from_s": round(cut.gap_at, 1),
            "gap_left": cut.gap_left,
            "gap_closer": cut.gap_closer,
            "settle_s": round(cut.settle_seconds, 1),
            "ratio": round(ratio, 3),
            "cuts": cut.cuts,
            "connections": cut.connections,
            "cut_states": cut.states,
            "attempts": cut.attempts,
            "expired_unstarted": cut.expired,
            "violations": calm.violations + cut.violations,
            "missed": missed_targets(args, ratio, cut),
        }
        rows.append(row)
        failed = failed or bool(row["violations"]) or bool(row["missed"])
        print(
            f"seed {seed}: {args.tasks} tasks, rtt {row['rtt_ms']} ms, cut every "
            f"~{args.mean_cut} s ({cut.cuts} cuts, {cut.connections} connections): "
            f"{row['cut_tasks_per_s']} tasks/s vs {row['calm_tasks_per_s']} without cuts, "
            f"ratio {row['ratio']}; longest {row['longest_gap_s']} s without a finish while "
            f"cutting (from {row['longest_gap_from_s']} s of {row['cut_seconds']} s, "
            f"{cut.gap_left} tasks left then; the task ending it: {_attempts(cut.gap_closer)}), "
            f"{settled(cut)}; "
            f"{cut.attempts} attempts ({cut.expired} expired unstarted); "
            f"states {cut.states}"
            + (f"; VIOLATIONS {row['violations']}" if row["violations"] else "")
            + (f"; MISSED {row['missed']}" if row["missed"] else ""),
            flush=True,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
