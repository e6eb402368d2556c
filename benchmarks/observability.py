"""Cost of result encoding and of worker listeners, as ratios to baselines in the same run.

    python benchmarks/observability.py

- result encoding: ``ResultEncoder.encode`` (encode, size check, strict parse into the snapshot
  the finish carries) against the bare ``json.dumps`` + ``json.loads`` of the same value, for an
  empty result, a typical small dict, and a dataclass with datetimes/Decimals/UUIDs (whose
  baseline is the hand-written plain dict it becomes);
- listeners: running a no-op handler through ``Hooks.call_handler`` with no listener, and with
  one middleware, against calling the handler directly; emitting an event to one listener.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import sys
import timeit
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orbit_sync.testing import HandlerEnvironment
from orbit_sync.worker import AttemptEvent, TaskContext, WorkerListener
from orbit_sync.worker._listeners import Hooks
from orbit_sync.worker.core._outcomes import ResultEncoder


@dataclasses.dataclass
class Line:
    sku: str
    price: decimal.Decimal
    at: dt.datetime
    id: uuid.UUID


def _best(fn: Callable[[], Any], number: int = 20_000) -> float:
    """Best of 5 runs, microseconds per call."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def _roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")))


class _Middleware(WorkerListener):
    def around_handler(self, ctx: TaskContext, call: Callable[[], Any]) -> Any:
        return call()


class _Listener(WorkerListener):
    def attempt_started(self, event: AttemptEvent) -> None:
        pass


def main() -> None:
    """Print one line per figure: ours, the baseline, the ratio."""
    encoder = ResultEncoder()
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    lines = [Line(f"sku-{i}", decimal.Decimal("12.50"), when, uuid.UUID(int=i)) for i in range(5)]
    plain = [
        {"sku": x.sku, "price": str(x.price), "at": x.at.isoformat(), "id": str(x.id)}
        for x in lines
    ]
    typical = {"id": "a" * 32, "count": 12, "ok": True, "items": [1, 2, 3], "note": "x" * 50}
    rows = [
        ("encode {}", _best(lambda: encoder.encode({})), _best(lambda: _roundtrip({}))),
        (
            "encode typical dict",
            _best(lambda: encoder.encode(typical)),
            _best(lambda: _roundtrip(typical)),
        ),
        (
            "encode 5 dataclasses",
            _best(lambda: encoder.encode(lines), 5_000),
            _best(lambda: _roundtrip(plain), 5_000),
        ),
    ]
    env = HandlerEnvironment()
    env.run(lambda ctx, payload: None, {})
    ctx = env.context
    assert ctx is not None

    def handler(ctx: TaskContext, payload: Any) -> Any:
        return None

    empty, wrapped, listening = Hooks(), Hooks([_Middleware()]), Hooks([_Listener()])
    event = AttemptEvent("t" * 32, "a" * 32, "h", 1, 3)
    direct = _best(lambda: handler(ctx, ctx.payload), 200_000)
    rows += [
        (
            "handler call, no listener",
            _best(lambda: empty.call_handler(handler, ctx) if empty else None, 200_000),
            direct,
        ),
        ("handler call, 1 middleware", _best(lambda: wrapped.call_handler(handler, ctx)), direct),
        ("emit to 1 listener", _best(lambda: listening.emit("attempt_started", event)), direct),
    ]
    print(f"{'figure':<28}{'ours (us)':>12}{'baseline (us)':>15}{'ratio':>8}")
    for name, ours, base in rows:
        print(f"{name:<28}{ours:>12.2f}{base:>15.2f}{ours / base:>8.2f}")


if __name__ == "__main__":
    main()
