"""Dramatiq actors for the benchmark: ``noop`` and ``incr`` (one Redis INCR per task)."""

from __future__ import annotations

import os
import sys

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware

from benchmarks.peers._meter import METER

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


class _Metered(Middleware):
    def after_worker_boot(self, broker: object, worker: object) -> None:
        METER.booted()

    def after_process_message(self, broker: object, message: object, **kw: object) -> None:
        METER.processed()


broker = RedisBroker(url=URL)
broker.add_middleware(_Metered())
dramatiq.set_broker(broker)
_redis = redis.Redis.from_url(URL)


@dramatiq.actor(queue_name="bench", max_retries=0)
def noop() -> None:
    pass


@dramatiq.actor(queue_name="bench", max_retries=0)
def incr() -> None:
    _redis.incr("bench:count")


if __name__ == "__main__":  # python -m benchmarks.peers._dramatiq_app KIND N: enqueue N messages
    actor = {"noop": noop, "incr": incr}[sys.argv[1]]
    for _ in range(int(sys.argv[2])):
        actor.send()
