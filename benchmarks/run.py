"""Benchmarks: every figure is a ratio against a baseline measured in the same run.

Run with ``make bench``. Absolute times vary by machine; the ratios are what we track.

- ``decode``: our strict decode of a start ``ack`` (strict JSON + envelope + cattrs + checks)
  against ``json.loads`` of the same bytes.
- ``encode``: our encoding of a ``task.finish`` request against ``json.dumps`` of the same dict.
- ``round-trip`` (when the connection and mock server are importable): one ``renew`` through
  ``WorkerConnection`` against the mock server, against a raw websocket-client echo round trip
  of the same frame to a websockets echo server on loopback.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orbit_sync import _codec
from orbit_sync.models import (
    AttemptRef,
    Capability,
    Finish,
    Outcome,
    Registration,
    new_secret,
)

VECTORS = json.loads(
    (Path(__file__).resolve().parent.parent / "tests" / "vectors" / "frames.json").read_text()
)


def per_call(fn: Callable[[], object], *, repeat: int = 7, number: int = 2000) -> float:
    """Median seconds per call over *repeat* batches of *number* calls."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def bench_decode() -> tuple[float, float]:
    """Strict decode of start acks vs json.loads of the same bytes.

    Every frame carries different times (as real frames do), so no per-string cache flatters us.
    """
    frame = next(v for v in VECTORS["server_to_client"] if v["name"] == "ack-start-ok")["frame"]
    frames = [
        frame.replace("08:00:30Z", f"08:00:30.{i:06d}Z")
        .replace("08:00:00Z", f"08:00:00.{i:06d}Z")
        .encode()
        for i in range(2000)
    ]
    ctx = VECTORS["context"]
    reg = Registration(ctx["queue_id"], [Capability(**c) for c in ctx["capabilities"]], 4)
    session = _codec.SessionContext(ctx["session_id"], 2, reg)
    pending = dict.fromkeys(ctx["pending_message_ids"], "task.start").get
    it = itertools.cycle(frames)
    ours = per_call(lambda: _codec.decode_server_frame(next(it), session, pending))
    base = per_call(lambda: json.loads(next(it)))
    return ours, base


def bench_encode() -> tuple[float, float]:
    """Encoding a finish request vs json.dumps of the equivalent dict."""
    ref = AttemptRef("1" * 32, "2" * 32, 3, new_secret())
    finish = Finish(ref, Outcome.SUCCEEDED, {"rows": list(range(50)), "ok": True})
    as_dict = {
        "protocol_version": "1",
        "type": "task.finish",
        "message_id": "4" * 32,
        "session_id": "3" * 32,
        "body": _codec.unstructure(finish),
    }
    ours = per_call(lambda: _codec.encode_request("task.finish", "4" * 32, "3" * 32, finish))
    base = per_call(lambda: json.dumps(as_dict))
    return ours, base


def main() -> int:
    """Print each benchmark as ours / baseline."""
    rows = [("decode start ack", *bench_decode()), ("encode finish", *bench_encode())]
    try:
        from benchmarks import roundtrip
    except ImportError:
        roundtrip = None  # type: ignore[assignment]
    if roundtrip is not None:
        rows.append(("renew round trip", *roundtrip.bench_round_trip()))
    print(f"{'benchmark':<22}{'ours':>12}{'baseline':>12}{'ratio':>8}")
    for name, ours, base in rows:
        print(f"{name:<22}{ours * 1e6:>10.1f}us{base * 1e6:>10.1f}us{ours / base:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
