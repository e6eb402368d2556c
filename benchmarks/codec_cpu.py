"""CPU per frame of the strict codec, as ratios to the stdlib's json on the same frames.

    benchmarks/.venv/bin/python benchmarks/codec_cpu.py [--rounds 15] [--number 2000]

Each round times ours and the baseline back to back in CPU time (``time.process_time``), so a
busy machine slows both alike; the figure is the median of the rounds' ratios. To compare two
versions of the SDK, run this file once with each on ``PYTHONPATH`` in the same conditions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from orbit_sync import _codec
from orbit_sync.models import AttemptRef, Capability, Finish, Outcome, Registration, new_secret
from orbit_sync.worker.core._outcomes import outcome_of

VECTORS = json.loads(
    (Path(__file__).resolve().parent.parent / "tests" / "vectors" / "frames.json").read_text()
)


def _frames(name: str, count: int = 2000) -> list[bytes]:
    """The vector *name* with its times varied per frame (as a live server's are)."""
    frame = next(v for v in VECTORS["server_to_client"] if v["name"] == name)["frame"]
    return [
        frame.replace("08:00:30Z", f"08:00:30.{i:06d}Z")
        .replace("08:00:00Z", f"08:00:00.{i:06d}Z")
        .encode()
        for i in range(count)
    ]


# The order the mock server writes an ack in (compact, as on the wire), as a live Worker sees it.
_ACK_ORDER = ["protocol_version", "type", "message_id", "reply_to", "session_id", "body"]


def _usual_acks(count: int = 2000) -> list[bytes]:
    """The start ack vector as the mock server writes it: compact, envelope keys in its order."""
    out = []
    for raw in _frames("ack-start-ok", count):
        frame = json.loads(raw)
        frame = {k: frame[k] for k in _ACK_ORDER}
        out.append(json.dumps(frame, separators=(",", ":")).encode())
    return out


def _cpu(fn: Callable[[], object], number: int) -> float:
    start = time.process_time()
    for _ in range(number):
        fn()
    return (time.process_time() - start) / number


def ratio(
    ours: Callable[[], object], base: Callable[[], object], rounds: int, number: int
) -> tuple[float, float, float]:
    """Median over *rounds* of ours/base CPU per call; also the medians of each (µs)."""
    pairs = [(_cpu(ours, number), _cpu(base, number)) for _ in range(rounds)]
    return (
        statistics.median(a / b for a, b in pairs),
        statistics.median(a for a, _ in pairs) * 1e6,
        statistics.median(b for _, b in pairs) * 1e6,
    )


def cases() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    ctx = VECTORS["context"]
    reg = Registration(
        ctx["queue_id"],
        [Capability(**c) for c in ctx["capabilities"]],
        4,
        cancellation_notifications=True,
    )
    session = _codec.SessionContext(ctx["session_id"], 2, reg)
    pending = dict.fromkeys(ctx["pending_message_ids"], "task.start").get

    def decoding(name: str) -> tuple[Callable[[], object], Callable[[], object]]:
        made = _usual_acks() if name == "usual ack" else _frames(name)
        frames: Iterator[bytes] = itertools.cycle(made)
        raw: Iterator[bytes] = itertools.cycle(made)
        return (
            lambda: _codec.decode_server_frame(next(frames), session, pending),
            lambda: json.loads(next(raw)),
        )

    ref = AttemptRef("1" * 32, "2" * 32, 3, new_secret())
    result = {"rows": list(range(50)), "ok": True}
    finish = Finish(ref, Outcome.SUCCEEDED, result)
    # The Worker's finish: its result was serialized once already, by the result encoder.
    worker_finish = outcome_of(value=result).finish(ref)

    def encoding(kind: str, body: Any) -> tuple[Callable[[], object], Callable[[], object]]:
        as_dict = {
            "protocol_version": "1",
            "type": kind,
            "message_id": "4" * 32,
            "session_id": "3" * 32,
            "body": _codec.unstructure(body),
        }
        return (
            lambda: _codec.encode_request(kind, "4" * 32, "3" * 32, body),
            lambda: json.dumps(as_dict),
        )

    return {
        "decode start ack": decoding("ack-start-ok"),
        "decode usual ack": decoding("usual ack"),
        "decode assignment": decoding("assign-ok"),
        "encode finish": encoding("task.finish", finish),
        "encode Worker's finish": encoding("task.finish", worker_finish),
        "encode renew": encoding("task.renew", ref),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    print(f"{'figure':<24}{'ours':>10}{'json':>10}{'ratio':>8}   (CPU per call, median)")
    for name, (ours, base) in cases().items():
        r, a, b = ratio(ours, base, args.rounds, args.number)
        print(f"{name:<24}{a:>8.1f}us{b:>8.1f}us{r:>8.2f}")


if __name__ == "__main__":
    main()
