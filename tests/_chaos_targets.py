"""The chaos engine's targets, measured (not part of the suite: it takes a minute or more)::

    python tests/_chaos_targets.py noop --tasks 500 --seed 1
    python tests/_chaos_targets.py non-idempotent --tasks 100 --seeds 1-10

``noop``: one run of no-op tasks under the default profile; prints its summary and seconds,
fails on any violation. ``non-idempotent``: a handler whose effect repeats when a lost lease
gives its task a second attempt, one run per seed; prints per seed whether the run reported
it (with its replay line), then how many seeds did.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

if __name__ == "__main__":  # run from a checkout: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from orbit_sync.client import Client
from orbit_sync.testing import chaos
from orbit_sync.worker import TaskContext, Worker

QUEUE = "c" * 32


def worker(*, effect: bool) -> Worker:
    """A worker of one no-op handler, that says its effect happened when *effect*."""
    built = Worker(Client("ws://127.0.0.1:9", "unused"), queue_id=QUEUE, handle_signals=False)

    @built.handler("noop")
    def noop(ctx: TaskContext, payload: Any) -> Any:
        if effect:
            chaos.effect(ctx)
        return {"i": payload["i"]}

    return built


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    """Measure one target; exit 1 when it is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=("noop", "non-idempotent"))
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", default="1-10")
    parser.add_argument("--profile", default="default")
    args = parser.parse_args(argv)
    logging.getLogger("orbit_sync").setLevel(logging.CRITICAL)
    if args.target == "noop":
        began = time.monotonic()
        report = chaos.run(
            worker(effect=False), seed=args.seed, tasks=args.tasks, profile=args.profile
        )
        print(report.summary())
        print(f"wall {time.monotonic() - began:.1f} s")
        return 0 if report.ok and report.states == {"SUCCEEDED": args.tasks} else 1
    caught = 0
    seeds = _seeds(args.seeds)
    for seed in seeds:
        report = chaos.run(worker(effect=True), seed=seed, tasks=args.tasks, profile=args.profile)
        found = bool(report.duplicate_effects) and f"replay: {report.replay}" in report.summary()
        caught += found
        print(
            f"seed {seed}: {len(report.duplicate_effects)} non-idempotent tasks, "
            f"{len(report.violations)} violations, {report.seconds:.1f} s; "
            + (f"replay: {report.replay}" if found else "NOT CAUGHT"),
            flush=True,
        )
    print(f"caught in {caught} of {len(seeds)} seeds")
    return 0 if caught * 10 >= 9 * len(seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
