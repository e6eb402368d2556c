"""Counts processed tasks inside a peer's worker process and writes its figures when done.

The window starts when the peer's worker has booted (its imports and forks are not counted, as
ours are not) and ends when the N-th task has been processed. ``$BENCH_TASKS`` is N and
``$BENCH_OUT`` the JSON file written at the end.
"""

from __future__ import annotations

import json
import os
import threading
import time

from benchmarks._common import proc_cpu, proc_status


class Meter:
    def __init__(self) -> None:
        self.n = int(os.environ.get("BENCH_TASKS", "0"))
        self.out = os.environ.get("BENCH_OUT", "")
        self.count = 0
        self.lock = threading.Lock()
        self.t0 = 0.0
        self.cpu0 = 0.0

    def booted(self) -> None:
        self.t0, self.cpu0 = time.perf_counter(), proc_cpu()

    def processed(self) -> None:
        with self.lock:
            self.count += 1
            if self.count != self.n:
                return
        wall, cpu = time.perf_counter() - self.t0, proc_cpu() - self.cpu0
        figures = {"tasks": self.n, "wall": wall, "cpu": cpu, "peak_rss": proc_status()["VmHWM"]}
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(figures, f)
        os.replace(tmp, self.out)


METER = Meter()
