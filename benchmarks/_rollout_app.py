"""The worker module of ``make rollout`` (``benchmarks/rollout.py``): ``orbit-sync worker
benchmarks._rollout_app:make``, configured by its environment.

``ROLLOUT_EFFECTS`` names the side-effect file: each run of the handler appends one line
``task_id attempt_id pid`` (one ``write`` of a short line to a file opened for appending, so
lines from many processes never mix), which the harness counts per task. ``ROLLOUT_TASK_SECONDS``
is how long a task takes, ``ROLLOUT_CAPACITY`` the slots of each worker process.
"""

from __future__ import annotations

import os
import time
from typing import Any

from orbit_sync import Client, Worker


def make() -> Worker:
    seconds = float(os.environ["ROLLOUT_TASK_SECONDS"])
    effects = os.environ["ROLLOUT_EFFECTS"]
    worker = Worker(
        Client(os.environ["ORBIT_URL"], os.environ["ORBIT_TOKEN"]),
        queue_id=os.environ["ORBIT_QUEUE_ID"],
        capacity=int(os.environ["ROLLOUT_CAPACITY"]),
        drain_timeout=30.0,
    )

    @worker.handler("rollout")
    def rollout(ctx: Any, payload: Any) -> Any:
        time.sleep(seconds)  # the work: not interrupted by a drain, which waits for it
        line = f"{ctx.task_id} {ctx.attempt_id} {os.getpid()}\n".encode()
        fd = os.open(effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return {"pid": os.getpid()}

    return worker
