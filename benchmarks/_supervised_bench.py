"""The worker module of the ``processes`` benchmark section: ``orbit-sync worker
benchmarks._supervised_bench:make --processes N`` (the token comes in $ORBIT_TOKEN)."""

from __future__ import annotations

import os
from typing import Any

from orbit_sync import Client, Worker


def noop(ctx: Any, payload: Any) -> None:
    """Nothing: the per-task cost of the worker itself."""


def spin(ctx: Any, payload: Any) -> None:
    """A few milliseconds of pure-Python CPU: work one process cannot spread over two cores."""
    total = 0
    for i in range(60_000):
        total += i * i


def make() -> Worker:
    worker = Worker(
        Client(os.environ["ORBIT_URL"], os.environ["ORBIT_TOKEN"]),
        queue_id=os.environ["ORBIT_QUEUE_ID"],
        capacity=32,
        drain_timeout=5.0,
    )
    worker.register("noop", noop)
    worker.register("spin", spin)
    return worker
