"""Shared pieces of the benchmark harness: percentiles, process meters and child processes.

Process figures come from ``/proc`` (Linux): CPU time is ``utime + stime`` of the whole process
(every thread), so a figure covers everything the process did, not just the calling thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

_TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    """The *q*-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def proc_cpu(pid: int | None = None) -> float:
    """User + system CPU seconds of process *pid* (all threads); this process by default."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name may contain spaces and parentheses: fields start after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM (bytes) and Threads of process *pid* from ``/proc/PID/status``."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out[key] = int(value)
    return out


def child_env() -> dict[str, str]:
    """The environment for child processes: the repository importable, no buffering."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Child:
    """A Python child process speaking one JSON object per line on stdout.

    Its stderr goes to our stderr only when it fails, so a healthy run prints nothing of it.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        python: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self._stderr = _Tail()
        self.proc = subprocess.Popen(
            [python or sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**child_env(), **(env or {})},
            cwd=str(ROOT),
        )
        assert self.proc.stderr is not None
        self._stderr.follow(self.proc.stderr)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self) -> dict[str, Any]:
        """The next JSON line the child prints (a RuntimeError with its stderr if it died)."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(timeout=30)
                raise RuntimeError(
                    f"benchmark child {self.proc.args[1:]} exited {self.proc.returncode}:\n"
                    + self._stderr.text()
                )
            line = line.strip()
            if line.startswith("{"):
                value: dict[str, Any] = json.loads(line)
                return value

    def send(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send one JSON command line and return the child's JSON answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self, timeout: float = 30.0) -> None:
        """Close its stdin (the child's signal to stop) and wait; kill it if it hangs."""
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Tail:
    """Keeps the last lines a pipe printed, read on a daemon thread so the child never blocks."""

    def __init__(self, keep: int = 60) -> None:
        self._lines: list[str] = []
        self._keep = keep
        self._lock = threading.Lock()

    def follow(self, stream: IO[str]) -> None:
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                self._lines.append(line)
                del self._lines[: -self._keep]

    def text(self) -> str:
        with self._lock:
            return "".join(self._lines)


def emit(value: dict[str, Any]) -> None:
    """Print one JSON line (the child side of :class:`Child`)."""
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


def commands() -> Any:
    """Yield the JSON commands read from stdin until it closes (the child side)."""
    for line in sys.stdin:
        line = line.strip()
        if line:
            yield json.loads(line)


def wait_succeeded(worker: Any, n: int, timeout: float) -> bool:
    """Wait until *worker* counts *n* answered finishes; False after *timeout* seconds."""
    # Bench-side wait for the last finishes to be answered, once every handler ran (the
    # lateness run, whose watchdog such polling would delay, waits on a listener instead).
    end = time.monotonic() + timeout
    while worker.stats().succeeded < n:
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


class FloorWaiter:
    """The lateness floor: a bare thread doing the watchdog's kind of timed wait, with nothing to
    do when it wakes; ``floor`` holds how late each 0.1 s wait woke."""

    def __init__(self) -> None:
        self.floor: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        idle = threading.Event()
        while not self._stop.is_set():
            target = time.perf_counter() + 0.1
            idle.wait(0.1)
            self.floor.append(time.perf_counter() - target)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
