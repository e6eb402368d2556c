"""A Celery app for the benchmark: one no-op task, ``acks_late``, no result backend."""

from __future__ import annotations

import os
import sys
from typing import Any

from celery import Celery, signals

from benchmarks.peers._meter import METER

app = Celery("bench", broker=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_acks_late=True,
    task_ignore_result=True,
    task_default_queue="bench",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="bench.noop")
def noop() -> None:
    pass


@signals.worker_ready.connect
def _ready(**kw: Any) -> None:
    METER.booted()


@signals.task_postrun.connect
def _done(**kw: Any) -> None:
    METER.processed()


if __name__ == "__main__":  # python -m benchmarks.peers._celery_app N: enqueue N tasks
    for _ in range(int(sys.argv[1])):
        noop.delay()
