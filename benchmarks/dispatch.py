"""Mock server dispatch cost per assignment, at 1,000 against 100,000 waiting tasks.

Pure state machine (``OrbitState`` on a ``ManualClock``, no sockets): one worker session with
one slot starts and finishes a task, and the finish's dispatch pass assigns the next waiting
one. The figure is the cost of that cycle with 100,000 tasks waiting divided by the cost with
1,000 waiting, in the same run: about 1.0 when dispatch does not depend on the backlog.
The bulk enqueue of the backlog (``enqueue_many``) is timed too, per task. Times are process
CPU time, so other load on the machine does not inflate them.

Run: ``.venv/bin/python benchmarks/dispatch.py`` (add ``--quick`` for a smaller run).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orbit_sync._codec import ClientFrame, decode_client_frame, encode_frame, unstructure
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


def _frame(kind: str, body: Any, session_id: str | None) -> ClientFrame:
    text = encode_frame(kind, new_message_id(), session_id=session_id, body=unstructure(body))
    return decode_client_frame(text)


def _ref(body: dict[str, Any]) -> AttemptRef:
    return AttemptRef(
        task_id=body["task"]["task_id"],
        attempt_id=body["attempt_id"],
        epoch=int(body["epoch"]),
        lease_secret=body["lease_secret"],
    )


def cycle_cost(waiting: int, cycles: int) -> tuple[float, float]:
    """(seconds per start+finish+next assignment, seconds per task of the bulk enqueue)."""
    state = OrbitState(clock=ManualClock(), assignment_rate=None)
    token = state.add_token({SCOPE_CONNECT, SCOPE_CONSUME, queue_scope(state.default_queue)})
    specs = [{"handler": "resize", "payload": {"n": i}} for i in range(waiting + cycles + 1)]
    start = time.process_time()
    state.enqueue_many(specs)
    enqueue = (time.process_time() - start) / len(specs)
    reg = Registration(
        queue_id=state.default_queue,
        capabilities=[Capability("resize", "1", "1")],
        capacity=1,
        instance_id=new_id(),
        instance_secret=new_secret(),
    )
    sid = state.hello(token, _frame("worker.hello", reg, None)).session_id
    assert sid is not None
    handled = state.handle(sid, _frame("worker.capacity", CapacityReport(1, 1, False), sid))
    body = handled.actions[0].body  # type: ignore[union-attr]
    samples = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(cycles // 5):
            ref = _ref(body)
            state.handle(sid, _frame("task.start", ref, sid))
            fin = Finish(ref=ref, outcome="SUCCEEDED", result={})
            handled = state.handle(sid, _frame("task.finish", fin, sid))
            body = next(a.body for a in handled.actions if getattr(a, "type", "") == "task.assign")
        samples.append((time.process_time() - start) / (cycles // 5))
    return statistics.median(samples), enqueue


def main() -> None:
    quick = "--quick" in sys.argv
    cycles = 500 if quick else 2000
    small, enq_small = cycle_cost(1_000, cycles)
    large, enq_large = cycle_cost(100_000, cycles)
    print(f"dispatch cycle, 1,000 waiting:   {small * 1e6:8.1f} us")
    print(f"dispatch cycle, 100,000 waiting: {large * 1e6:8.1f} us")
    print(f"ratio 100,000 / 1,000 waiting:   {large / small:8.2f}")
    print(
        f"enqueue_many per task:           {enq_large * 1e6:8.1f} us (1,000: {enq_small * 1e6:.1f})"
    )


if __name__ == "__main__":
    main()
