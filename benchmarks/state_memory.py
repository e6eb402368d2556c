"""Mock server memory under a steady load: traced heap and RSS after 10^5 and 10^6 requests.

Pure state machine (``OrbitState`` on a ``ManualClock``, default options: 600 s idempotency
window, 1 h retention, 100,000-event ring). The load is short-lived workers: each connects
(``worker.hello``), reports capacity, starts, renews and finishes one task, then disconnects;
server time moves 50 ms per request (20 requests/s). Requests are built as validated frames
directly (no JSON), so the run measures the state, not the codec.

Flat memory means the figure after 10^6 requests is about the one after 10^5: the first 10^5
requests (5,000 s of server time) already fill the idempotency window, the event ring and the
retention (an ended session is forgotten 45 s + 1 h after its worker left).

Run: ``.venv/bin/python benchmarks/state_memory.py`` (``--quick``: 10^4 and 10^5;
``--traced``: also the Python heap as tracemalloc sees it, several times slower).
"""

from __future__ import annotations

import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orbit_sync._codec import ClientFrame, unstructure
from orbit_sync.models import (
    AttemptRef,
    Capability,
    CapacityReport,
    Finish,
    Registration,
    new_id,
    new_message_id,
    new_secret,
)
from orbit_sync.testing import ManualClock
from orbit_sync.testing._state import SCOPE_CONNECT, SCOPE_CONSUME, OrbitState, queue_scope

STEP = 0.05  # seconds of server time per request


def _frame(kind: str, body: Any, session_id: str | None) -> ClientFrame:
    return ClientFrame(kind, new_message_id(), session_id, body, unstructure(body))


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class Load:
    def __init__(self) -> None:
        self.clock = ManualClock()
        self.state = OrbitState(clock=self.clock, assignment_rate=None)
        self.token = self.state.add_token(
            {SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(self.state.default_queue)}
        )
        self.requests = 0

    def _send(self, sid: str, kind: str, body: Any) -> Any:
        self.requests += 1
        self.state.advance(STEP)
        return self.state.handle(sid, _frame(kind, body, sid))

    def cycle(self) -> None:
        """One short-lived worker: 5 requests."""
        state = self.state
        reg = Registration(
            queue_id=state.default_queue,
            capabilities=[Capability("resize", "1", "1")],
            capacity=1,
            instance_id=new_id(),
            instance_secret=new_secret(),
        )
        state.enqueue("resize", {"n": self.requests})
        self.requests += 1
        sid = state.hello(self.token, _frame("worker.hello", reg, None)).session_id
        assert sid is not None
        handled = self._send(sid, "worker.capacity", CapacityReport(1, 1, False))
        body = handled.actions[0].body
        ref = AttemptRef(
            task_id=body["task"]["task_id"],
            attempt_id=body["attempt_id"],
            epoch=int(body["epoch"]),
            lease_secret=body["lease_secret"],
        )
        self._send(sid, "task.start", ref)
        self._send(sid, "task.renew", ref)
        self._send(sid, "task.finish", Finish(ref=ref, outcome="SUCCEEDED", result={}))
        state.connection_lost(sid)


def main() -> None:
    marks = (10_000, 100_000) if "--quick" in sys.argv else (100_000, 1_000_000)
    load = Load()
    traced_too = "--traced" in sys.argv
    if traced_too:
        tracemalloc.start()
    started = time.process_time()
    for mark in marks:
        while load.requests < mark:
            load.cycle()
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] / 2**20 if traced_too else float("nan")
        s = load.state
        print(
            f"{load.requests:>9,} requests ({load.requests * STEP:,.0f} s server time): "
            f"traced {traced:6.1f} MiB, RSS {_rss_mib():6.1f} MiB; kept: {len(s._tasks)} tasks, "
            f"{len(s._sessions)} sessions, {len(s._ops)} receipts, {len(s.events())} events "
            f"({s.events().dropped:,} dropped); CPU {time.process_time() - started:.0f} s",
            flush=True,
        )
    load.state.check_invariants()


if __name__ == "__main__":
    main()
