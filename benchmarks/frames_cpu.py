"""CPU per server frame of the frame path: ours (``orbit_sync._transport.Transport``) against
websocket-client's own codec (``websocket._abnf.frame_buffer`` and ``ABNF``) over one buffered
read, on the same bytes.

    benchmarks/.venv/bin/python benchmarks/frames_cpu.py [--rounds 7] [--tasks 2000]

Both read the frames a no-op task brings the worker (an assignment, a start ack, a finish ack)
from an in-memory socket that hands out up to 64 KiB per ``recv``, as a burst does: what is timed
is the parsing, not the system calls, which both would make alike (one ``recv`` per chunk). Each
round times the two back to back in CPU time (``time.process_time``); the figures are the medians
of the rounds. websocket-client's side does what ours does per frame: header, length, payload,
its own validation (reserved bits, control frames), our size limit, and the text/continuation
dispatch (``ABNF``'s fragments assembled as ours are).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from websocket._abnf import ABNF, frame_buffer

from orbit_sync._json import MAX_FRAME_BYTES
from orbit_sync._transport import Transport, frame_header

__all__ = ["FRAMES_PER_TASK", "frame_cpu"]

VECTORS = json.loads(
    (Path(__file__).resolve().parent.parent / "tests" / "vectors" / "frames.json").read_text()
)
#: The server frames one no-op task brings the worker: its assignment, the start's and the
#: finish's answers.
FRAMES_PER_TASK = ("assign-ok", "ack-start-ok", "ack-evidence-only")
_CHUNK = 65536


def _payloads() -> list[bytes]:
    by_name = {v["name"]: v["frame"] for v in VECTORS["server_to_client"]}
    return [by_name[name].encode() for name in FRAMES_PER_TASK]


def _stream(tasks: int) -> bytes:
    """*tasks* tasks' server frames, unmasked as a server writes them."""
    one = b"".join(frame_header(0x1, len(p), 0) + p for p in _payloads())
    return one * tasks


class _Socket:
    """An in-memory socket: ``recv(n)`` hands out up to *n* (at most 64 KiB) bytes of *data*."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._at = 0

    def recv(self, n: int) -> bytes:
        at = self._at
        chunk = bytes(self._data[at : at + min(n, _CHUNK)])
        self._at = at + len(chunk)
        return chunk


class _Ws:
    sock: Any = None
    connected = True

    def getheaders(self) -> dict[str, str]:
        return {}


def _ours(data: bytes, frames: int) -> None:
    transport = Transport(_Ws(), _Socket(data))  # type: ignore[arg-type]
    recv = transport.recv_message
    for _ in range(frames):
        recv()


def _theirs(data: bytes, frames: int) -> None:
    sock = _Socket(data)
    buffered = [b"", 0]  # one buffered read, sliced: websocket-client asks for 2-8 bytes at a time

    def recv_fn(n: int) -> bytes:
        buf, at = buffered
        assert isinstance(buf, bytes) and isinstance(at, int)
        if at >= len(buf):
            buf, at = sock.recv(_CHUNK), 0
        out = buf[at : at + n]
        buffered[0], buffered[1] = buf, at + len(out)
        return out

    reader = frame_buffer(recv_fn, skip_utf8_validation=True)
    parts: list[bytes] | None = None
    size = 0
    got = 0
    while got < frames:
        frame = reader.recv_frame()
        opcode = frame.opcode
        n = len(frame.data)
        if opcode == ABNF.OPCODE_TEXT:
            if n > MAX_FRAME_BYTES:
                raise ValueError("over the limit")
            if frame.fin:
                got += 1
            else:
                parts, size = [frame.data], n
        elif opcode == ABNF.OPCODE_CONT:
            assert parts is not None
            size += n
            if size > MAX_FRAME_BYTES:
                raise ValueError("over the limit")
            parts.append(frame.data)
            if frame.fin:
                b"".join(parts)
                parts, got = None, got + 1


def _time(fn: Callable[[bytes, int], None], data: bytes, frames: int) -> float:
    start = time.process_time()
    fn(data, frames)
    return (time.process_time() - start) / frames


def frame_cpu(*, rounds: int = 7, tasks: int = 2000) -> tuple[float, float]:
    """Seconds of CPU per server frame: (ours, websocket-client's), medians of *rounds*."""
    data = _stream(tasks)
    frames = tasks * len(FRAMES_PER_TASK)
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(_time(_ours, data, frames))
        theirs.append(_time(_theirs, data, frames))
    return statistics.median(ours), statistics.median(theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tasks", type=int, default=2000)
    args = parser.parse_args()
    ours, theirs = frame_cpu(rounds=args.rounds, tasks=args.tasks)
    per_task = len(FRAMES_PER_TASK)
    print(f"per frame: ours {ours * 1e6:.2f} us, websocket-client {theirs * 1e6:.2f} us")
    print(f"per no-op task ({per_task} server frames): {(theirs - ours) * per_task * 1e6:+.2f} us")


if __name__ == "__main__":
    main()
